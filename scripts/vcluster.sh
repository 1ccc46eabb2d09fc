#!/usr/bin/env bash
# A virtual cluster on one machine: N hosts h0..h(N-1), each a network namespace (and a UTS
# namespace, so `hostname` says h0, h1, ...) with one veth NIC "eth0" into a bridge (the switch,
# in a namespace of its own). Every NIC is shaped to RATE in BOTH directions (a tbf on the host's
# end shapes what the host sends, a tbf on the switch's end what it receives), so each host has a
# full-duplex link of RATE, as on a real cluster; one shared loopback (the old netshape.sh) split
# one budget between both directions and both ranks and made communication cost about twice as
# much.
#
#   scripts/vcluster.sh [--delay TIME] [--rate-schedule SCHEDULE] N RATE -- COMMAND...
#       e.g. scripts/vcluster.sh 2 1gbit -- mpirun -np 2 -H h0,h1 python train.py
#            scripts/vcluster.sh 4 1gbit -- horovodrun -np 4 -H h0:1,h1:1,h2:1,h3:1 --gloo python train.py
#            scripts/vcluster.sh --rate-schedule 1gbit,250mbit@40,1gbit@80 2 1gbit -- mpirun ...
#
# COMMAND runs on h0 (the login node), where `mpirun -H h0,h1,...` and `horovodrun -H h0:1,...`
# launch ranks on the hosts exactly as on a real cluster: Open MPI through a remote-shell agent
# (OMPI_MCA_plm_rsh_agent) and horovodrun through an `ssh` shim first on PATH, both of which run
# the remote command with `ip netns exec` in the host's namespaces, in a fresh login-like
# environment (HOME, PATH, LANG and VCLUSTER_* only: pass variables with `mpirun -x`, as with
# ssh). Names come from /etc/netns/<namespace>/hosts, which `ip netns exec` bind-mounts over
# /etc/hosts. Host addresses (10.77.0.0/16) exist only inside the namespaces; no route out.
# Also set for COMMAND: OMPI_MCA_{btl,oob}_tcp_if_include=eth0, HOROVOD_GLOO_IFACE=eth0,
# GLOO_SOCKET_IFNAME=eth0, VCLUSTER_HOSTS (h0,h1,...), VCLUSTER_RATE (the start rate),
# VCLUSTER_N, VCLUSTER_RATE_SCHEDULE and VCLUSTER_RATE_LOG (below).
#
# --rate-schedule RATE0,RATE1@T1,RATE2@T2,... changes every NIC (both directions) to RATEk at Tk
# seconds after COMMAND started (0 < T1 < T2 < ..., decimals allowed), as a shared network's
# spare capacity changes under a job. The first entry, without @, is the start rate and must
# equal RATE (1gbit and 1000mbit are equal); a schedule that starts with an @ entry starts at
# RATE. A background process applies each change with `tc qdisc change` on every NIC at once.
# VCLUSTER_RATE_SCHEDULE is the schedule with the start written as @0 (1gbit@0,250mbit@40,...;
# RATE@0 alone without --rate-schedule). VCLUSTER_RATE_LOG names a file with one line per rate
# in force, "EPOCH_S RATE AT_S TOOK_S" (after a # header): EPOCH_S (time.time() seconds) is when
# every NIC had RATE, TOOK_S how long the change took before that, AT_S the scheduled offset; the
# first line is the start (AT_S 0, EPOCH_S = when COMMAND was launched), so a benchmark can tell
# which iterations ran at which rate. It lives in the cluster's temporary directory and goes
# with it, unless VCLUSTER_RATE_LOG is set on entry: then that file is written and kept.
#
# --mtu BYTES (or VCLUSTER_MTU; default 1500) sets every NIC's MTU: 9000 gives jumbo frames, as
# GPU clusters' Ethernet and RoCE fabrics use; tbf counts every header, so at 1500 bytes TCP's
# payload is 95.7% of RATE, at 9000 99.3%. --no-slow-start-after-idle sets
# net.ipv4.tcp_slow_start_after_idle=0 in every host (a ring all-reduce's connections idle
# between steps; a datacenter TCP keeps its window), as the emulated cluster (docs/benchmarks.md)
# runs.
#
# --delay TIME (or VCLUSTER_DELAY) adds a one-way latency per NIC direction with netem where the
# kernel has it. This machine's kernel has NO netem ("Specified qdisc kind is unknown"): there
# the option fails with that message rather than running without the latency.
#
# Everything (namespaces, veths, bridge, /etc/netns entries, the shims, the rate scheduler,
# processes left in the namespaces) is removed on every exit path: success, failure, Ctrl-C,
# SIGTERM. Needs root (CAP_NET_ADMIN, and mounts for `ip netns exec`); without it this says so
# and exits 3: there is no fallback to an unshaped run.
set -uo pipefail

