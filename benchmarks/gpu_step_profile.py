"""Where a decode step's time goes on a device: the torch profiler's top operators by device and host
time, and cProfile's top Python functions, over the steps of N streams that all decode.

For a GPU session's prepared script (scripts/gpu_check.sh can run it): with N streams of `--prompt-len`
random tokens prefilled, it profiles `--steps` decode steps with torch.profiler, then as many with
cProfile (one profiler at a time: each distorts the other), and writes one text report per N.

    python -m benchmarks.gpu_step_profile --device cuda --streams 1 256 --out-dir /tmp/profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu_throughput import engine_config
from benchmarks.random_model import save_random_model
from engine_native.engine import LLMEngine
from engine_native.sampling_params import SamplingParams


def decode_steps(engine: LLMEngine, n: int) -> float:
    """Run n steps; seconds per step."""
    t0 = time.perf_counter()
    for _ in range(n):
        engine.step()
    return (time.perf_counter() - t0) / n


def profile_streams(engine: LLMEngine, streams: int, prompt_len: int, steps: int) -> str:
    rng = random.Random(streams)
    vocab = engine.loaded.config.vocab_size
    params = SamplingParams(max_tokens=3 * steps + 64, temperature=0.0, ignore_eos=True)
    for i in range(streams):
        engine.add_request(f"p{streams}-{i}", [rng.randrange(vocab) for _ in range(prompt_len)], params)
    while len(engine.scheduler.waiting) or any(r.num_computed_tokens < r.num_prompt_tokens
                                                for r in engine.scheduler.running):
        engine.step()  # the prompts, not profiled
    plain_s = decode_steps(engine, steps)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        profiled_s = decode_steps(engine, steps)
    by_device = "self_cuda_time_total" if engine.device.type == "cuda" else "self_cpu_time_total"
    cp = cProfile.Profile()
    cp.enable()
    cprofiled_s = decode_steps(engine, steps)
    cp.disable()
    text = io.StringIO()
    text.write(f"== {streams} streams, {steps} decode steps: {1000 * plain_s:.3f} ms/step unprofiled, "
               f"{1000 * profiled_s:.3f} under torch.profiler, {1000 * cprofiled_s:.3f} under cProfile\n\n")
    text.write(f"-- torch.profiler, by {by_device}\n")
    text.write(prof.key_averages().table(sort_by=by_device, row_limit=25, max_name_column_width=60))
    text.write("\n-- torch.profiler, by self_cpu_time_total\n")
    text.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    for order in ("tottime", "cumulative"):
        text.write(f"\n-- cProfile, by {order}\n")
        pstats.Stats(cp, stream=text).sort_stats(order).print_stats(30)
    engine.abort([f"p{streams}-{i}" for i in range(streams)])
    return text.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 256])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--model-dir", default="/tmp/sluice-smollm2-shape")
    p.add_argument("--out-dir", type=Path, default=Path("/tmp/gpu_profile"))
    args = p.parse_args(argv)
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        save_random_model(model_dir)
    engine = LLMEngine(engine_config(args.device, args.dtype, args.attention_backend, model_dir, max(args.streams),
                                     args.prompt_len + 3 * args.steps + 80, graphs=not args.no_graphs),
                       progress=False)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for n in args.streams:
        report = profile_streams(engine, n, args.prompt_len, args.steps)
        (args.out_dir / f"profile_{n}.txt").write_text(report)
        print(report.splitlines()[0], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
