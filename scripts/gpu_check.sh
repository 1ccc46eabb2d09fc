#!/usr/bin/env bash
# The GPU check of dcredit_hvd, on a machine with one CUDA GPU, no network, the machine's own
# torch (with CUDA), nvcc, NCCL and CMake, and the wheels of scripts/gpu_wheelhouse.sh in
# .gpu_wheels beside the repository's files (docs/gpu.md):
#
#   bash scripts/gpu_check.sh OUTDIR
#
# Stages (each with a time limit, all within GPU_CHECK_BUDGET seconds, 560 by default):
#   env        OUTDIR/env.txt: nvidia-smi, python, torch, CUDA, NCCL, tools
#   zoo        scripts/gpu_profile_zoo.py: per-layer profiles of ResNet-50, VGG-16 and GPT-2
#              small on the GPU, then simulator predictions for 8-128 GPUs at 10-400 Gbit/s
#              (OUTDIR/predictions.md, .json), beside the builds (which run at a lower priority)
#   install    two offline installs (scripts/install.sh), in parallel: .gpu_check/venv-nccl with
#              Horovod's NCCL operations, .gpu_check/venv-host without GPU operations (Horovod
#              then copies CUDA tensors to the host itself, so plain hvd.DistributedOptimizer can
#              run two ranks on one GPU); Gloo for CPU operations, MPI only if the machine has it
#   parity     tests/multirank/test_cuda.py on 2 ranks sharing the GPU (horovodrun --gloo): with
#              the NCCL build and DCREDIT_CUDA_STAGING=1, then (last) with the host build and the
#              default path; the direct NCCL path on 1 rank; the torch.distributed transport
#              over NCCL on 1 rank (scripts/nccl_transport_check.py); OUTDIR/parity.txt
#   bench      python -m dcredit_hvd.bench --device cuda on 2 ranks (host build): dcredit_hvd's
#              policies against plain Horovod; OUTDIR/bench.txt, OUTDIR/bench.json
#   summary    OUTDIR/summary.txt; logs and profiles packed into OUTDIR/details.tar.gz
# A failed stage is recorded and the next one runs; the exit status is 0 when none failed.
#
# Knobs: GPU_WHEELS (default .gpu_wheels), GPU_CHECK_WORK (.gpu_check), GPU_CHECK_BUDGET (560),
# DCREDIT_PYTHON (the python that has torch; found otherwise), GPU_CHECK_PACK=0 (keep logs/ and
# profiles/ as folders), GPU_CHECK_ALLOW_CPU=1 (a dry run of every stage on a machine with no
# GPU: smaller zoo run, CUDA tests skip).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [ $# -ne 1 ]; then echo "usage: bash scripts/gpu_check.sh OUTDIR" >&2; exit 2; fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
WHEELS=${GPU_WHEELS:-$ROOT/.gpu_wheels}
WORK=${GPU_CHECK_WORK:-$ROOT/.gpu_check}
BUDGET=${GPU_CHECK_BUDGET:-560}
ALLOW_CPU=${GPU_CHECK_ALLOW_CPU:-0}
PACK=${GPU_CHECK_PACK:-1}
VNCCL=$WORK/venv-nccl
VHOST=$WORK/venv-host
LOGS=$OUT/logs
PROFILES=$OUT/profiles
RESERVE=20                       # seconds kept for the summary and the packing
START=$(date +%s)
DEADLINE=$((START + BUDGET))
STATUS_FILE=$OUT/.status
FAILED=0

mkdir -p "$WORK" "$LOGS" "$PROFILES"
: >"$STATUS_FILE"
cd "$ROOT" || exit 2
export PYTHONUNBUFFERED=1
export DCREDIT_STALL_ABORT_SECONDS=${DCREDIT_STALL_ABORT_SECONDS:-60}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
HVDRUN=(horovodrun -np 2 -H localhost:2 --gloo)

