#!/usr/bin/env bash
# Collect, on a machine that reaches PyPI, every Python package scripts/gpu_check.sh installs on
# a GPU machine that has no network:
#
#   bash scripts/gpu_wheelhouse.sh [OUTDIR]        # default: .gpu_wheels beside scripts/
#
# What it holds, for CPython 3.9-3.13 on manylinux x86_64 (any of them may be the GPU machine's):
#   * the Horovod 0.28.1 sdist (built there against the machine's own torch);
#   * Horovod's install requirements: cloudpickle, packaging, psutil (one abi3 wheel), PyYAML and
#     cffi (a wheel per Python version, and their sdists as a fallback), pycparser;
#   * the test tools: pytest, hypothesis and what they need (iniconfig, pluggy, pygments,
#     attrs, sortedcontainers, and exceptiongroup/tomli/typing_extensions for older Pythons);
#   * nvidia-ml-py (NVML, for the benchmark's GPU energy), setuptools and wheel.
# Not included: torch (the GPU machine's own is used), numpy (comes with that torch's
# environment; a wheel per Python version would be ~18 MB each), mpi4py (only with MPI).
#
# Idempotent: files already in OUTDIR are not downloaded again.  Prints the total size.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/.gpu_wheels}
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi
fi
HOROVOD_VERSION=0.28.1
PY_VERSIONS=${GPU_WHEELHOUSE_PYTHONS:-"3.9 3.10 3.11 3.12 3.13"}
# pip matches manylinux tags exactly: name the common ones.
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_12_x86_64 manylinux2010_x86_64
           manylinux_2_5_x86_64 manylinux1_x86_64)
# Pure-Python packages and binary ones with a wheel per Python (or abi3), with their needs.
# pip evaluates environment markers against THIS interpreter, not --python-version: the
# backports pytest and hypothesis need on older Pythons are named explicitly.
PACKAGES=(pytest hypothesis cloudpickle packaging psutil pyyaml cffi pycparser nvidia-ml-py
          setuptools wheel exceptiongroup tomli typing_extensions)
# Compiled packages whose sdist is kept as a fallback for a Python with no wheel here.
SDISTS=(pyyaml cffi psutil)

log() { printf '[gpu-wheelhouse] %s\n' "$*"; }

mkdir -p "$OUT"
export PIP_DISABLE_PIP_VERSION_CHECK=1

platform_args=()
for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done

if [ ! -f "$OUT/horovod-$HOROVOD_VERSION.tar.gz" ]; then
    log "horovod $HOROVOD_VERSION sdist"
    "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$OUT"
fi
for v in $PY_VERSIONS; do
    log "wheels for CPython $v: ${PACKAGES[*]} (and what they need)"
    "$PY" -m pip download -q --only-binary=:all: --implementation cp --python-version "$v" \
        "${platform_args[@]}" -d "$OUT" "${PACKAGES[@]}"
done
for name in "${SDISTS[@]}"; do
    if ! compgen -G "$OUT/${name}-[0-9]*.tar.gz" >/dev/null; then
        log "$name sdist (fallback)"
        "$PY" -m pip download -q --no-deps --no-binary :all: "$name" -d "$OUT"
    fi
done

# Everything gpu_check.sh installs must be there.
missing=()
wants=("horovod-$HOROVOD_VERSION.tar.gz" "pytest-*.whl" "hypothesis-*.whl" "cloudpickle-*.whl"
       "packaging-*.whl" "psutil-*abi3*.whl" "pyyaml-*.tar.gz" "cffi-*.tar.gz" "pycparser-*.whl"
       "nvidia_ml_py-*.whl" "setuptools-*.whl" "exceptiongroup-*.whl" "tomli-*.whl")
for v in $PY_VERSIONS; do wants+=("cffi-*-cp${v//./}-*.whl" "pyyaml-*-cp${v//./}-*.whl"); done
for want in "${wants[@]}"; do
    compgen -G "$OUT/$want" >/dev/null || missing+=("$want")
done
if [ ${#missing[@]} -gt 0 ]; then
    log "MISSING: ${missing[*]}"
    exit 1
fi
count=$(find "$OUT" -maxdepth 1 -type f | wc -l)
bytes=$(du -sb "$OUT" | cut -f1)
log "$count files in $OUT, total $(awk -v b="$bytes" 'BEGIN { printf "%.1f MiB", b / 1048576 }')"