die() { echo "vcluster.sh: error: $1" >&2; exit "${2:-2}"; }
usage="usage: scripts/vcluster.sh [--delay TIME] [--mtu BYTES] [--no-slow-start-after-idle] \
[--rate-schedule RATE,RATE@SECONDS,...] N RATE \
-- COMMAND...   (e.g. 2 1gbit -- mpirun -np 2 -H h0,h1 hostname)"
example="e.g. --rate-schedule 1gbit,250mbit@40,1gbit@80 (1gbit from the start, 250mbit from 40 s, \
1gbit again from 80 s)"

delay=${VCLUSTER_DELAY:-} schedule= scheduled= mtu=${VCLUSTER_MTU:-1500} ssai=1
while [ $# -gt 0 ]; do
    case $1 in
        --delay) [ $# -ge 2 ] || die "--delay needs a TIME. $usage"; delay=$2; shift 2 ;;
        --mtu) [ $# -ge 2 ] || die "--mtu needs a byte count. $usage"; mtu=$2; shift 2 ;;
        --no-slow-start-after-idle) ssai=0; shift ;;
        --rate-schedule) [ $# -ge 2 ] || die "--rate-schedule needs a schedule, $example"
            schedule=$2 scheduled=1; shift 2 ;;
        --*) die "unknown option '$1'. $usage" ;;
        *) break ;;
    esac
done
[ $# -ge 2 ] || die "$usage"
n=$1 rate=$2
shift 2
[ "${1:-}" = "--" ] || die "expected -- after N and RATE. $usage"
shift
[ $# -gt 0 ] || die "no COMMAND given after --. $usage"
[[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 200 ] \
    || die "N must be a host count from 1 to 200, got '$n'"
[[ $mtu =~ ^[0-9]+$ ]] && [ "$mtu" -ge 576 ] && [ "$mtu" -le 65535 ] \
    || die "--mtu must be a byte count from 576 to 65535, got '$mtu'"

# A tc bit rate in bytes per second (needed to size the queue and the bucket); fails otherwise.
rate_bytes() {
    [[ ${1,,} =~ ^([0-9]+(\.[0-9]+)?)(bit|kbit|mbit|gbit|tbit)$ ]] || return 1
    local mult
    case ${BASH_REMATCH[3]} in
        bit) mult=1 ;; kbit) mult=1000 ;; mbit) mult=1000000 ;; gbit) mult=1000000000 ;;
        tbit) mult=1000000000000 ;;
    esac
    awk -v v="${BASH_REMATCH[1]}" -v m="$mult" 'BEGIN { printf "%.0f", v * m / 8 }'
}
rate_bps=$(rate_bytes "$rate") \
    || die "RATE must be a tc bit rate such as 200mbit, 1gbit or 10gbit, got '$rate'"
[ "$rate_bps" -ge 125000 ] || die "RATE $rate is below 1mbit: too slow for an MPI job"