now() { date +%s; }
stamp() { date -u '+%H:%M:%S'; }
elapsed() { echo $(($(now) - START)); }
say() { printf '[gpu-check %s +%ss] %s\n' "$(stamp)" "$(elapsed)" "$*"; }
# Seconds a stage may take: its cap, or what is left before the deadline (less the reserve).
limit() {
    local left=$((DEADLINE - $(now) - RESERVE))
    if [ "$left" -lt "$1" ]; then echo "$left"; else echo "$1"; fi
}
# record STAGE RESULT SECONDS NOTE: RESULT is PASS, FAIL, TIMEOUT or SKIP (FAIL and TIMEOUT fail
# the run; SKIP is for what cannot apply here, said in NOTE).
record() {
    printf '%-14s %-8s %5ss  %s\n' "$1" "$2" "$3" "$4" >>"$STATUS_FILE"
    case "$2" in FAIL|TIMEOUT) FAILED=1;; esac
    say "stage $1: $2 ($3 s) $4"
}
result_of() {   # exit status -> PASS / TIMEOUT / FAIL
    case "$1" in 0) echo PASS;; 124|137) echo TIMEOUT;; *) echo FAIL;; esac
}
passed() { grep -q "^$1 *PASS" "$STATUS_FILE"; }
# run STAGE CAP LOG CMD...: CMD under `timeout`, output to LOG, recorded.
run() {
    local stage=$1 cap=$2 log=$3 t s rc
    shift 3
    t=$(limit "$cap")
    if [ "$t" -lt 10 ]; then record "$stage" TIMEOUT 0 "not started: the ${BUDGET}s budget is spent"; return 1; fi
    say "stage $stage: start (limit ${t}s) -> ${log#"$OUT"/}"
    s=$(now)
    timeout -k 10 "$t" "$@" >"$log" 2>&1
    rc=$?
    record "$stage" "$(result_of "$rc")" $(($(now) - s)) "exit $rc"
    return "$rc"
}

# -- the machine's python: the first that imports torch (one that sees a GPU preferred) ------
pick_python() {
    local c fallback=""
    for c in "${DCREDIT_PYTHON:-}" python3 /opt/torch/.venv/bin/python3 /opt/conda/bin/python python; do
        if [ -z "$c" ] || ! command -v "$c" >/dev/null 2>&1; then continue; fi
        if "$c" -c "import torch; assert torch.cuda.is_available()" >/dev/null 2>&1; then
            command -v "$c"; return 0
        fi
        if [ -z "$fallback" ] && "$c" -c "import torch" >/dev/null 2>&1; then fallback=$(command -v "$c"); fi
    done
    [ -n "$fallback" ] && echo "$fallback"
}
BASEPY=$(pick_python)
CUDA=0
if [ -n "$BASEPY" ] && "$BASEPY" -c "import torch; assert torch.cuda.is_available()" >/dev/null 2>&1; then CUDA=1; fi
if [ "$CUDA" = 1 ]; then DEVICE=cuda; else DEVICE=cpu; fi

