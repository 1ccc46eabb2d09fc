#!/usr/bin/env bash
# The main job (`make demo`): real 2-host trainings on a virtual cluster (scripts/vcluster.sh:
# 2 hosts, each NIC 1 Gbit/s full duplex), every policy one after another in the same launch
# (dcredit on Horovod and, as dcredit-td, on torch.distributed beside DDP; dear, the paper's
# DeAR baseline; and dcredit-shard: shard=True, with the optimizer state per rank printed under
# the table; add dcredit-sync or dcredit-shard-sync with DEMO_POLICIES for runs without model=),
# each ending with a table of time per iteration, speed-up over plain Horovod and DDP, ratio to
# the lower bound and the simulator's error. Two models: a VGG-16-shaped CNN (9.4 M parameters,
# a few large tensors) and a 4-layer GPT-style transformer (4.2 M parameters in 52 tensors, most
# of them small, and a tied embedding that forward reads first and backward produces last).
# All-reduce: Open MPI's recursive doubling for every policy and the lower bound (on 2 hosts it
# is the fastest measured, 1.08x what the link needs; docs/benchmarks.md). Subnormals are
# flushed (dcredit_hvd.bench.sidebyside). Needs root (network namespaces); without it vcluster.sh says so
# and exits 3. Override with DEMO_RATE (e.g. 200mbit, 10gbit), DEMO_POLICIES, DEMO_ITERS,
# DEMO_MODELS (vgg16,gpt). Then one emulated GPU cluster (dcredit_hvd.bench.emulate; DEMO_EMULATED=0
# skips it): 8 hosts with 10 Gbit/s NICs, VGG-16's shipped profile (communication about equal to
# compute there), compute replayed, all-reduces real, figures in the cluster's time.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-$PWD/.venv}
export PATH=$VENV/bin:$PATH OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export DCREDIT_LOG_LEVEL=${DCREDIT_LOG_LEVEL:-INFO}
RATE=${DEMO_RATE:-1gbit}
POLICIES=${DEMO_POLICIES:-horovod,ddp,wfbp,bytescheduler,dear,dcredit,dcredit-td,dcredit-shard}
mkdir -p results

launch() {  # launch NAME BENCH-ARGS...
    local name=$1; shift
    ./scripts/vcluster.sh 2 "$RATE" -- \
        timeout -k 10 1200 mpirun -np 2 -H h0,h1 --bind-to none \
            --mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm 3 \
            -x PATH -x DCREDIT_LOG_LEVEL -x GLOO_SOCKET_IFNAME \
        "$VENV/bin/python" -m dcredit_hvd.bench "$@" \
            --num-warmup-batches 2 --num-batches-per-iter 3 \
            --num-iters "${DEMO_ITERS:-8}" --policy "$POLICIES" \
            --json "results/demo-$name-2h-$RATE.json"
}

for model in $(echo "${DEMO_MODELS:-vgg16,gpt}" | tr ',' ' '); do
    case $model in
        vgg16) launch vgg16 --model vgg16 --model-arg width=16 --model-arg image_size=32 \
                   --model-arg hidden=1024 --batch-size 16 ;;
        gpt) launch gpt --model gpt2_small --model-arg vocab=4096 --model-arg ctx=128 \
                 --model-arg seq_len=128 --model-arg d=256 --model-arg layers=4 \
                 --model-arg heads=8 --batch-size 4 ;;
        *) echo "demo.sh: DEMO_MODELS: unknown model $model (vgg16, gpt)" >&2; exit 2 ;;
    esac
done
if [ "${DEMO_EMULATED:-1}" != 0 ]; then
    "$VENV/bin/python" scripts/bench_emulated.py --models vgg16 --hosts 8 --targets 10gbit \
        --k "${DEMO_EMULATED_K:-4}" --warmup 1 --iters "${DEMO_EMULATED_ITERS:-3}" \
        --out results/demo-emulated
fi
