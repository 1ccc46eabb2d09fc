#!/usr/bin/env bash
# Idempotent set-up for dcredit_hvd on Debian, as root or with sudo.
#
#   Open MPI (Debian)  ->  .venv with torch==2.13.0, numpy, mpi4py, pytest, hypothesis, ruff,
#   pytest-xdist, transformers, peft, lightning and pytorch-lightning (both Lightning packages)
#   and accelerate (the frameworks' tests)
#   -> Horovod 0.28.1 built from the PyPI sdist with C++17 (needed for torch >= 2.1)
#   -> this package, editable.
#
# Each step is skipped when its result is already there, so a second run takes seconds.
# VENV (default: .venv beside this script's repository) picks the environment.
#
# GPU machines and machines without network (docs/gpu.md); none of these is needed on CPU:
#   DCREDIT_HOROVOD_GPU_OPS=auto|none|nccl  Horovod's GPU operations.  auto (default): NCCL when
#       CUDA (nvcc and torch.cuda.is_available()) and NCCL (headers and library, from the system
#       or the nvidia-nccl-cu* package CUDA torch wheels install) are both there; with CUDA but
#       no NCCL, none (dcredit_hvd then stages CUDA gradients through host memory).
#   DCREDIT_OFFLINE_WHEELS=DIR  install from DIR only (pip --no-index --find-links DIR; the
#       Horovod sdist is taken from DIR; scripts/gpu_wheelhouse.sh fills it); nothing from apt;
#       torch is NOT installed: the machine's own is used.
#   DCREDIT_PYTHON=PYTHON  create VENV from this interpreter, seeing its packages (torch
#       included, even when PYTHON is itself a virtual environment); the machine's torch is used.
#   VENV=system  no virtual environment: install into DCREDIT_PYTHON (default python3) itself.
#   DCREDIT_HOROVOD_MPI=auto|none  build Horovod with MPI when mpicxx is there (auto) or not.
#   DCREDIT_BUILD_JOBS=N  parallel compile jobs for Horovod (default: nproc).
#   DCREDIT_HOROVOD_CXX_STD=17|20  C++ standard for Horovod (default: 20 for torch >= 2.14, else 17).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
HOROVOD_VERSION=0.28.1
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
# The real-architecture parity tests build tiny models from transformers (pure Python, no download).
TRANSFORMERS_VERSION=${TRANSFORMERS_VERSION:-5.24.0}
# peft wraps a real model in LoRA adapters for the training-pattern parity tests.
PEFT_VERSION=${PEFT_VERSION:-0.21.2}
# The frameworks' tests run the real PyTorch Lightning and Hugging Face Trainer (on Accelerate).
LIGHTNING_VERSION=${LIGHTNING_VERSION:-2.6.6}
ACCELERATE_VERSION=${ACCELERATE_VERSION:-1.15.0}
BUILD_DIR=${DCREDIT_BUILD_DIR:-$ROOT/.build}
GPU_OPS=${DCREDIT_HOROVOD_GPU_OPS:-auto}
MPI_MODE=${DCREDIT_HOROVOD_MPI:-auto}
WHEELS=${DCREDIT_OFFLINE_WHEELS:-}
BASE_PY=${DCREDIT_PYTHON:-}
JOBS=${DCREDIT_BUILD_JOBS:-$(nproc)}

log() { printf '[install] %s\n' "$*"; }
die() { printf '[install] error: %s\n' "$*" >&2; exit 1; }

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
        echo "[install] need root (or sudo) to run: $*" >&2; exit 1; fi
}

case "$GPU_OPS" in auto|none|nccl) ;; *) die "DCREDIT_HOROVOD_GPU_OPS=$GPU_OPS: expected auto, none or nccl";; esac
case "$MPI_MODE" in auto|none) ;; *) die "DCREDIT_HOROVOD_MPI=$MPI_MODE: expected auto or none";; esac
pip_src=()
if [ -n "$WHEELS" ]; then
    [ -d "$WHEELS" ] || die "DCREDIT_OFFLINE_WHEELS=$WHEELS is not a directory"
    WHEELS=$(cd "$WHEELS" && pwd)
    pip_src=(--no-index --find-links "$WHEELS")