# ---------------------------------------------------------------------------------------------
# 0. env
# ---------------------------------------------------------------------------------------------
say "stage env: start"
s=$(now)
{
    echo "# dcredit_hvd GPU check, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(hostname)"
    echo "repo: $ROOT ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
    echo "uname: $(uname -a)"
    echo "cores: $(nproc); memory: $(free -g 2>/dev/null | awk '/^Mem:/ { print $2 " GiB" }')"
    echo; echo "## nvidia-smi"
    timeout 30 nvidia-smi 2>&1 || echo "(nvidia-smi failed or absent)"
    timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm \
        --format=csv 2>&1 || true
    echo; echo "## python"
    echo "python: ${BASEPY:-NONE (no python here imports torch)}"
    if [ -n "$BASEPY" ]; then
        "$BASEPY" - <<'EOF' 2>&1
import importlib, importlib.metadata as md, platform, sys
print("version:", sys.version.replace("\n", " "))
print("prefix:", sys.prefix, "(base", sys.base_prefix + ")")
import torch
print("torch:", torch.__version__, "| torch.version.cuda:", torch.version.cuda,
      "| cuda available:", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu 0:", torch.cuda.get_device_name(0), "| capability %d.%d" % torch.cuda.get_device_capability(0),
          "| %.1f GiB" % (p.total_memory / 2**30), "| devices:", torch.cuda.device_count())
    try:
        v = torch.cuda.nccl.version()
        print("torch's NCCL:", ".".join(map(str, v)) if isinstance(v, tuple) else v)
    except Exception as exc:  # noqa: BLE001
        print("torch's NCCL: unknown:", exc)
    print("cudnn:", torch.backends.cudnn.version())
for dist in sorted(md.distributions(), key=lambda d: d.metadata["Name"] or ""):
    name = (dist.metadata["Name"] or "").lower()
    if name.startswith(("nvidia-nccl", "nvidia-ml-py", "numpy", "pytest", "hypothesis", "cffi",
                        "psutil", "pyyaml", "cloudpickle", "setuptools", "horovod", "mpi4py",
                        "cmake")) and name != "pytest-benchmark":
        print(f"package: {dist.metadata['Name']} {dist.version}")
EOF
    fi
    echo; echo "## tools"
    for tool in nvcc cmake gcc g++ mpicxx mpirun ninja; do
        if command -v "$tool" >/dev/null; then
            echo "$tool: $(command -v "$tool"): $("$tool" --version 2>&1 | grep -m1 -iE 'release|version|[0-9]+\.[0-9]+')"
        else
            echo "$tool: absent"
        fi
    done
    [ -x /usr/local/cuda/bin/nvcc ] && echo "/usr/local/cuda/bin/nvcc: $(/usr/local/cuda/bin/nvcc --version | grep -m1 release)"
    echo "ldconfig libnccl: $(ldconfig -p 2>/dev/null | grep -m1 libnccl || echo none)"
    echo; echo "## wheelhouse $WHEELS"
    if [ -d "$WHEELS" ]; then
        echo "$(find "$WHEELS" -maxdepth 1 -type f | wc -l) files, $(du -sh "$WHEELS" | cut -f1)"
    else
        echo "ABSENT: run 'make gpu-wheelhouse' where PyPI is reachable and carry .gpu_wheels"
    fi
} >"$OUT/env.txt" 2>&1
if [ -z "$BASEPY" ]; then
    record env FAIL $(($(now) - s)) "no python that imports torch"
elif [ "$CUDA" = 0 ] && [ "$ALLOW_CPU" != 1 ]; then
    record env FAIL $(($(now) - s)) "torch sees no GPU ($BASEPY); GPU_CHECK_ALLOW_CPU=1 for a dry run"
else
    record env PASS $(($(now) - s)) "python $BASEPY, device $DEVICE"
fi
[ -d "$WHEELS" ] || record wheelhouse FAIL 0 "$WHEELS is missing"

# ---------------------------------------------------------------------------------------------
# 1. zoo: measure on the GPU now (the builds below run at a lower priority and use no GPU),
#    then the simulator sweep on the CPU, in the background.
# ---------------------------------------------------------------------------------------------
if [ "$DEVICE" = cuda ]; then
    zoo_measure=(--device cuda)
    zoo_predict=()
else   # dry run: one small model, a short sweep
    zoo_measure=(--device cpu --models resnet50 --batch-size 2 --iters 2 --warmup 1)
    zoo_predict=(--models resnet50 --workers "8,128" --bandwidths "10Gbit,400Gbit")
