#!/usr/bin/env bash
# The main job (`make demo`): a real 2-rank training of a VGG-16-shaped CNN (9.4 M parameters)
# over an emulated 1 Gbit/s link, every policy one after another in the same launch, ending with
# a table of time per iteration, speedup over plain Horovod and ratio to the lower bound.
# Override with DEMO_RATE (e.g. 200mbit, none), DEMO_POLICIES, DEMO_ITERS.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-$PWD/.venv}
export PATH=$VENV/bin:$PATH OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
RATE=${DEMO_RATE:-1gbit}
POLICIES=${DEMO_POLICIES:-horovod,ddp,wfbp,bytescheduler,dcredit-sync,dcredit}
mkdir -p results
exec ./scripts/netshape.sh "$RATE" -- \
    timeout -k 10 1200 mpirun -np 2 --oversubscribe --bind-to none --map-by slot \
        --mca btl tcp,self --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo \
        -x PATH -x DCREDIT_LOG_LEVEL \
    "$VENV/bin/python" -m dcredit_hvd.bench --model vgg16 \
        --model-arg width=16 --model-arg image_size=32 --model-arg hidden=1024 \
        --batch-size 16 --num-warmup-batches 2 --num-batches-per-iter 3 \
        --num-iters "${DEMO_ITERS:-5}" --policy "$POLICIES" --json "results/demo-$RATE.json"
