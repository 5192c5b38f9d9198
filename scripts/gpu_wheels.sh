#!/usr/bin/env bash
# Fetches, on a machine with a package registry, what scripts/gpu_check.sh installs on a GPU machine that
# reaches none, into .whl/ (git-ignored; carry it with the run):
#   - the packages Sluice imports that the GPU image lacks, for its Python 3.12 on x86-64, at the versions
#     this venv holds: the engine's (msgspec, gguf) and the gateway's (litestar, uvicorn, SQLAlchemy, ...),
#     about 18 MB;
#   - the bundled model's tokenizer (.whl/smollm2-tokenizer), for the served benchmark's random-weight model.
# FLASHINFER=1 adds flashinfer-python (its kernels compile on first use, with the nvcc there).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
engine=(msgspec gguf)
gateway=(litestar litestar-htmx multipart polyfactory faker rich-click sniffio uvicorn uvloop httptools sqlalchemy greenlet alembic
         mako aiosqlite asyncpg redis opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions
         opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-http-transport
         opentelemetry-exporter-otlp-common opentelemetry-exporter-otlp-proto-common opentelemetry-proto
         googleapis-common-protos stripe pyzmq)
pins=()
for name in "${engine[@]}" "${gateway[@]}"; do
    pins+=("$name==$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")")
done
[ "${FLASHINFER:-0}" = 1 ] && pins+=(flashinfer-python)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 -d .whl "${pins[@]}"
"$PY" -m benchmarks.random_model export-tokenizer .whl/smollm2-tokenizer >/dev/null
du -sh .whl