fi
zoo_job() {
    local t s rc
    t=$(limit 200); s=$(now)
    say "stage zoo-measure: start (limit ${t}s) -> logs/zoo_measure.log"
    timeout -k 10 "$t" "$BASEPY" scripts/gpu_profile_zoo.py measure --out "$PROFILES" \
        "${zoo_measure[@]}" >"$LOGS/zoo_measure.log" 2>&1
    rc=$?
    echo "zoo-measure $rc $(($(now) - s))" >"$WORK/zoo.measure.rc"
    [ "$rc" = 0 ] || return "$rc"
    t=$(limit 300); s=$(now)
    # Predictions use the CPU only: half the cores, at the builds' low priority.
    timeout -k 10 "$t" nice -n 19 "$BASEPY" scripts/gpu_profile_zoo.py predict --out "$PROFILES" \
        --jobs $((($(nproc) + 1) / 2)) "${zoo_predict[@]}" \
        --md-out "$OUT/predictions.md" --json-out "$OUT/predictions.json" \
        >"$LOGS/zoo_predict.log" 2>&1
    rc=$?
    echo "zoo-predict $rc $(($(now) - s))" >"$WORK/zoo.predict.rc"
    return "$rc"
}
rm -f "$WORK/zoo.measure.rc" "$WORK/zoo.predict.rc"
zoo_pid=
NO_GPU=0                         # no GPU and no dry run asked for: nothing to time
if [ "$CUDA" = 0 ] && [ "$ALLOW_CPU" != 1 ]; then NO_GPU=1; fi
if [ "$NO_GPU" = 1 ]; then
    record zoo-measure FAIL 0 "no GPU"
elif [ -n "$BASEPY" ]; then
    zoo_job &
    zoo_pid=$!
fi

# ---------------------------------------------------------------------------------------------
# 2. install: both Horovod builds at once, at the lowest priority (nice 19): the zoo measurement
#    on the GPU keeps its core, so its launch-bound layers are timed as on an idle machine.
# ---------------------------------------------------------------------------------------------
# shellcheck disable=SC2317  # run through `bash -c "$(declare -f install_one) ..."`
install_one() {   # install_one NAME VENV GPU_OPS
    env VENV="$2" DCREDIT_BUILD_DIR="$WORK/build-$1" DCREDIT_PYTHON="$BASEPY" \
        DCREDIT_OFFLINE_WHEELS="$WHEELS" DCREDIT_HOROVOD_GPU_OPS="$3" \
        DCREDIT_BUILD_JOBS="${DCREDIT_BUILD_JOBS:-$(nproc)}" \
        nice -n 19 bash scripts/install.sh
}
if [ -n "$BASEPY" ] && [ -d "$WHEELS" ]; then
    export ROOT WORK BASEPY WHEELS
    t=$(limit 330); s=$(now)
    say "stage install: start, venv-nccl and venv-host in parallel (limit ${t}s) -> logs/install_*.log"
    timeout -k 10 "$t" bash -c "$(declare -f install_one); install_one nccl '$VNCCL' auto" \
        >"$LOGS/install_nccl.log" 2>&1 &
    pid_nccl=$!
    timeout -k 10 "$t" bash -c "$(declare -f install_one); install_one host '$VHOST' none" \
        >"$LOGS/install_host.log" 2>&1 &
    pid_host=$!
    wait "$pid_nccl"; rc_nccl=$?
    record install-nccl "$(result_of "$rc_nccl")" $(($(now) - s)) "$(grep -m1 -E 'building with|build skipped|without GPU' "$LOGS/install_nccl.log" | sed 's/^\[install\] //')"
    wait "$pid_host"; rc_host=$?
    record install-host "$(result_of "$rc_host")" $(($(now) - s)) "$(grep -m1 -E 'building with|build skipped|without GPU|without them' "$LOGS/install_host.log" | sed 's/^\[install\] //')"
    {
        echo; echo "## Horovod builds"
        for v in "$VNCCL" "$VHOST"; do
            echo "### ${v##*/}"
            if [ -x "$v/bin/python" ]; then
                timeout 60 "$v/bin/python" -c "import horovod, horovod.torch as h; print('horovod', horovod.__version__, '| nccl_built', h.nccl_built(), '| cuda_built', h.cuda_built(), '| gloo_built', h.gloo_built(), '| mpi_built', h.mpi_built())" 2>&1 | tail -3
                timeout 60 "$v/bin/horovodrun" --check-build 2>&1 | tail -n +2
            else
                echo "(not created)"
            fi
        done
    } >>"$OUT/env.txt" 2>&1
