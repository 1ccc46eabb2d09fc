#!/usr/bin/env bash
# One torchrun per host of the virtual cluster (scripts/vcluster.sh): the torch.distributed
# counterpart of `mpirun -H h0,h1,...` and `horovodrun -H h0:1,...`, since torchrun itself starts
# ranks on its own host only.
#
#   scripts/vcluster.sh N RATE -- scripts/torchrun_cluster.sh [OPTIONS] N COMMAND...
#       e.g. scripts/vcluster.sh 2 1gbit -- scripts/torchrun_cluster.sh 2 python train.py --epochs 1
#
# Host i (h0..h(N-1), from VCLUSTER_HOSTS) runs, through the cluster's ssh shim and in the
# current directory:
#   torchrun --nnodes N --node-rank i --master-addr h0 --master-port PORT --nproc-per-node 1 \
#       --no-python COMMAND...
# so COMMAND is a whole command line (python train.py ..., python -m pkg ...), and each rank
# finds RANK, WORLD_SIZE, MASTER_ADDR and the rest in its environment, as under torchrun anywhere.
#
# The hosts start from a fresh environment (vcluster.sh's ssh keeps HOME, PATH, LANG and
# VCLUSTER_* only); this passes on GLOO_SOCKET_IFNAME (eth0 unless set: Gloo must use the
# shaped NIC, not the loopback), PYTHONPATH and every DCREDIT_* variable that is set, and those
# named by -x.
#
# Options:
#   --port PORT      the rendezvous port on h0 (default 29500)
#   -x NAME[=VALUE]  also pass NAME (its value here, or VALUE) to every host; repeatable
#   --grace SECONDS  how long stopping torchruns may take before they are killed (default 40:
#                    torchrun gives its workers 30 s after a SIGTERM)
# TORCHRUN names the torchrun to use (default: the one on PATH).
#
# Exit status: 0 when every host's torchrun succeeded. When one fails, the others are stopped
# (SIGTERM, then SIGKILL for them and their workers after --grace) and this exits with the
# failed one's status. SIGINT, SIGTERM and SIGHUP are forwarded to every torchrun (each starts
# its own session here, so a terminal's Ctrl-C reaches them only through this), which stop
# their workers; this then exits 130, 143 or 129.
set -uo pipefail

die() { echo "torchrun_cluster.sh: error: $1" >&2; exit "${2:-2}"; }
usage="usage: scripts/torchrun_cluster.sh [--port PORT] [-x NAME[=VALUE]]... [--grace SECONDS] \
N COMMAND...   (under scripts/vcluster.sh, e.g. scripts/vcluster.sh 2 1gbit -- \
scripts/torchrun_cluster.sh 2 python train.py)"

port=29500 grace=40 passed=()
while [ $# -gt 0 ]; do
    case $1 in
        --port) [ $# -ge 2 ] || die "--port needs a port number. $usage"; port=$2; shift 2 ;;
        --grace) [ $# -ge 2 ] || die "--grace needs seconds. $usage"; grace=$2; shift 2 ;;
        -x) [ $# -ge 2 ] || die "-x needs a variable NAME or NAME=VALUE. $usage"
            passed+=("$2"); shift 2 ;;
        --) shift; break ;;
        -*) die "unknown option '$1'. $usage" ;;
        *) break ;;
    esac
