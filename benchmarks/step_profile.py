"""`sluice bench profile`: measure this machine's engine step costs into a simulator profile.

The fleet simulator (`sluice simulate`, simulator/profile.py) models a worker as

    decode step = step_base_s + per_seq_s x running + per_context_token_s x context tokens
    prefill     = prefill_base_s + prompt tokens / prefill_tokens_per_s

This benchmark fits those figures on `LLMEngine` stepped in this process with the bundled model:
decode steps timed at batch sizes 1..32 with short contexts (the base and the per-sequence cost), the
same batch with long contexts (the per-context-token cost), and prompts of two lengths prefilled alone
(the prefill rate and its fixed cost). The cold start is what loading the model and building the
engine took. The raw table is kept in the JSON (`measurements`) beside the fitted figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "simulator" / "profiles" / "cpu-smollm2-135m.json"
BATCHES = (1, 2, 4, 8, 16)
# Steps of up to EngineConfig.quantized_max_rows sequences run the engine's fused C++ decode (8; 2 where the
# bf16 panels take the steps above), larger ones the dense path: the linear model is fitted up to 8
# sequences, and the profile caps a worker's batch there.
FITTED = (1, 2, 4, 8)
DECODE_STEPS = 12
SHORT_PROMPT, LONG_PROMPT = 32, 480
PREFILLS = (256, 1024)


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("profile", help="this machine's engine step costs, as a simulator profile (JSON)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the profile JSON goes")
    p.add_argument("--threads", type=int, default=None, help="torch threads; default: torch's choice")
    p.add_argument("--dtype", default="auto", help="weight/activation dtype of the engine")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine_native.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine_native.engine import LLMEngine
    from engine_native.model.bundled import bundled_model_path
    from engine_native.sampling_params import SamplingParams

    rng = random.Random(0)
    started = time.perf_counter()
    config = EngineConfig(
        model_path=bundled_model_path(), dtype=args.dtype, num_threads=args.threads,
        cache=CacheConfig(block_size=16, num_blocks=2048, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=max(BATCHES), max_num_batched_tokens=2048,
                                  long_prefill_token_threshold=2048),
    )
    engine = LLMEngine(config, progress=False)
    cold_start = time.perf_counter() - started

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 20000) for _ in range(n)]

    def decode_step(batch: int, prompt_len: int) -> float:
        """Mean time of a pure decode step with `batch` sequences of ~`prompt_len` context."""
        for i in range(batch):
            engine.add_request(f"d{batch}-{prompt_len}-{i}", prompt(prompt_len),
                               SamplingParams(max_tokens=DECODE_STEPS + 8, temperature=0.0, ignore_eos=True))
        while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                              for r in engine.scheduler.running):
            engine.step()
        engine.step()  # one decode step untimed: settles the batch
        steps = []
        for _ in range(DECODE_STEPS):
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        elapsed = statistics.median(steps)  # a busy machine's stalls land in a few steps, not the median
        while engine.has_unfinished:
            engine.step()
        return elapsed

    def prefill(n: int) -> float:
        engine.add_request(f"p{n}", prompt(n), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        t0 = time.perf_counter()
        while engine.has_unfinished:
            engine.step()
        return time.perf_counter() - t0

    decode_step(4, SHORT_PROMPT)  # warm-up (kernels, allocator)
    prefill(PREFILLS[0])
    short = {b: statistics.median(decode_step(b, SHORT_PROMPT) for _ in range(3)) for b in BATCHES}
    long_batch = 8
    long = statistics.median(decode_step(long_batch, LONG_PROMPT) for _ in range(3))
    prefills = {n: statistics.median(prefill(n) for _ in range(3)) for n in PREFILLS}

    base, per_seq = _fit_line([float(b) for b in FITTED], [short[b] for b in FITTED])
    # Same batch, contexts longer by (LONG - SHORT) tokens each: the difference is the KV read.
    extra_context = long_batch * (LONG_PROMPT - SHORT_PROMPT)
    per_context = max(0.0, (long - short[long_batch]) / extra_context)
    (p_lo, t_lo), (p_hi, t_hi) = sorted(prefills.items())
    per_token = (t_hi - t_lo) / (p_hi - p_lo)
    if per_token <= 0 or per_seq < 0 or base <= 0:
        raise SystemExit(f"the measurements contradict each other (prefill {prefills}, decode {short}): the "
                         f"machine is too busy (load average {os.getloadavg()[0]:.1f}); run it on an idle one")
    profile: dict[str, Any] = {
        "name": "cpu-smollm2-135m",
        "step_base_s": round(base, 6),
        "per_seq_s": round(max(0.0, per_seq), 7),
        "per_context_token_s": round(per_context, 10),
        "prefill_tokens_per_s": round(1.0 / per_token, 1),
        "prefill_base_s": round(max(0.0, t_lo - p_lo * per_token), 6),
        "max_num_seqs": max(FITTED),
        "kv_tokens": 2048 * 16,
        "cold_start_s": round(cold_start + 3.0, 2),  # + the engine process and gateway start
        "source": "measured",
        "notes": [
            (f"Measured by `sluice bench profile` on this machine ({os.cpu_count()} CPUs, load average "
            f"{os.getloadavg()[0]:.2f} at the end), the bundled SmolLM2-135M, dtype {args.dtype}, "
            f"torch threads {args.threads or 'default'}."),
            (f"Decode steps: median of 3 runs of {DECODE_STEPS} steps per batch size, prompts of {SHORT_PROMPT} "
            f"tokens; the per-context-token cost from batch {long_batch} at {LONG_PROMPT}-token prompts."),
            "Prefill: one prompt alone, median of 3; prefill_base_s and the rate fitted on two lengths.",
            "cold_start_s: model load + engine build measured here, plus ~3 s for the process and gateway.",
            "Decode step times are medians of single steps: stalls of a shared machine fall outside them.",
            (f"Fitted on batches {FITTED} (the fused decode path); batch {max(BATCHES)} took "
            f"{short[max(BATCHES)] * 1000:.0f} ms a step (the dense path), so max_num_seqs is {max(FITTED)}."),
        ],
        "measurements": {
            "decode_step_s_by_batch": {str(b): round(short[b], 6) for b in BATCHES},
            f"decode_step_s_batch_{long_batch}_prompt_{LONG_PROMPT}": round(long, 6),
            "prefill_s_by_prompt": {str(n): round(t, 6) for n, t in prefills.items()},
            "model_load_and_engine_build_s": round(cold_start, 3),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(profile, indent=2) + "\n")
    print(json.dumps(profile, indent=2))
    return 0


def _fit_line(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x -> (a, b)."""
    mx, my = statistics.fmean(x), statistics.fmean(y)
    b = sum((xi - mx) * (yi - my) for xi, yi in zip(x, y, strict=True)) / sum((xi - mx) ** 2 for xi in x)
    return my - b * mx, b