# The schedule as parallel lists, entry 0 the start: rates, their bytes/s, offsets in us and as
# written. Checked in full here, before anything is created.
rates=("$rate") rates_bps=("$rate_bps") at_us=(0) at_s=(0)
bad_schedule() { die "--rate-schedule '$schedule': $1; $example"; }
if [ -n "$scheduled" ]; then
    [ -n "$schedule" ] || bad_schedule "it is empty"
    IFS=, read -ra entries <<< "$schedule,"   # the trailing comma keeps an empty last entry
    for ((k = 0; k < ${#entries[@]}; k++)); do
        entry=${entries[k]} r=${entries[k]%%@*} t=
        [ -n "$entry" ] || bad_schedule "entry $((k + 1)) is empty (a stray comma?)"
        [[ $entry == *@* ]] && t=${entry#*@}
        bps=$(rate_bytes "$r") || bad_schedule "'$r' in '$entry' is not a tc bit rate such as \
200mbit, 1gbit or 10gbit"
        [ "$bps" -ge 125000 ] || bad_schedule "$r in '$entry' is below 1mbit: too slow for an MPI job"
        if [[ $entry != *@* ]]; then
            [ "$k" = 0 ] || bad_schedule "'$entry' has no @SECONDS: only the first entry, the start \
rate, goes without a time"
            [ "$bps" = "$rate_bps" ] || bad_schedule "it starts at $r but RATE is $rate: make \
them the same (or drop the first entry to start at RATE)"
            rates[0]=$r   # as the schedule writes it; the same bytes/s as RATE
            continue
        fi
        [[ $t == -* ]] && bad_schedule "time $t in '$entry' is negative: times are seconds after \
COMMAND starts"
        [[ $t =~ ^[0-9]+(\.[0-9]+)?$ ]] || bad_schedule "'$t' in '$entry' is not a time in \
seconds such as 40 or 2.5"
        us=$(awk -v v="$t" 'BEGIN { printf "%.0f", v * 1000000 }')
        [ "$us" -gt 0 ] || bad_schedule "'$entry' changes the rate at 0 s: the rate from the \
start is the first entry, without @"
        [ "$us" -gt "${at_us[-1]}" ] || bad_schedule "times must increase, but '$entry' comes after \
${rates[-1]}@${at_s[-1]}: list the changes in time order"
        rates+=("$r") rates_bps+=("$bps") at_us+=("$us") at_s+=("$t")
    done
fi
schedule_env=
for ((k = 0; k < ${#rates[@]}; k++)); do schedule_env+=${schedule_env:+,}${rates[k]}@${at_s[k]}; done

[ "$(id -u)" = 0 ] || die "needs root (network namespaces, veths, tc and the mounts of \
'ip netns exec' need CAP_NET_ADMIN and CAP_SYS_ADMIN); rerun as root or with sudo. Nothing \
was run: benchmarks never fall back to an unshaped network." 3
for tool in ip tc unshare; do
    command -v "$tool" >/dev/null || die "'$tool' not found: apt-get install -y iproute2 util-linux" 3
done

# Queue sizing. A host's NIC queue must hold, without a drop, the largest burst its TCP senders
# can put in it at once: all-reduce writes a whole fused message (up to HOROVOD_FUSION_THRESHOLD,
# 128 MiB by default) into its sockets in one go, and with no drops each connection's window
# grows until its socket buffer bounds it, so the queue fills up to the bytes in flight. A
# drop-tail queue shorter than that drops on every all-reduce burst, and each drop halves a TCP
# window: the link then runs well under RATE and the figures measure TCP's recovery, not the
# scheduler. So the limit is the largest fused message plus one bandwidth-delay product (RATE x
# an RTT of 2 x delay, 1 ms at least) for the other flows. A long queue costs no memory unless
# filled, and the delay it adds when full is what a deep-buffered switch port adds too. The
# bucket (burst) must exceed the largest packet (GSO on veth makes 64 KiB ones; smaller drops
# them all); half a millisecond at RATE, 256 KiB at least, keeps line-rate bursts short.
# Under --rate-schedule the bucket follows each rate but the limit takes the schedule's fastest:
# the rule then holds at every rate, and a queue filled at a fast rate is not cut short (drops)
# when the rate falls.
fusion=${HOROVOD_FUSION_THRESHOLD:-134217728}
[[ $fusion =~ ^[0-9]+$ ]] || die "HOROVOD_FUSION_THRESHOLD must be a byte count, got '$fusion'"
delay_us=0
if [ -n "$delay" ]; then
    if [[ $delay =~ ^([0-9]+(\.[0-9]+)?)(us|ms|s)$ ]]; then
        delay_us=$(awk -v v="${BASH_REMATCH[1]}" -v u="${BASH_REMATCH[3]}" \
            'BEGIN { m = (u == "us") ? 1 : (u == "ms") ? 1000 : 1000000; printf "%.0f", v * m }')
    else
        die "--delay must be a time such as 50us or 1ms, got '$delay'"
    fi
fi
rtt_us=$(( 2 * delay_us > 1000 ? 2 * delay_us : 1000 ))
fastest=0 bursts=()
for bps in "${rates_bps[@]}"; do
    [ "$bps" -gt "$fastest" ] && fastest=$bps
    bursts+=($(( bps / 2000 > 262144 ? bps / 2000 : 262144 )))
done
limit=$(( fusion + fastest * rtt_us / 1000000 ))
burst=${bursts[0]}

rate_log=
if [ -n "${VCLUSTER_RATE_LOG:-}" ]; then
    rate_log=$(realpath -m -- "$VCLUSTER_RATE_LOG")   # absolute: remote ranks start in $HOME
    : 2>/dev/null > "$rate_log" || die "cannot write the rate log VCLUSTER_RATE_LOG=$rate_log: \
point it at a writable file, or unset it to log into the cluster's temporary directory"
fi

tag=vc$$
sw=$tag-sw
shim=$(mktemp -d /tmp/vcluster.XXXXXX)
rate_log=${rate_log:-$shim/rate.log}
hosts=()
for ((i = 0; i < n; i++)); do hosts+=("h$i"); done
child= sched=

cleanup() {
    trap - EXIT INT TERM HUP USR1
    # the rate scheduler first, so that no rate change races the teardown
    if [ -n "$sched" ]; then kill -TERM "$sched" 2>/dev/null; wait "$sched" 2>/dev/null; fi
    [ -n "$child" ] && kill -TERM "$child" 2>/dev/null
    local ns pids
    for ns in "${hosts[@]/#/$tag-}" "$sw"; do
        # processes still running in our namespaces were started by COMMAND: end them first
        pids=$(ip netns pids "$ns" 2>/dev/null)
        # shellcheck disable=SC2086
        [ -n "$pids" ] && kill -TERM $pids 2>/dev/null
    done
    sleep 0.2
    for ns in "${hosts[@]/#/$tag-}" "$sw"; do
        pids=$(ip netns pids "$ns" 2>/dev/null)
        # shellcheck disable=SC2086
        [ -n "$pids" ] && kill -KILL $pids 2>/dev/null
        ip netns del "$ns" 2>/dev/null   # takes its veth ends (and the bridge) with it
        rm -rf "/etc/netns/$ns"
    done
    rm -rf "$shim"
}
trap 'cleanup' EXIT
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM
trap 'cleanup; exit 129' HUP
trap 'cleanup; exit 3' USR1   # the rate scheduler could not apply a change (it said why)

fail() { echo "vcluster.sh: error: $*" >&2; exit 3; }

ip netns add "$sw" 2>/dev/null || fail "cannot create network namespace $sw (ip netns add): \
is this a container without CAP_SYS_ADMIN?"
ip -n "$sw" link set lo up
ip -n "$sw" link add br0 type bridge || fail "cannot create a bridge (kernel without bridge support?)"
ip -n "$sw" link set br0 up

# Adds the shaping to one veth end: tbf (and netem beneath it when --delay is given).
shape() {
    local ns=$1 dev=$2
    ip netns exec "$ns" tc qdisc replace dev "$dev" root handle 1: tbf rate "$rate" \
        burst "$burst" limit "$limit" || fail "tc tbf on $dev in $ns failed"
    if [ "$delay_us" -gt 0 ]; then
        ip netns exec "$ns" tc qdisc add dev "$dev" parent 1:1 handle 10: netem \
            delay "${delay_us}us" limit 1000000 2>/dev/null \
            || fail "--delay $delay needs netem, which this kernel does not have \
('Specified qdisc kind is unknown'); run without --delay"
    fi
}

hosts_file="127.0.0.1 localhost"
for ((i = 0; i < n; i++)); do hosts_file+=$'\n'"10.77.$((i / 250)).$((i % 250 + 1)) h$i"; done
for ((i = 0; i < n; i++)); do
    ns=$tag-h$i
    ip netns add "$ns" || fail "cannot create network namespace $ns"
    mkdir -p "/etc/netns/$ns"
    printf '%s\n' "$hosts_file" > "/etc/netns/$ns/hosts"
    echo "h$i" > "/etc/netns/$ns/hostname"
    ip -n "$sw" link add "h$i" type veth peer name eth0 netns "$ns" || fail "cannot create veth for h$i"
    ip -n "$sw" link set "h$i" mtu "$mtu" master br0 up || fail "cannot set MTU $mtu on h$i"
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "10.77.$((i / 250)).$((i % 250 + 1))/16" dev eth0
    ip -n "$ns" link set eth0 mtu "$mtu" up || fail "cannot set MTU $mtu on eth0 of h$i"
    ip netns exec "$ns" sysctl -qw net.ipv4.tcp_slow_start_after_idle="$ssai" \
        || fail "cannot set tcp_slow_start_after_idle in $ns"
    shape "$ns" eth0          # what h$i sends
    shape "$sw" "h$i"         # what h$i receives
done

# The remote shell: `rsh HOST COMMAND...` runs COMMAND on HOST as ssh would (a shell, a fresh
# environment, the home directory). Open MPI calls it as its rsh agent; `ssh` is the same with
# ssh's options skipped, for horovodrun (which calls `ssh -o ... HOST -p PORT 'cd DIR; CMD'`).
cat > "$shim/rsh" <<EOF
#!/usr/bin/env bash
# ssh's options may come before and after the host (horovodrun puts -o ConnectTimeout after it)
host=
while [ \$# -gt 0 ]; do
    case \$1 in
        -[oiplFJEbcDeLmQRSWw]) shift 2 ;;
        -*) shift ;;
        *) [ -n "\$host" ] && break; host=\$1; shift ;;
    esac
done
[ -n "\$host" ] || { echo "usage: rsh HOST COMMAND..." >&2; exit 255; }
case " ${hosts[*]} " in
    *" \$host "*) ;;
    *) echo "vcluster rsh: unknown host '\$host' (this cluster has ${hosts[*]})" >&2; exit 255 ;;
esac
[ \$# -gt 0 ] || { echo "vcluster rsh: no command for \$host (interactive logins are not offered)" >&2; exit 255; }
exec ip netns exec "$tag-\$host" unshare --uts /bin/sh -c 'hostname "\$0" && cd "\$HOME" && exec "\$@"' \\
    "\$host" env -i HOME="\${HOME:-/root}" USER="\${USER:-root}" LANG="\${LANG:-C.UTF-8}" \\
    PATH="$shim:\$PATH" OMPI_MCA_plm_rsh_agent="$shim/rsh" VCLUSTER_HOSTS="$(IFS=,; echo "${hosts[*]}")" \\
    VCLUSTER_RATE="$rate" VCLUSTER_N="$n" VCLUSTER_MTU="$mtu" VCLUSTER_RATE_SCHEDULE="$schedule_env" \\
    VCLUSTER_RATE_LOG=$(printf %q "$rate_log") /bin/bash -c "\$*"
EOF
cp "$shim/rsh" "$shim/ssh"
chmod +x "$shim/rsh" "$shim/ssh"

if ! ip netns exec "$tag-h0" true 2>/dev/null; then
    fail "'ip netns exec' does not work here (it needs to mount /sys and bind-mount /etc/netns)"
fi

# The rate scheduler. Each change is one `tc -batch` per namespace, all started at once (the
# switch's batch holds the receive side of every host), so every NIC changes within a few
# milliseconds; the batches are written now to keep that short.
changes=
for ((k = 1; k < ${#rates[@]}; k++)); do
    spec="root handle 1: tbf rate ${rates[k]} burst ${bursts[k]} limit $limit"
    echo "qdisc change dev eth0 $spec" > "$shim/rate$k.host"
    for h in "${hosts[@]}"; do echo "qdisc change dev $h $spec"; done > "$shim/rate$k.sw"
    changes+=", ${rates[k]} from ${at_s[k]} s"
done
now() { now_us=${EPOCHREALTIME//[.,]/}; }           # microseconds since the epoch, no fork
stamp() { printf -v "$1" '%d.%06d' $(($2 / 1000000)) $(($2 % 1000000)); }

rate_scheduler() {
    local k pid ok sleeper= begin left secs epoch took tcs=()
    trap 'kill $sleeper "${tcs[@]}" 2>/dev/null; exit 0' TERM HUP
    for ((k = 1; k < ${#rates[@]}; k++)); do
        while now; left=$(( t0_us + at_us[k] - now_us )); [ "$left" -gt 0 ]; do
            # a second at most, so that a scheduler whose vcluster.sh was killed (-9) ends soon
            kill -0 "$$" 2>/dev/null || exit 0
            stamp secs $(( left < 1000000 ? left : 1000000 ))
            sleep "$secs" & sleeper=$!
            wait "$sleeper"; sleeper=
        done
        begin=$now_us
        tc -n "$sw" -batch "$shim/rate$k.sw" & tcs=($!)
        for h in "${hosts[@]}"; do tc -n "$tag-$h" -batch "$shim/rate$k.host" & tcs+=($!); done
        ok=1
        for pid in "${tcs[@]}"; do wait "$pid" || ok=; done
        tcs=()
        now
        if [ -z "$ok" ]; then
            echo "vcluster.sh: error: the change to ${rates[k]} at ${at_s[k]} s failed on a NIC (tc" \
                 "above); COMMAND is stopped, as its figures would mix rates" >&2
            kill -USR1 "$$"
            exit 1
        fi
        stamp epoch "$now_us"
        stamp took $(( now_us - begin ))
        echo "$epoch ${rates[k]} ${at_s[k]} $took" >> "$rate_log"
    done
}

echo "[vcluster] $n host(s) ${hosts[*]} on one switch, each NIC $rate both ways (tbf burst" \
     "$burst B, queue $limit B, MTU $mtu)${delay:+, +$delay each way}${changes}$( \
     [ "$ssai" = 0 ] && echo ', no slow start after idle'); command on h0" >&2

now; t0_us=$now_us
stamp epoch "$t0_us"
printf '# vcluster.sh rates: EPOCH_S RATE AT_S TOOK_S (EPOCH_S: every NIC at RATE)\n%s %s 0 0\n' \
    "$epoch" "${rates[0]}" > "$rate_log"

ip netns exec "$tag-h0" unshare --uts /bin/sh -c 'hostname h0 && exec "$@"' h0 \
    env PATH="$shim:$PATH" OMPI_MCA_plm_rsh_agent="$shim/rsh" \
    OMPI_MCA_btl_tcp_if_include=eth0 OMPI_MCA_oob_tcp_if_include=eth0 \
    HOROVOD_GLOO_IFACE=eth0 GLOO_SOCKET_IFNAME=eth0 \
    VCLUSTER_HOSTS="$(IFS=,; echo "${hosts[*]}")" VCLUSTER_RATE="$rate" VCLUSTER_N="$n" \
    VCLUSTER_RATE_SCHEDULE="$schedule_env" VCLUSTER_RATE_LOG="$rate_log" VCLUSTER_MTU="$mtu" \
    VCLUSTER_NAMESPACE_PREFIX="$tag-" "$@" &
child=$!
if [ ${#rates[@]} -gt 1 ]; then rate_scheduler & sched=$!; fi
wait "$child"
status=$?
child=
exit $status
