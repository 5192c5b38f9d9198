#!/usr/bin/env bash
# Fetches, on a machine with a package registry, the wheels scripts/gpu_check.sh installs on a GPU
# machine that reaches none: the packages Sluice's engine imports that the GPU image lacks
# (msgspec, gguf), for its Python 3.12 on x86-64, into .whl/ (git-ignored; carry it with the run).
# FLASHINFER=1 adds flashinfer-python (its kernels compile on first use, with the nvcc there).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
packages=(msgspec gguf)
[ "${FLASHINFER:-0}" = 1 ] && packages+=(flashinfer-python)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${packages[@]}"
ls -la .whl