else
    record install FAIL 0 "needs a python with torch and the wheelhouse"
fi

# The GPU is free of the zoo measurement before any test uses it.
if [ -n "$zoo_pid" ]; then
    while [ ! -f "$WORK/zoo.measure.rc" ] && kill -0 "$zoo_pid" 2>/dev/null; do sleep 2; done
    if [ -f "$WORK/zoo.measure.rc" ]; then
        read -r _ rc secs <"$WORK/zoo.measure.rc"
        record zoo-measure "$(result_of "$rc")" "$secs" "$(grep -c 'match the zoo spec' "$LOGS/zoo_measure.log") model(s) measured, profiles/profile_*.json"
    else
        record zoo-measure FAIL 0 "the zoo job ended without a result"
    fi
fi

# ---------------------------------------------------------------------------------------------
# 3. parity
# ---------------------------------------------------------------------------------------------
PARITY=$OUT/parity.txt
: >"$PARITY"
TEST=tests/multirank/test_cuda.py
# The path dcredit_hvd's optimizer takes in this environment, from the same inputs it uses.
cat >"$WORK/path_probe.py" <<'EOF'
import os

import horovod.torch as hvd

hvd.init()
from dcredit_hvd.transports import horovod as comm  # noqa: E402

try:
    from dcredit_hvd.config import SchedulerConfig
    staging = SchedulerConfig.resolve().cuda_staging
except Exception as exc:  # noqa: BLE001
    staging = f"unknown ({exc})"
gpu_ops = comm.gpu_operations_built()
direct = gpu_ops if staging is None else (not staging if isinstance(staging, bool) else None)
print(f"horovod: nccl_built={hvd.nccl_built()} cuda_built={hvd.cuda_built()} "
      f"gloo_built={hvd.gloo_built()} mpi_built={hvd.mpi_built()}")
print(f"DCREDIT_CUDA_STAGING={os.environ.get('DCREDIT_CUDA_STAGING') or '(unset)'} -> "
      f"cuda_staging={staging}; comm.gpu_operations_built()={gpu_ops}")
if direct is None:
    print("path: unknown")
elif not direct:
    print("path: STAGED (dcredit_hvd copies blocks to pinned host buffers; Horovod CPU operations)")
elif hvd.nccl_built():
    print("path: DIRECT (CUDA tensors to Horovod's NCCL operations)")
else:
    print("path: DIRECT to a Horovod without GPU operations (Horovod copies CUDA tensors to the "
          "host itself, CudaOnCPU)")
EOF
parity_run() {   # parity_run STAGE VENV CAP STAGING(1|0|auto) TITLE
    local stage=$1 venv=$2 cap=$3 staging=$4 title=$5 log=$LOGS/$1.log rc
    {
        echo "=================================================================================="
        echo "$title"
        echo "horovodrun -np 2 -H localhost:2 --gloo python -m pytest -q $TEST   (venv ${venv##*/}, DCREDIT_CUDA_STAGING=$staging)"
        echo "=================================================================================="
    } >>"$PARITY"
    if ! passed "install-${venv##*venv-}"; then
        echo "not run: the ${venv##*/} install failed (logs/install_${venv##*venv-}.log)" >>"$PARITY"
        record "$stage" FAIL 0 "install-${venv##*venv-} failed"
        return 1
    fi
    if [ ! -f "$TEST" ]; then
        echo "not run: $TEST is not in this tree" >>"$PARITY"
        record "$stage" FAIL 0 "$TEST missing"
        return 1
    fi
    local envs=(PATH="$venv/bin:$PATH")
    if [ "$staging" = auto ]; then envs+=(DCREDIT_CUDA_STAGING=); else envs+=(DCREDIT_CUDA_STAGING="$staging"); fi
    env "${envs[@]}" timeout 60 python "$WORK/path_probe.py" >>"$PARITY" 2>&1
    run "$stage" "$cap" "$log" env "${envs[@]}" "${HVDRUN[@]}" python -m pytest -q -p no:cacheprovider "$TEST"
    rc=$?
    if [ "$rc" = 0 ] && [ "$DEVICE" = cuda ] && ! grep -qE '^\[0\]<stdout>:.*[0-9]+ passed' "$log"; then
        record "$stage-tests" FAIL 0 "no test passed on the GPU (all skipped?)"
        rc=1
    fi
    {
        grep -h "CUDA gradients:" "$log" | sort -u | sed 's/^/log: /'
        echo "--- output (exit $rc) ---"
        cat "$log"
        echo
    } >>"$PARITY"
    return "$rc"
}