fi
if [ "$VENV" = system ]; then
    PY=$(command -v "${BASE_PY:-python3}") || die "no interpreter ${BASE_PY:-python3}"
else
    PY=$VENV/bin/python
fi
# Offline, with DCREDIT_PYTHON or VENV=system, torch is the machine's: never pinned nor installed.
machine_torch=0
if [ -n "$WHEELS" ] || [ -n "$BASE_PY" ] || [ "$VENV" = system ]; then machine_torch=1; fi

# 1. Open MPI and the tools the shaped-network launcher uses (ip, tc).
if [ -z "$WHEELS" ]; then
    need_apt=()
    command -v mpicxx >/dev/null || need_apt+=(openmpi-bin libopenmpi-dev)
    command -v ip >/dev/null || need_apt+=(iproute2)
    command -v tc >/dev/null || need_apt+=(iproute2)
    if [ ${#need_apt[@]} -gt 0 ]; then
        log "apt-get install ${need_apt[*]}"
        as_root apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
    fi
elif ! command -v mpicxx >/dev/null; then
    log "offline: no MPI here (mpicxx), nothing installed from Debian: Horovod gets Gloo only"
fi

# 2. The virtual environment and the Python dependencies.
if [ "$VENV" != system ] && [ ! -x "$PY" ]; then
    log "creating $VENV"
    if [ -n "$BASE_PY" ]; then
        command -v "$BASE_PY" >/dev/null || die "DCREDIT_PYTHON=$BASE_PY not found"
        "$BASE_PY" -m venv --system-site-packages "$VENV" 2>/dev/null || {
            log "no ensurepip for $BASE_PY: venv without pip (the machine's pip is used)"
            rm -rf "$VENV"
            "$BASE_PY" -m venv --system-site-packages --without-pip "$VENV"
        }
        # --system-site-packages shows the BASE installation's packages; when DCREDIT_PYTHON is
        # itself a virtual environment (its torch there), those are not the ones wanted.  Add
        # DCREDIT_PYTHON's site directories (and their .pth files) after the venv's own.
        site_dirs=$("$BASE_PY" -c 'import site; print(repr(site.getsitepackages()))')
        venv_site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        printf 'import site; list(map(site.addsitedir, %s))\n' "$site_dirs" \
            >"$venv_site/_dcredit_machine_site.pth"
    else
        python3 -m venv "$VENV"
    fi
fi
if [ "$machine_torch" = 0 ]; then
    if ! "$PY" -c "import torch, numpy, mpi4py, pytest, xdist, hypothesis, transformers, peft, pytorch_lightning, lightning, accelerate; assert torch.__version__.split('+')[0] == '$TORCH_VERSION'; assert transformers.__version__ == '$TRANSFORMERS_VERSION'; assert peft.__version__ == '$PEFT_VERSION'; assert pytorch_lightning.__version__ == '$LIGHTNING_VERSION'; assert lightning.__version__ == '$LIGHTNING_VERSION'; assert accelerate.__version__ == '$ACCELERATE_VERSION'" 2>/dev/null; then
        log "pip install torch==$TORCH_VERSION numpy mpi4py pytest pytest-xdist hypothesis ruff transformers==$TRANSFORMERS_VERSION peft==$PEFT_VERSION lightning==$LIGHTNING_VERSION pytorch-lightning==$LIGHTNING_VERSION accelerate==$ACCELERATE_VERSION"
        "$PY" -m pip install -q --upgrade pip setuptools wheel
        "$PY" -m pip install -q "torch==$TORCH_VERSION" numpy mpi4py pytest pytest-xdist hypothesis ruff \
            matplotlib "transformers==$TRANSFORMERS_VERSION" "peft==$PEFT_VERSION" \
            "lightning==$LIGHTNING_VERSION" "pytorch-lightning==$LIGHTNING_VERSION" \
            "accelerate==$ACCELERATE_VERSION"
    fi
else
    "$PY" -c "import torch" 2>/dev/null \
        || die "$PY cannot import torch; point DCREDIT_PYTHON at the machine's python that has it"
    log "torch $("$PY" -c 'import torch; print(torch.__version__)') from the machine (not pinned)"
    # Horovod's setup.py needs bdist_wheel (wheel, or setuptools >= 70.1); -e needs >= 64.
    "$PY" -c "import setuptools, wheel, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 64)" \
        2>/dev/null || "$PY" -m pip install -q "${pip_src[@]}" --upgrade setuptools wheel
    wanted=(pytest pytest-xdist hypothesis "transformers==$TRANSFORMERS_VERSION" "accelerate==$ACCELERATE_VERSION")
    [ -n "$WHEELS" ] || wanted+=(numpy ruff "peft==$PEFT_VERSION" "lightning==$LIGHTNING_VERSION"
                                "pytorch-lightning==$LIGHTNING_VERSION")
    if [ -z "$WHEELS" ] && command -v mpicxx >/dev/null && [ "$MPI_MODE" = auto ]; then
        wanted+=(mpi4py)
    fi
    modules=$(printf '%s\n' "${wanted[@]}" | sed 's/==.*//; s/-/_/g; s/^pytest_xdist$/xdist/' | paste -sd, -)
    if ! "$PY" -c "import $modules" 2>/dev/null; then
        log "pip install ${wanted[*]}${WHEELS:+ (from $WHEELS)}"
        "$PY" -m pip install -q "${pip_src[@]}" "${wanted[@]}"
    fi
    "$PY" -c "import numpy" 2>/dev/null || log "warning: numpy is missing (the benchmark needs it)"
    # NVML, for the benchmark's GPU energy: optional.
    "$PY" -c "import pynvml" 2>/dev/null || "$PY" -m pip install -q "${pip_src[@]}" nvidia-ml-py \
        2>/dev/null || log "nvidia-ml-py not installed: no GPU energy figures"
fi

# 3. Horovod, built against the installed torch. Skipped when horovod.torch already imports
#    (it must be rebuilt whenever torch changes: the C++ ABI is torch's) with the operations
#    this machine should have.
has_mpi=0
if [ "$MPI_MODE" = auto ] && command -v mpicxx >/dev/null; then has_mpi=1; fi
cuda=0
nvcc_bin=$(command -v nvcc || true)
if [ -z "$nvcc_bin" ] && [ -x /usr/local/cuda/bin/nvcc ]; then nvcc_bin=/usr/local/cuda/bin/nvcc; fi
if [ -n "$nvcc_bin" ] && "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    cuda=1
fi

# NCCL: HOROVOD_NCCL_HOME/NCCL_HOME if given; else the nvidia-nccl-cu* package (what a CUDA
# torch wheel loads, so Horovod is compiled against the NCCL the process runs with); else the
# system's (nccl.h under /usr/include, /usr/local/cuda/include or $CUDA_HOME/include, libnccl
# from ldconfig).  Sets nccl_inc, nccl_lib and nccl_from.
nccl_inc='' nccl_lib='' nccl_from=''
nccl_candidates() {
    local home
    for home in "${HOROVOD_NCCL_HOME:-}" "${NCCL_HOME:-}"; do
        [ -n "$home" ] && echo "$home/include $home/lib env:$home"
    done
    "$PY" - <<'EOF' 2>/dev/null || true
import glob, importlib.util, os
try:
    spec = importlib.util.find_spec("nvidia")
except Exception:
    spec = None
for base in (list(spec.submodule_search_locations) if spec else []):
    for header in sorted(glob.glob(os.path.join(base, "*", "include", "nccl.h"))
                         + glob.glob(os.path.join(base, "*", "*", "include", "nccl.h"))):
        home = os.path.dirname(os.path.dirname(header))
        print(f"{home}/include {home}/lib pip:{home}")
EOF
    local inc lib
    lib=$(ldconfig -p 2>/dev/null | awk '/libnccl\.so/ { print $NF; exit }')
    for inc in /usr/include /usr/local/cuda/include "${CUDA_HOME:-/nonexistent}/include"; do
        if [ -f "$inc/nccl.h" ] && [ -n "$lib" ]; then echo "$inc $(dirname "$lib") system"; fi
    done
}
find_nccl() {
    local inc lib from
    while read -r inc lib from; do
        if [ -f "$inc/nccl.h" ] && compgen -G "$lib/libnccl.so*" >/dev/null; then
            nccl_inc=$inc nccl_lib=$lib nccl_from=$from
            return 0
        fi
    done < <(nccl_candidates)
    return 1
}

gpu_env=()
want_nccl=0
if [ "$cuda" = 1 ]; then
    # The toolkit's root (nvcc on PATH may be a wrapper script in /usr/local/bin).
    if [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then cuda_home=$CUDA_HOME
    elif [ -x /usr/local/cuda/bin/nvcc ]; then cuda_home=/usr/local/cuda
    else cuda_home=$(dirname "$(dirname "$(readlink -f "$nvcc_bin")")"); fi
    cc_list=${HOROVOD_BUILD_CUDA_CC_LIST:-$("$PY" -c "import torch; print(','.join(sorted({'%d%d' % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})))")}
    # Horovod compiles its CUDA kernels whenever torch has CUDA; only for this GPU's
    # architecture (the default is every one nvcc knows, minutes more).
    gpu_env=(CUDA_HOME="$cuda_home" HOROVOD_CUDA_HOME="$cuda_home" HOROVOD_BUILD_CUDA_CC_LIST="$cc_list")
    if [ "$GPU_OPS" != none ] && find_nccl; then
        want_nccl=1
    elif [ "$GPU_OPS" = nccl ]; then
        die "DCREDIT_HOROVOD_GPU_OPS=nccl but no NCCL found (set HOROVOD_NCCL_HOME)"
    fi
elif [ "$GPU_OPS" = nccl ]; then
    die "DCREDIT_HOROVOD_GPU_OPS=nccl needs CUDA: nvcc and a torch that sees a GPU"
fi
check="h.gloo_built()"
[ "$has_mpi" = 0 ] || check="h.mpi_built() and $check"
if [ "$want_nccl" = 1 ]; then
    check="$check and h.nccl_built()"
elif [ "$cuda" = 1 ]; then
    check="$check and not h.nccl_built()"
fi

if "$PY" -c "import horovod.torch as h; assert $check" 2>/dev/null; then
    if [ "$machine_torch" = 0 ]; then
        log "horovod.torch imports against torch $TORCH_VERSION: build skipped"
    else
        log "horovod.torch imports against the machine's torch ($check): build skipped"
    fi
else
    if [ "$want_nccl" = 1 ]; then
        # CMake links -lnccl (HOROVOD_NCCL_LINK=SHARED): the pip package ships libnccl.so.2 only.
        if [ ! -e "$nccl_lib/libnccl.so" ]; then
            so2=
            for f in "$nccl_lib"/libnccl.so.*; do so2=${f##*/}; break; done
            if ! ln -s "$so2" "$nccl_lib/libnccl.so" 2>/dev/null; then
                link_dir=$VENV/nccl-lib
                [ "$VENV" != system ] || link_dir=$BUILD_DIR.nccl-lib
                mkdir -p "$link_dir"
                ln -sf "$nccl_lib/$so2" "$link_dir/$so2"
                ln -sf "$nccl_lib/$so2" "$link_dir/libnccl.so"
                nccl_lib=$link_dir
            fi
        fi
        nccl_home=$(dirname "$nccl_inc")
        log "CUDA and NCCL present (${nccl_from%%:*}: $nccl_inc): building with HOROVOD_GPU_OPERATIONS=NCCL for sm_$cc_list"
        gpu_env+=(HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_HOME="$nccl_home"
                  HOROVOD_NCCL_INCLUDE="$nccl_inc" HOROVOD_NCCL_LIB="$nccl_lib" HOROVOD_NCCL_LINK=SHARED)
    elif [ "$cuda" = 1 ]; then
        if [ "$GPU_OPS" = none ]; then
            log "CUDA present, GPU operations not wanted (DCREDIT_HOROVOD_GPU_OPS=none): building without them"
        else
            log "CUDA present but no NCCL: building without GPU operations; CUDA gradients go through host staging"
        fi
    fi
    # torch >= 2.14 headers need C++20 (operator<=> in c10/util/intrusive_ptr.h), older ones 17.
    cxx_std=${DCREDIT_HOROVOD_CXX_STD:-$("$PY" -c "import torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); print(20 if v >= (2, 14) else 17)" 2>/dev/null || echo 17)}
    # The built wheel is kept per machine (DCREDIT_WHEEL_CACHE, default ~/.cache/dcredit_hvd),
    # keyed by everything the binary depends on: a second clone on this machine installs it in
    # seconds; a new machine, or another torch, Python or build option, builds again.
    py_tag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
    torch_tag=$("$PY" -c 'import torch; print(torch.__version__.replace("+", "_"))')
    key="horovod-$HOROVOD_VERSION-$py_tag-torch$torch_tag-cxx$cxx_std-mpi$has_mpi-nccl$want_nccl-cuda$cuda"
    wheel_dir=${DCREDIT_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dcredit_hvd}/$key
    "$PY" -m pip install -q "${pip_src[@]}" cloudpickle psutil pyyaml packaging cffi
    if ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
        log "horovod $HOROVOD_VERSION: the wheel built earlier on this machine ($wheel_dir)"
    else
        rm -rf "$wheel_dir.tmp"; mkdir -p "$(dirname "$wheel_dir")"
        log "building horovod $HOROVOD_VERSION from the PyPI sdist with C++$cxx_std (about 5 minutes)"
        rm -rf "$BUILD_DIR"; mkdir -p "$BUILD_DIR"
        if [ -n "$WHEELS" ]; then
            [ -f "$WHEELS/horovod-$HOROVOD_VERSION.tar.gz" ] \
                || die "no horovod-$HOROVOD_VERSION.tar.gz in $WHEELS (scripts/gpu_wheelhouse.sh)"
            cp "$WHEELS/horovod-$HOROVOD_VERSION.tar.gz" "$BUILD_DIR/"
        else
            "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$BUILD_DIR"
        fi
        tar -xzf "$BUILD_DIR/horovod-$HOROVOD_VERSION.tar.gz" -C "$BUILD_DIR"
        SRC=$BUILD_DIR/horovod-$HOROVOD_VERSION
        # torch >= 2.1 headers need C++17; 0.28.1 pins 14 in these two files (upstream PR #3998).
        sed -i "s/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD $cxx_std)/" \
            "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
        grep -q "CMAKE_CXX_STANDARD $cxx_std" "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
        if ! "$PY" -c "import distutils.sysconfig" 2>/dev/null; then
            # Python >= 3.12 without setuptools' distutils: CMake asks distutils for Python.h's
            # folder, and horovodrun imports distutils.spawn.
            sed -i 's/from distutils.sysconfig import get_python_inc; print(get_python_inc())/import sysconfig; print(sysconfig.get_paths()[\\"include\\"])/' \
                "$SRC/horovod/torch/CMakeLists.txt"
            sed -i 's/^from distutils.spawn import find_executable$/from shutil import which as find_executable/' \
                "$SRC/horovod/runner/js_run.py"
        fi
        mpi_env=(HOROVOD_WITH_MPI=1)
        if [ "$has_mpi" = 0 ]; then mpi_env=(HOROVOD_WITHOUT_MPI=1); log "building without MPI (Gloo only)"; fi
        env HOROVOD_WITH_PYTORCH=1 "${mpi_env[@]}" HOROVOD_WITH_GLOO=1 \
            HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
            MAKEFLAGS="-j$JOBS" "${gpu_env[@]}" \
            "$PY" -m pip wheel -q "${pip_src[@]}" --no-deps --no-build-isolation --no-cache-dir \
            -w "$wheel_dir.tmp" "$SRC"
        mv "$wheel_dir.tmp" "$wheel_dir"
    fi
    "$PY" -m pip install -q --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
    if ! "$PY" -c "import horovod.torch as h; assert $check" 2>/dev/null; then
        rm -rf "$wheel_dir"
        die "the horovod wheel in $wheel_dir does not import ($check); removed it: run again to rebuild"
    fi
    rm -rf "$BUILD_DIR"
fi

# 4. This package, editable.
if ! "$PY" -m pip show -q dcredit_hvd >/dev/null 2>&1; then
    log "pip install -e $ROOT"
    "$PY" -m pip install -q "${pip_src[@]}" --no-build-isolation --no-deps -e "$ROOT"
fi
log "ready: $VENV"
