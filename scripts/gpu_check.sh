#!/usr/bin/env bash
# The engine on a GPU, proven in one run of under 10 minutes on a bare GPU machine (e.g. an image with a
# CUDA build of torch, transformers and pytest, from which nothing can be fetched).
#
#   where a registry answers:  make gpu-wheels   # the engine's and the gateway's wheels + the tokenizer into .whl/
#   on the GPU machine, in a copy of the checkout with .whl/ in it:  bash scripts/gpu_check.sh
#
# 1. installs what the image lacks: the wheels in .whl/ if carried, else from a registry if one answers;
# 2. runs the engine's parity tests on CUDA (tests/engine/test_gpu_parity.py: greedy vs Hugging Face in
#    fp32 and bf16, sdpa and flashinfer backends, CUDA graphs on and off, swap-to-host), plus the CPU
#    tests of the same seams;
# 3. runs the in-process throughput benchmark at 1 / 32 / 256 streams with CUDA graphs;
# 4. serves the same model (`sluice serve --device cuda`) and measures it with `sluice bench serve` from
#    another process at 1 / 32 / 256 concurrent streams, 2 rounds (scripts/gpu_serve_bench.sh);
# 5. runs the in-process benchmark again eagerly (no graphs), if time is left.
# Figures land in $OUT (gpu_check.txt: the summary; gpu_throughput_*.json; served.jsonl; gpu_check.log).
# STAGES picks the stages after the install (default "parity graphs served eager"); "profile" adds
# benchmarks/gpu_step_profile.py at $PROFILE_STREAMS (default 1 32 256) streams (profile_N.txt: torch.profiler
# and cProfile). BUDGET_S (570) bounds the stages' seconds together.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
SUMMARY=$OUT/gpu_check.txt
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
export SLUICE_KERNELS=0  # the C++ CPU kernels: not what is measured here, and their build takes minutes
started=$(date +%s)
BUDGET_S=${BUDGET_S:-570}  # seconds for all stages; the device tool allows a command 600
STAGES=" ${STAGES:-parity graphs served eager} "
note() { echo "$*" | tee -a "$SUMMARY"; }
stage() { [[ "$STAGES" == *" $1 "* ]]; }

: >"$SUMMARY"
note "== gpu_check $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$SUMMARY"

# --- 1. install ----------------------------------------------------------------------------------
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >>"$LOG" 2>&1 && export PYTHONPATH=$PWD:/tmp/site
else
    timeout 120 "$PY" -m pip install -q msgspec gguf >>"$LOG" 2>&1 || note "no .whl/ and no registry: msgspec/gguf may be missing"
fi
"$PY" - <<'PY' 2>&1 | tee -a "$SUMMARY"
import importlib.util, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print("flashinfer", "installed" if importlib.util.find_spec("flashinfer") else "absent: sdpa backend only")
for m in ("msgspec", "gguf", "transformers"):
    print(m, "ok" if importlib.util.find_spec(m) else "MISSING")
PY

# --- 2. parity -----------------------------------------------------------------------------------
if stage parity; then
    note "== parity (pytest)"
    timeout 270 "$PY" -m pytest -q -s -p no:cacheprovider -o addopts="" \
        tests/engine/test_gpu_parity.py tests/engine/test_attention_backends.py tests/engine/test_swap.py \
        tests/engine/test_device.py 2>&1 | tee -a "$LOG" | grep -E "passed|failed|error|agreement|SKIPPED|FAILED" \
        | tee -a "$SUMMARY"
    note "parity exit: ${PIPESTATUS[0]}"
fi
if stage profile; then
    note "== profile: decode steps at ${PROFILE_STREAMS:-1 32 256} streams (profile_N.txt)"
    # shellcheck disable=SC2086
    timeout 200 "$PY" -m benchmarks.gpu_step_profile --device cuda --streams ${PROFILE_STREAMS:-1 32 256} --out-dir "$OUT" 2>&1 \
        | tee -a "$LOG" | grep "^==" | tee -a "$SUMMARY"
    note "profile exit: ${PIPESTATUS[0]}"
fi

# --- 3.-5. throughput, in process and served ---------------------------------------------------------
in_process() {  # graphs | eager
    local left=$((BUDGET_S - ($(date +%s) - started))) flag=""
    if [ "$left" -lt 60 ]; then note "throughput ($1): skipped, ${left}s left"; return; fi
    [ "$1" = eager ] && flag="--no-graphs"
    note "== throughput in process ($1): 1 / 32 / 256 streams x (128 prompt + 128 output), SmolLM2-135M shape, bf16"
    timeout $((left - 30)) "$PY" -m benchmarks.gpu_throughput --device cuda --streams 1 32 256 $flag \
        --out "$OUT/gpu_throughput_$1.json" 2>&1 | tee -a "$LOG" | grep -E '^\{' | tee -a "$SUMMARY"
    note "throughput ($1) exit: ${PIPESTATUS[0]}"
}
stage graphs && in_process graphs
left=$((BUDGET_S - ($(date +%s) - started)))
if ! stage served; then
    :
elif [ "$left" -lt 120 ]; then
    note "served: skipped, ${left}s left"
elif ! "$PY" -c "import litestar, sqlalchemy, gateway.cli" >>"$LOG" 2>&1 || [ ! -f .whl/smollm2-tokenizer/tokenizer.json ]; then
    note "served: skipped, the gateway's packages or .whl/smollm2-tokenizer are missing (make gpu-wheels)"
else
    note "== served: sluice serve --device cuda, sluice bench serve 128/128 --ignore-eos, 1 / 32 / 256 concurrent, ${ROUNDS:-2} rounds"
    OUT=$OUT PYTHON=$PY ROUNDS=${ROUNDS:-2} timeout $((left - 60)) bash scripts/gpu_serve_bench.sh 2>&1 | tee -a "$LOG" \
        | grep -E '^\{|engine ready|exited|not ready' | tee -a "$SUMMARY"
    note "served exit: ${PIPESTATUS[0]}"
    cat "$OUT/served_client.log" >>"$LOG" 2>/dev/null; rm -f "$OUT/served_client.log"  # fewer files come back
fi
stage eager && in_process eager
note "== done in $(($(date +%s) - started)) s"