parity_run parity-nccl "$VNCCL" 150 1 \
    "(a) CUDA parity, 2 ranks on one GPU, NCCL build, dcredit_hvd staging through host memory"

# One rank: tests/multirank's conftest skips every test below 2 ranks, and dcredit_hvd's
# optimizer passes through at size 1 (optimizer.py: _enabled needs size > 1 or HOROVOD_ELASTIC=1),
# so `python -m pytest tests/multirank/test_cuda.py` alone would exercise nothing: not run.
# Instead a 1-rank job with HOROVOD_ELASTIC=1 (scheduler on, nothing else elastic needed at size
# 1) hands CUDA blocks to Horovod's NCCL all-reduce directly and compares the training with
# plain torch.optim (an average over one rank changes nothing): the direct path, which two
# ranks on one GPU cannot take (NCCL allows one rank per device).
cat >"$WORK/direct_smoke.py" <<'EOF'
import copy

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import dcredit_hvd

hvd.init()
assert hvd.size() == 1, hvd.size()
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(device)
ref = copy.deepcopy(model)
opt = dcredit_hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=model.named_parameters(), model=model,
                                       policy="bytescheduler", partition_bytes=16384)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
x = torch.randn(32, 64, device=device)
y = torch.randint(0, 10, (32,), device=device)
for _ in range(6):
    for m, o in ((model, opt), (ref, ref_opt)):
        o.zero_grad()
        F.cross_entropy(m(x), y).backward()
        o.step()
opt.apply_pending_updates()
if device.type == "cuda":
    torch.cuda.synchronize()
diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
transfer = getattr(opt, "_cuda", None)
print(f"device {device}; nccl_built={hvd.nccl_built()}; blocks handed over "
      f"{'directly as CUDA tensors' if transfer is not None and transfer.direct else 'through host staging' if transfer is not None else '(CPU tensors)'}; "
      f"max |dcredit - torch.optim| after 6 steps = {diff:.3g}")
assert diff <= 1e-5, diff
print("direct-path smoke: OK")
EOF
{
    echo "=================================================================================="
    echo "(a') one rank: python -m pytest $TEST without horovodrun is NOT run: conftest skips every"
    echo "test below 2 ranks and the optimizer is a pass-through at size 1 (no scheduling, no"
    echo "all-reduce). Run instead: HOROVOD_ELASTIC=1 DCREDIT_CUDA_STAGING=0 python direct_smoke.py"
    echo "(NCCL build, 1 rank: CUDA blocks to Horovod's NCCL all-reduce, compared with torch.optim)"
    echo "=================================================================================="
} >>"$PARITY"
if passed install-nccl; then
    run direct-nccl 60 "$LOGS/direct_smoke.log" env PATH="$VNCCL/bin:$PATH" HOROVOD_ELASTIC=1 \
        DCREDIT_CUDA_STAGING=0 python "$WORK/direct_smoke.py"
    cat "$LOGS/direct_smoke.log" >>"$PARITY"
else
    record direct-nccl FAIL 0 "install-nccl failed"
