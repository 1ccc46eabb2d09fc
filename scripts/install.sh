#!/usr/bin/env bash
# Idempotent set-up for dcredit_hvd on Debian, as root or with sudo.
#
#   Open MPI (Debian)  ->  .venv with torch==2.13.0, numpy, mpi4py, pytest, hypothesis, ruff
#   -> Horovod 0.28.1 built from the PyPI sdist with C++17 (needed for torch >= 2.1)
#   -> this package, editable.
#
# Each step is skipped when its result is already there, so a second run takes seconds.
# VENV (default: .venv beside this script's repository) picks the environment.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
PY=$VENV/bin/python
HOROVOD_VERSION=0.28.1
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
BUILD_DIR=${DCREDIT_BUILD_DIR:-$ROOT/.build}

log() { printf '[install] %s\n' "$*"; }

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
        echo "[install] need root (or sudo) to run: $*" >&2; exit 1; fi
}

# 1. Open MPI and the tools the shaped-network launcher uses (ip, tc).
need_apt=()
command -v mpicxx >/dev/null || need_apt+=(openmpi-bin libopenmpi-dev)
command -v ip >/dev/null || need_apt+=(iproute2)
command -v tc >/dev/null || need_apt+=(iproute2)
if [ ${#need_apt[@]} -gt 0 ]; then
    log "apt-get install ${need_apt[*]}"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# 2. The virtual environment and the Python dependencies.
if [ ! -x "$PY" ]; then
    log "creating $VENV"
    python3 -m venv "$VENV"
fi
if ! "$PY" -c "import torch, numpy, mpi4py, pytest, hypothesis; assert torch.__version__.split('+')[0] == '$TORCH_VERSION'" 2>/dev/null; then
    log "pip install torch==$TORCH_VERSION numpy mpi4py pytest hypothesis ruff"
    "$PY" -m pip install -q --upgrade pip setuptools wheel
    "$PY" -m pip install -q "torch==$TORCH_VERSION" numpy mpi4py pytest hypothesis ruff matplotlib
fi

# 3. Horovod, built against the installed torch. Skipped when horovod.torch already imports
#    (it must be rebuilt whenever torch changes: the C++ ABI is torch's).
if "$PY" -c "import horovod.torch as h; assert h.mpi_built() and h.gloo_built()" 2>/dev/null; then
    log "horovod.torch imports against torch $TORCH_VERSION: build skipped"
else
    log "building horovod $HOROVOD_VERSION from the PyPI sdist with C++17 (about 5 minutes)"
    rm -rf "$BUILD_DIR"; mkdir -p "$BUILD_DIR"
    "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$BUILD_DIR"
    tar -xzf "$BUILD_DIR/horovod-$HOROVOD_VERSION.tar.gz" -C "$BUILD_DIR"
    SRC=$BUILD_DIR/horovod-$HOROVOD_VERSION
    # torch >= 2.1 headers need C++17; 0.28.1 pins 14 in these two files (upstream PR #3998).
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
        "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
    gpu_env=()
    if command -v nvcc >/dev/null && "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
        log "CUDA present: building with NCCL"
        gpu_env=(HOROVOD_GPU_OPERATIONS=NCCL)
    fi
    "$PY" -m pip install -q cloudpickle psutil pyyaml packaging cffi
    env HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
        HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
        MAKEFLAGS="-j$(nproc)" "${gpu_env[@]}" \
        "$PY" -m pip install -q --no-build-isolation --no-cache-dir "$SRC"
    "$PY" -c "import horovod.torch as h; assert h.mpi_built() and h.gloo_built()"
    rm -rf "$BUILD_DIR"
fi

# 4. This package, editable.
if ! "$PY" -m pip show -q dcredit_hvd >/dev/null 2>&1; then
    log "pip install -e $ROOT"
    "$PY" -m pip install -q --no-build-isolation --no-deps -e "$ROOT"
fi
log "ready: $VENV"
