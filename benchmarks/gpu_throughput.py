"""Engine throughput on a GPU at 1 / 32 / 256 concurrent streams, in one process (scripts/gpu_check.sh).

The model is SmolLM2-135M's shape with random weights, saved as a Hugging Face folder on the spot
(benchmarks/random_model.py): the bundled GGUF file is too big to carry to a bare GPU machine, and
throughput depends on the shape, not on the values. Each run submits N requests of `--prompt-len`
random tokens at once and forces `--output-len` tokens each (`ignore_eos`); it reports output tokens
per second over the whole run (prefill included) and the mean time per decode step once every
stream is decoding. An in-process figure: scripts/gpu_check.sh also measures the served one.

    python -m benchmarks.gpu_throughput --device cuda --out figures.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.random_model import save_random_model
from engine_native.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_native.engine import LLMEngine
from engine_native.sampling_params import SamplingParams


def run_streams(engine: LLMEngine, streams: int, prompt_len: int, output_len: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    vocab = engine.loaded.config.vocab_size
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i in range(streams):
        engine.add_request(f"s{streams}-{i}", [rng.randrange(vocab) for _ in range(prompt_len)], params)
    start = time.perf_counter()
    generated = 0
    decode_steps: list[float] = []
    while engine.has_unfinished:
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        generated += len(outs)
        sched = engine.scheduler
        if len(outs) == streams and not len(sched.waiting):  # every stream decoded this step
            decode_steps.append(dt)
    wall = time.perf_counter() - start
    return {
        "streams": streams,
        "output_tokens": generated,
        "wall_s": round(wall, 3),
        "output_tok_per_s": round(generated / wall, 1),
        "decode_step_ms_mean": round(1000 * sum(decode_steps) / len(decode_steps), 3) if decode_steps else None,
        "preemptions": engine.scheduler.num_preemptions,
    }


def engine_config(device: str, dtype: str, backend: str, model_dir: Path, max_streams: int, max_model_len: int,
                  graphs: bool = True) -> EngineConfig:
    """An engine that takes `max_streams` at once, prefills 2,048 tokens a step, never reuses a prefix."""
    return EngineConfig(
        model_path=str(model_dir), dtype=dtype, device=device, attention_backend=backend, max_model_len=max_model_len,
        cuda_graph_batch_sizes=EngineConfig.cuda_graph_batch_sizes if graphs else (),
        cache=CacheConfig(enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=max_streams, max_num_batched_tokens=max(2048, max_streams),
                                  long_prefill_token_threshold=2048, max_waiting=max_streams + 8),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--no-graphs", action="store_true", help="run decode steps eagerly")
    p.add_argument("--model-dir", default="/tmp/sluice-smollm2-shape")
    p.add_argument("--out", default=None, help="JSON file for the figures")
    args = p.parse_args(argv)
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        save_random_model(model_dir)
    results: dict[str, Any] = {"device": args.device, "dtype": args.dtype, "graphs": not args.no_graphs,
                               "prompt_len": args.prompt_len, "output_len": args.output_len, "runs": []}
    config = engine_config(args.device, args.dtype, args.attention_backend, model_dir, max(args.streams),
                           args.prompt_len + args.output_len + 16, graphs=not args.no_graphs)
    t0 = time.perf_counter()
    engine = LLMEngine(config, progress=False)  # it loads the weights in the dtype it computes in there
    results["start_s"] = round(time.perf_counter() - t0, 2)
    results["engine_device"], results["attention_backend"] = engine.device_name, engine.attention_backend_name
    run_streams(engine, 4, 16, 8, seed=99)  # warm-up: first kernels, allocator
    for n in args.streams:
        r = run_streams(engine, n, args.prompt_len, args.output_len, seed=n)
        results["runs"].append(r)
        print(json.dumps(r), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k != "runs"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