fi
echo >>"$PARITY"
# The torch.distributed transport's NCCL path, one rank (NCCL allows one rank per GPU).
echo "(a'') torch.distributed transport over NCCL, 1 rank: scripts/nccl_transport_check.py" >>"$PARITY"
if passed install-nccl; then
    run nccl-transport 60 "$LOGS/nccl_transport.log" env PATH="$VNCCL/bin:$PATH" \
        GPU_CHECK_ALLOW_CPU="$ALLOW_CPU" python "$ROOT/scripts/nccl_transport_check.py"
    cat "$LOGS/nccl_transport.log" >>"$PARITY"
else
    record nccl-transport FAIL 0 "install-nccl failed"
fi
echo >>"$PARITY"

# ---------------------------------------------------------------------------------------------
# 4. bench: dcredit_hvd against plain Horovod, 2 ranks on the GPU (the host build: with NCCL
#    plain Horovod cannot put two ranks on one GPU).
# ---------------------------------------------------------------------------------------------
BENCH_ARGS=(--model resnet50 --batch-size 64 --policy "horovod,wfbp,bytescheduler,dcredit"
            --num-warmup-batches 2 --num-batches-per-iter 3 --num-iters 3 --json "$OUT/bench.json")
[ "$DEVICE" = cuda ] || BENCH_ARGS=(--model resnet50 --model-arg width=8 --model-arg image_size=64
    --batch-size 2 --policy "horovod,dcredit" --num-warmup-batches 1 --num-batches-per-iter 1
    --num-iters 2 --json "$OUT/bench.json")
bench_cmd=(env PATH="$VHOST/bin:$PATH" DCREDIT_CUDA_STAGING=1 "${HVDRUN[@]}" python -m dcredit_hvd.bench
           --device "$DEVICE" "${BENCH_ARGS[@]}")
{
    echo "# ${bench_cmd[*]}"
    echo "# venv-host: Horovod without GPU operations (plain Horovod copies CUDA tensors to the host"
    echo "# itself); dcredit_hvd stages through pinned host memory (DCREDIT_CUDA_STAGING=1)."
} >"$OUT/bench.txt"
if [ "$NO_GPU" = 1 ]; then
    echo "not run: no GPU" >>"$OUT/bench.txt"
    record bench FAIL 0 "no GPU"
elif ! passed install-host; then
    echo "not run: the venv-host install failed" >>"$OUT/bench.txt"
    record bench FAIL 0 "install-host failed"
elif ! "$VHOST/bin/python" -m dcredit_hvd.bench --help 2>/dev/null | grep -q -- "--device"; then
    echo "not run: this tree's dcredit_hvd.bench.sidebyside has no --device option yet" >>"$OUT/bench.txt"
    record bench SKIP 0 "dcredit_hvd.bench.sidebyside has no --device yet"
else
    if [ -n "$zoo_pid" ] && kill -0 "$zoo_pid" 2>/dev/null; then
        echo "# note: the simulator sweep (CPU, nice 19) was still running during this benchmark" >>"$OUT/bench.txt"
    fi
    run bench 150 "$LOGS/bench.log" "${bench_cmd[@]}"
    cat "$LOGS/bench.log" >>"$OUT/bench.txt"
fi

# (a'') last: the host build on 2 ranks, the default path (what a user without NCCL gets).
parity_run parity-host "$VHOST" 120 auto \
    "(a'') CUDA parity, 2 ranks on one GPU, build without GPU operations, default path"