done
[ $# -ge 2 ] || die "$usage"
n=$1
shift
[[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] || die "N must be a host count of at least 1, got '$n'"
[[ $port =~ ^[0-9]+$ ]] && [ "$port" -ge 1 ] && [ "$port" -le 65535 ] \
    || die "--port must be a port number from 1 to 65535, got '$port'"
[[ $grace =~ ^[0-9]+$ ]] || die "--grace must be whole seconds, got '$grace'"
[ -n "${VCLUSTER_HOSTS:-}" ] || die "VCLUSTER_HOSTS is not set: run this under \
scripts/vcluster.sh, e.g. scripts/vcluster.sh $n 1gbit -- scripts/torchrun_cluster.sh $n COMMAND..."
IFS=, read -ra cluster <<< "$VCLUSTER_HOSTS"
[ "$n" -le "${#cluster[@]}" ] || die "N=$n, but this cluster has ${#cluster[@]} host(s) \
(${VCLUSTER_HOSTS}): start scripts/vcluster.sh with at least $n"
torchrun=${TORCHRUN:-torchrun}
command -v "$torchrun" >/dev/null || die "'$torchrun' not found on PATH: put the virtual \
environment's bin first on PATH (PATH=.venv/bin:\$PATH) or set TORCHRUN=/path/to/torchrun"
torchrun=$(command -v "$torchrun")

# The variables every host gets, as NAME=VALUE words.
environment=("GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-eth0}")
[ -n "${PYTHONPATH+set}" ] && environment+=("PYTHONPATH=$PYTHONPATH")
while IFS= read -r name; do environment+=("$name=${!name}"); done \
    < <(compgen -e | grep '^DCREDIT_' || true)
for item in "${passed[@]}"; do
    name=${item%%=*}
    [[ $name =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || die "-x '$item': not a variable NAME or NAME=VALUE"
    if [[ $item == *=* ]]; then
        environment+=("$item")
    elif [ -n "${!name+set}" ]; then
        environment+=("$name=${!name}")
    else
        die "-x $name: $name is not set here (give it a value: -x $name=VALUE)"
    fi
done

pids=()
declare -A host_of=()

running() {         # whether process $1 runs (a child that ended stays a zombie until waited)
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [ "${stat%% *}" != Z ]
}

# Stops every torchrun still running: SIGTERM to its process group (torchrun then stops its
# workers), SIGKILL to it and its descendants (collected first) after --grace seconds.
stop_all() {
    local pid deadline tree
    for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done
    deadline=$((SECONDS + grace))
    for pid in "${pids[@]}"; do
        while running "$pid" && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.1; done
        if running "$pid"; then
            echo "torchrun_cluster.sh: torchrun on ${host_of[$pid]} ignored SIGTERM for" \
                 "$grace s: killing it and its workers" >&2
            tree=$(descendants "$pid")
            # shellcheck disable=SC2086
            kill -KILL "$pid" $tree 2>/dev/null
        fi
        wait "$pid" 2>/dev/null
    done
    pids=()
}

descendants() {     # every process below $1, children first
    local child
    for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do
        echo "$child"
        descendants "$child"
    done
}

on_signal() {       # on_signal STATUS
    trap - INT TERM HUP
    echo "torchrun_cluster.sh: signalled: stopping the torchrun on every host" >&2
    stop_all
    exit "$1"
}
trap 'on_signal 130' INT
trap 'on_signal 143' TERM
trap 'on_signal 129' HUP

for ((i = 0; i < n; i++)); do
    host=${cluster[i]}
    remote=$(printf '%q ' cd "$PWD")"&& exec "$(printf '%q ' env "${environment[@]}" \
        "$torchrun" --nnodes "$n" --node-rank "$i" --master-addr "${cluster[0]}" \
        --master-port "$port" --nproc-per-node 1 --no-python "$@")
    # its own session: signals reach it (and its process group) only through this script
    setsid ssh "$host" "$remote" &
    pids+=($!)
    host_of[$!]=$host
done

while [ ${#pids[@]} -gt 0 ]; do
    finished=
    wait -n -p finished "${pids[@]}"
    status=$?
    # a trapped signal never returns here (on_signal exits); no pid means no such child
    [ -n "$finished" ] || die "lost track of the torchruns (wait: status $status)" 3
    left=()
    for pid in "${pids[@]}"; do [ "$pid" = "$finished" ] || left+=("$pid"); done
    pids=("${left[@]}")
    if [ "$status" -ne 0 ]; then
        echo "torchrun_cluster.sh: error: the torchrun on ${host_of[$finished]} exited with" \
             "status $status: stopping the others" >&2
        stop_all
        exit "$status"
    fi
done
exit 0
