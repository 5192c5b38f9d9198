#!/usr/bin/env bash
# The served figure on a GPU: `sluice serve --no-auth --device cuda` with SmolLM2-135M's shape (random
# weights, the real tokenizer: benchmarks/random_model.py), measured by `sluice bench serve` from another
# process, 128 in / 128 out, --ignore-eos, 2 x C prompts at each concurrency C of $CONCURRENCY, $ROUNDS rounds.
# scripts/gpu_check.sh calls it; DEVICE=cpu runs the same thing here, to check the script.
#
#   TOKENIZER=.whl/smollm2-tokenizer OUT=/tmp/served scripts/gpu_serve_bench.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_serve}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
CONCURRENCY=${CONCURRENCY:-1 32 256}
ROUNDS=${ROUNDS:-2}
PORT=${PORT:-8123}
MODEL=${MODEL:-/tmp/sluice-smollm2-served}
TOKENIZER=${TOKENIZER:-.whl/smollm2-tokenizer}
SERVE_ARGS=${SERVE_ARGS:-}
mkdir -p "$OUT"
: >"$OUT/served.jsonl"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

if [ ! -f "$MODEL/tokenizer.json" ]; then
    "$PY" -m benchmarks.random_model save "$MODEL" --tokenizer "$TOKENIZER" >/dev/null || exit 1
fi
max_c=0; for c in $CONCURRENCY; do [ "$c" -gt "$max_c" ] && max_c=$c; done
# No early 503s: a closed-loop load at its own concurrency is one the server must serve.
# shellcheck disable=SC2086
"$PY" -m gateway.cli serve --no-auth --port "$PORT" --model "$MODEL" --device "$DEVICE" --max-model-len 512 \
    --max-num-seqs "$max_c" --max-waiting $((max_c * 4 + 16)) --no-load-shedding $SERVE_ARGS \
    >"$OUT/served_server.log" 2>&1 &
server=$!
stop_server() { kill $server 2>/dev/null; wait $server 2>/dev/null; }
trap stop_server EXIT
trap 'stop_server; exit 1' INT TERM
for _ in $(seq 1 240); do
    curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && break
    kill -0 $server 2>/dev/null || { echo "server exited:"; tail -20 "$OUT/served_server.log"; exit 1; }
    sleep 0.5
done
curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null || { echo "server not ready in 120 s"; exit 1; }

bench() {  # concurrency, prompts, json file
    "$PY" -m gateway.cli bench serve --base-url "http://127.0.0.1:$PORT" --tokenizer "$MODEL" \
        --input-len 128 --output-len 128 --ignore-eos --num-prompts "$2" --max-concurrency "$1" \
        --no-progress --json-out "$3" >/dev/null 2>>"$OUT/served_client.log"
}
bench 8 16 /tmp/served_warmup.json  # first kernels, allocator; not reported
grep -m1 "engine ready" "$OUT/served_server.log" | sed 's/.*engine ready/engine ready/'
for round in $(seq 1 "$ROUNDS"); do
    for c in $CONCURRENCY; do
        prompts=$((c * 2)); [ "$prompts" -lt 8 ] && prompts=8
        f="/tmp/served_c${c}_r${round}.json"
        if bench "$c" "$prompts" "$f"; then
            # A summary line on stdout; the whole result, as one line, in $OUT/served.jsonl.
            "$PY" - "$f" "$c" "$round" "$OUT/served.jsonl" <<'PY'
import json, os, sys
r = json.load(open(sys.argv[1]))
tag = {"concurrency": int(sys.argv[2]), "round": int(sys.argv[3]), "load_avg_1m": round(os.getloadavg()[0], 2)}
print(json.dumps({
    **tag, "completed": r["completed"], "failed": r["failed"], "output_tok_per_s": round(r["output_throughput"], 1),
    "ttft_p50_ms": round(r["ttft_ms"]["p50"], 1), "tpot_p50_ms": round(r["tpot_ms"]["p50"], 2),
    "itl_p99_ms": round(r["itl_ms"]["p99"], 2),
}))
with open(sys.argv[4], "a") as out:
    out.write(json.dumps({**tag, **r}) + "\n")
PY
        else
            echo "{\"concurrency\": $c, \"round\": $round, \"error\": \"bench failed\"}"
        fi
    done
done