# ---------------------------------------------------------------------------------------------
# 5. the zoo predictions
# ---------------------------------------------------------------------------------------------
if [ -n "$zoo_pid" ]; then
    wait "$zoo_pid"
    if [ -f "$WORK/zoo.predict.rc" ]; then
        read -r _ rc secs <"$WORK/zoo.predict.rc"
        record zoo-predict "$(result_of "$rc")" "$secs" "$(grep -h 'simulated' "$LOGS/zoo_predict.log" | paste -sd';' -)"
    elif passed zoo-measure; then
        record zoo-predict FAIL 0 "did not run"
    fi
    prof=$(find "$PROFILES" -name 'profile_*.json' | sort | head -1)
    if [ -n "$prof" ]; then
        # The profile format is the one `python -m dcredit_hvd simulate --profile` reads.
        run simulate-cli 60 "$LOGS/simulate_profile.log" "$BASEPY" -m dcredit_hvd simulate --profile "$prof"
    fi
fi

# ---------------------------------------------------------------------------------------------
# 6. summary
# ---------------------------------------------------------------------------------------------
SUMMARY=$OUT/summary.txt
{
    echo "dcredit_hvd GPU check: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(elapsed) s of a ${BUDGET} s budget"
    echo "machine: $(grep -m1 '^gpu 0:' "$OUT/env.txt" || echo 'no GPU'); $(grep -m1 '^torch:' "$OUT/env.txt")"
    echo "result: $([ "$FAILED" = 0 ] && echo 'every stage passed' || echo 'SOME STAGES FAILED')"
    echo
    echo "stage          result   time   note"
    cat "$STATUS_FILE"
    echo
    echo "== Horovod builds"
    grep -E '^horovod [0-9]' "$OUT/env.txt" || echo "(none)"
    echo
    echo "== parity (parity.txt)"
    # horovodrun prefixes each line with [rank]<stdout>:
    sed 's/^\[[0-9]*\]<std[a-z]*>://' "$PARITY" | grep -E \
        '^(\(a|path:|log:|DCREDIT_CUDA_STAGING|device |direct-path|not run)|^=* ?[0-9]+ (passed|failed|skipped|error)' \
        | uniq || true
    echo
    echo "== bench (bench.txt)"
    if grep -q '^\[0\]<stdout>:policy' "$OUT/bench.txt"; then
        sed -n 's/^\[0\]<stdout>://p' "$OUT/bench.txt" | sed -n '/^compute only/,$p' | grep -v '^results written'
    else
        tail -n 3 "$OUT/bench.txt"
    fi
    echo
    echo "== zoo profiles and predictions (predictions.md)"
    grep -h '^\[' "$LOGS/zoo_measure.log" 2>/dev/null | grep -E 'batch|match'
    if [ -f "$OUT/predictions.json" ] && [ -n "$BASEPY" ]; then
        "$BASEPY" - "$OUT/predictions.json" <<'EOF' 2>&1
import json, sys
d = json.load(open(sys.argv[1]))
rows = d["rows"]
for mode in d["modes"]:
    for model in d["models"]:
        cells = {(r["workers"], r["gbit_s"], r["policy"]): r["iteration_s"] for r in rows
                 if r["model"] == model and r["mode"] == mode}
        parts = []
        for w in d["workers"]:
            for bw in d["bandwidths_gbit_s"]:
                h, c = cells.get((w, bw, "horovod")), cells.get((w, bw, "dcredit"))
                if h and c:
                    parts.append(f"{w}x{bw:g}G {h / c:.2f}x")
        print(f"{mode:8s} {model:11s} dcredit vs horovod: {', '.join(parts)}")
EOF
    fi
    echo
    echo "== files"
    echo "env.txt parity.txt bench.txt bench.json predictions.md predictions.json summary.txt;"
    echo "details.tar.gz: logs/ (every stage's output, the installs') and profiles/ (profile_<model>.json,"
    echo "for python -m dcredit_hvd simulate --profile)"
} >"$SUMMARY" 2>&1
rm -f "$STATUS_FILE"
if [ "$PACK" = 1 ]; then
    tar -czf "$OUT/details.tar.gz" -C "$OUT" logs profiles && rm -rf "$LOGS" "$PROFILES"
fi
say "done: $(head -3 "$SUMMARY" | tail -1) (${SUMMARY})"
cat "$SUMMARY"
exit "$FAILED"
