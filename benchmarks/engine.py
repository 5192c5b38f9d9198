"""`sluice bench engine`: our engine against Hugging Face `generate`, in one process, on the same requests.

This module owns the engine benchmark: the four workloads, how each side is
timed, the table and the JSON report. Of ours it imports only `engine_native`
(transformers only when the baseline runs).

Scenarios (prompts are random token ids drawn from a seeded RNG, outputs are
forced to their full length: `ignore_eos` for us, `min_new_tokens` for HF):

1. 32 requests x (128 prompt, 128 output), all submitted at once -> output tok/s.
   HF: one static batch of 32 (equal lengths, no padding).
2. 64 requests, prompt lengths U[32, 1024], output lengths U[16, 256] -> output tok/s.
   HF: requests sorted by prompt length, static batches of 8, left-padded; each batch
   generates the longest output of the batch, but only the *requested* tokens count.
3. one request (128 prompt, 128 output) -> tok/s.
4. time to first token of one 512-token prompt: ours = add_request until the first
   token leaves `step()`; HF = `generate(max_new_tokens=1)`. Median of 3 runs.

"ratio" is always ours/HF as a speed-up (>1 = we are faster): tok/s divided, TTFT inverted.
Both sides run greedy, are warmed up first, and share `torch.set_num_threads(--threads)`.

Every figure is measured in this process, stepping `LLMEngine` directly: no HTTP, no SSE, no engine
process, no gateway. It is not what a client of `sluice serve` sees; `sluice bench serve` against a
running server measures that (the run says so at its start and end, and in the JSON).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from engine_native.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_native.engine import LLMEngine
from engine_native.model.base import LoadedModel
from engine_native.model.bundled import bundled_model_path
from engine_native.model.loader import load_model
from engine_native.precision import DTYPE_CHOICES, parse_dtype
from engine_native.sampling_params import SamplingParams

CHAT_QUESTION = "What is the capital of France?"
IN_PROCESS_NOTE = (
    "IN-PROCESS figures: LLMEngine stepped directly in this process (no HTTP, SSE, engine process or gateway).\n"
    "They are NOT what a client of `sluice serve` sees; for that, run `sluice bench serve` against a server."
)
_FIRST_TOKEN_ID = 1000  # random prompts stay clear of the special tokens at the low ids


@dataclass(frozen=True)
class Workload:
    """The same requests for both sides: prompt token ids and the output length each must produce."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def total_output(self) -> int:
        return sum(self.output_lens)


@dataclass(frozen=True)
class Sizes:
    """Workload sizes; `QUICK` keeps the test run short."""

    n_uniform: int = 32
    uniform_len: tuple[int, int] = (128, 128)  # (prompt, output) for scenarios 1 and 3
    n_mixed: int = 64
    mixed_prompt: tuple[int, int] = (32, 1024)
    mixed_output: tuple[int, int] = (16, 256)
    hf_batch: int = 8
    ttft_prompt: int = 512


FULL = Sizes()
QUICK = Sizes(n_uniform=4, uniform_len=(16, 8), n_mixed=6, mixed_prompt=(8, 64), mixed_output=(4, 16),
              hf_batch=2, ttft_prompt=64)


@dataclass
class ScenarioResult:
    id: int
    name: str
    unit: str  # "tok/s" or "s"
    ours: float
    hf: float | None
    target: str
    met: bool | None  # None: the target needs the HF figure and HF was skipped
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        if self.hf is None or self.hf <= 0 or self.ours <= 0:
            return None
        return self.hf / self.ours if self.unit == "s" else self.ours / self.hf


def make_workloads(sizes: Sizes, vocab_size: int, seed: int) -> dict[int, Workload]:
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(_FIRST_TOKEN_ID, vocab_size) for _ in range(n)]

    p, o = sizes.uniform_len
    mixed_lens = [(rng.randint(*sizes.mixed_prompt), rng.randint(*sizes.mixed_output)) for _ in range(sizes.n_mixed)]
    return {
        1: Workload([prompt(p) for _ in range(sizes.n_uniform)], [o] * sizes.n_uniform),
        2: Workload([prompt(n) for n, _ in mixed_lens], [m for _, m in mixed_lens]),
        3: Workload([prompt(p)], [o]),
        4: Workload([prompt(sizes.ttft_prompt)], [1]),
    }


# ----- our engine ------------------------------------------------------------------------------


def build_engine(loaded: LoadedModel, args: argparse.Namespace, dtype: str, max_tokens_in_flight: int) -> LLMEngine:
    """An engine whose KV pool holds every request of the largest workload at once (no preemption)."""
    block = 16
    config = EngineConfig(
        model_path=args.model,
        dtype=dtype,
        num_threads=args.threads,
        # No prefix caching: warm-ups and repeated TTFT runs reuse prompts, and a cache hit would
        # measure the cache, not the engine (the prefix cache has its own benchmark: sluice bench prefix).
        cache=CacheConfig(
            block_size=block,
            num_blocks=max_tokens_in_flight // block + 2 * args.max_num_seqs + 64,
            enable_prefix_caching=False,
        ),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens),
    )
    return LLMEngine(config, loaded=loaded, progress=False)


def _greedy(n: int, ignore_eos: bool = True) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=ignore_eos)


def ours_throughput(engine: LLMEngine, work: Workload) -> tuple[float, float, int]:
    """Submit everything at once, step to completion -> (tok/s, seconds, output tokens)."""
    start = time.perf_counter()
    outputs = engine.generate(work.prompts, [_greedy(n) for n in work.output_lens])
    elapsed = time.perf_counter() - start
    tokens = sum(len(o) for o in outputs)
    return tokens / elapsed, elapsed, tokens


def ours_ttft(engine: LLMEngine, prompt: list[int]) -> float:
    """Seconds from add_request until the first token comes out of step()."""
    start = time.perf_counter()
    engine.add_request("ttft", prompt, _greedy(1))
    first: float | None = None
    while engine.has_unfinished:
        outs = engine.step()
        if first is None and any(o.request_id == "ttft" and o.new_token_ids for o in outs):
            first = time.perf_counter() - start
    assert first is not None, "the TTFT request produced no token"
    return first


def chat_answer(engine: LLMEngine) -> str:
    tok = engine.tokenizer
    assert tok is not None, "the model has no tokenizer"
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": CHAT_QUESTION}]),
                        add_special_tokens=False)
    out = engine.generate([prompt], _greedy(48, ignore_eos=False))[0]
    return tok.decode(out, skip_special_tokens=True)


def direct_streams(model_path: str | None, num_streams: int, input_len: int, output_len: int, dtype: str,
                   threads: int, seed: int = 0) -> dict[str, float]:
    """`num_streams` requests submitted at once to an engine configured as `sluice serve` configures it
    (default cache and scheduler), stepped to completion with detokenization on -> output tok/s.

    The in-process half of `sluice bench gateway`; the engine is dropped before this returns.
    """
    torch.set_num_threads(threads)
    config = EngineConfig(model_path=model_path or bundled_model_path(), dtype=dtype, num_threads=threads)
    engine = LLMEngine(config, progress=False)
    rng = random.Random(seed)
    vocab = engine.loaded.config.vocab_size
    prompts = [[rng.randrange(_FIRST_TOKEN_ID, vocab) for _ in range(input_len)] for _ in range(num_streams)]
    warm_up = [[rng.randrange(_FIRST_TOKEN_ID, vocab) for _ in range(input_len)] for _ in range(2)]
    engine.generate(warm_up, _greedy(4))  # other prompts than the measured ones: no prefix-cache hits
    rate, secs, tokens = ours_throughput(engine, Workload(prompts, [output_len] * num_streams))
    return {"output_tok_s": rate, "duration_s": secs, "output_tokens": float(tokens),
            "input_tokens": float(input_len * num_streams)}


# ----- the Hugging Face baseline -----------------------------------------------------------------


class HFBaseline:
    """transformers `generate` with static batches; the model is the same file, dequantized by transformers."""

    def __init__(self, model_path: str, pad_token_id: int, dtype: torch.dtype) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModelForCausalLM

        if model_path.lower().endswith(".gguf"):
            folder, name = os.path.split(model_path)
            self.model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        self.model.eval()
        self.pad = pad_token_id

    def generate_batch(self, prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding: every prompt ends at the last column
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, pad_token_id=self.pad,
            )
        return out[:, width:]

    def throughput(self, work: Workload, batch_size: int) -> tuple[float, float, int]:
        """Static batches of `batch_size` in prompt-length order -> (tok/s, seconds, requested tokens)."""
        order = sorted(range(len(work.prompts)), key=lambda i: len(work.prompts[i]))
        start = time.perf_counter()
        for lo in range(0, len(order), batch_size):
            batch = order[lo:lo + batch_size]
            self.generate_batch([work.prompts[i] for i in batch], max(work.output_lens[i] for i in batch))
        elapsed = time.perf_counter() - start
        return work.total_output / elapsed, elapsed, work.total_output

    def ttft(self, prompt: list[int]) -> float:
        start = time.perf_counter()
        self.generate_batch([prompt], 1)
        return time.perf_counter() - start


# ----- the run -----------------------------------------------------------------------------------

def _names(sizes: Sizes) -> dict[int, str]:
    p, o = sizes.uniform_len
    return {1: f"{sizes.n_uniform} x {p}/{o} at once", 2: f"{sizes.n_mixed} mixed lengths",
            3: f"1 request {p}/{o}", 4: f"TTFT {sizes.ttft_prompt}-token prompt"}


def _median_of(n: int, fn: Callable[[], float]) -> float:
    return statistics.median(fn() for _ in range(n))


def run_scenarios(engine: LLMEngine, hf: HFBaseline | None, works: dict[int, Workload], scenarios: Sequence[int],
                  sizes: Sizes) -> list[ScenarioResult]:
    results = []
    names = _names(sizes)
    for sid in scenarios:
        work = works[sid]
        load = os.getloadavg()[0]
        if sid == 4:
            ours = _median_of(3, functools.partial(ours_ttft, engine, work.prompts[0]))
            theirs = _median_of(3, functools.partial(hf.ttft, work.prompts[0])) if hf else None
            result = ScenarioResult(sid, names[sid], "s", ours, theirs, "<= 0.4 s", ours <= 0.4,
                                    {"prompt_tokens": len(work.prompts[0]), "runs": 3, "statistic": "median"})
        else:
            rate, secs, toks = ours_throughput(engine, work)
            details: dict[str, Any] = {"requests": len(work.prompts), "output_tokens": toks, "ours_s": secs,
                                       "requested_output_tokens": work.total_output,
                                       "prompt_tokens": sum(len(p) for p in work.prompts)}
            theirs = None
            if hf is not None:
                batch = {1: len(work.prompts), 2: sizes.hf_batch, 3: 1}[sid]
                theirs, hf_secs, _ = hf.throughput(work, batch)
                details.update(hf_s=hf_secs, hf_batch_size=batch)
            target, met = {1: ("ours >= 480 tok/s", rate >= 480), 3: ("ours >= 60 tok/s", rate >= 60)}.get(
                sid, ("ours >= 4x HF", None if theirs is None else rate >= 4 * theirs))
            result = ScenarioResult(sid, names[sid], "tok/s", rate, theirs, target, met, details)
        result.details["load_average_1min_at_start"] = load
        print(f"  scenario {sid} done: ours {result.ours:.3f} {result.unit}"
              + (f", HF {result.hf:.3f}" if result.hf is not None else ""), flush=True)
        results.append(result)
    return results


def format_table(results: list[ScenarioResult]) -> str:
    def num(v: float | None, unit: str) -> str:
        return "-" if v is None else (f"{v:.3f} s" if unit == "s" else f"{v:.1f} tok/s")

    rows = [("scenario", "ours", "HF", "ratio", "target", "met")]
    for r in results:
        met = "-" if r.met is None else ("yes" if r.met else "NO")
        rows.append((f"({r.id}) {r.name}", num(r.ours, r.unit), num(r.hf, r.unit),
                     "-" if r.ratio is None else f"{r.ratio:.2f}x", r.target, met))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def compare_dtypes(args: argparse.Namespace, sizes: Sizes) -> dict[str, Any]:
    """Scenarios 1 and 3 with our engine in float32 and bfloat16: which should be the default."""
    figures: dict[str, dict[str, float]] = {}
    for dtype in ("float32", "bfloat16"):
        loaded = load_model(args.model, dtype=parse_dtype(dtype), progress=False)
        works = make_workloads(sizes, loaded.config.vocab_size, args.seed)
        engine = build_engine(loaded, args, dtype, _tokens_in_flight(works, [1, 3]))
        engine.generate(works[3].prompts, _greedy(4))  # warm-up
        figures[dtype] = {f"scenario_{s}_tok_s": ours_throughput(engine, works[s])[0] for s in (1, 3)}
        print(f"  {dtype}: " + ", ".join(f"{k} {v:.1f}" for k, v in figures[dtype].items()), flush=True)
        del engine, loaded
    faster = {k: max(figures, key=lambda d: figures[d][k]) for k in figures["float32"]}
    for key, dtype in faster.items():
        print(f"{key}: {dtype} is faster ({figures['float32'][key]:.1f} fp32 vs {figures['bfloat16'][key]:.1f} bf16)")
    return {"figures": figures, "faster": faster}


def _tokens_in_flight(works: dict[int, Workload], scenarios: Sequence[int]) -> int:
    return max(sum(len(p) + n for p, n in zip(w.prompts, w.output_lens, strict=True))
               for s, w in works.items() if s in scenarios)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="sluice bench engine", description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF folder; default: the bundled SmolLM2")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="dtype of our engine and of the HF baseline (auto: bf16 only on CPUs with native bf16)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for both sides")
    p.add_argument("--skip-hf", action="store_true", help="run our engine only")
    p.add_argument("--scenarios", default="1,2,3,4", help="comma-separated subset of 1,2,3,4")
    p.add_argument("--quick", action="store_true", help="tiny sizes (tests)")
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens)
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and lengths")
    p.add_argument("--compare-dtypes", action="store_true",
                   help="only run scenarios 1 and 3 with our engine in float32 and bfloat16")
    p.add_argument("--json-out", default=None, help="also write the results as JSON here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(args)


def run(args: argparse.Namespace) -> int:
    args.model = args.model or bundled_model_path()
    torch.set_num_threads(args.threads)
    sizes = QUICK if args.quick else FULL
    print(IN_PROCESS_NOTE, flush=True)
    report: dict[str, Any] = {"model": args.model, "dtype": args.dtype, "threads": args.threads,
                              "quick": args.quick, "measured": "in-process, not through the server",
                              "load_average_start": os.getloadavg()}
    if args.compare_dtypes:
        report["compare_dtypes"] = compare_dtypes(args, sizes)
        return _finish(report, args, ok=True)

    scenarios = sorted({int(s) for s in args.scenarios.split(",") if s.strip()})
    if not set(scenarios) <= {1, 2, 3, 4}:
        raise SystemExit(f"--scenarios must be a subset of 1,2,3,4, got {args.scenarios}")
    loaded = load_model(args.model, dtype=parse_dtype(args.dtype), progress=False)
    works = make_workloads(sizes, loaded.config.vocab_size, args.seed)
    engine = build_engine(loaded, args, args.dtype, _tokens_in_flight(works, scenarios))
    pad = min(loaded.tokenizer.eos_token_ids) if loaded.tokenizer and loaded.tokenizer.eos_token_ids else 0
    hf = None if args.skip_hf else HFBaseline(args.model, pad, parse_dtype(args.dtype))  # same dtype as ours

    warm = works[3].prompts[:1] * 2
    engine.generate(warm, _greedy(4))
    if hf is not None:
        hf.generate_batch(warm, 4)

    answer = chat_answer(engine)
    print(f"chat check: {CHAT_QUESTION!r} -> {answer!r}", flush=True)
    report["chat"] = {"question": CHAT_QUESTION, "answer": answer, "ok": "Paris" in answer}

    results = run_scenarios(engine, hf, works, scenarios, sizes)
    print(format_table(results))
    report["scenarios"] = [{**asdict(r), "ratio": r.ratio} for r in results]
    return _finish(report, args, ok=report["chat"]["ok"])


def _finish(report: dict[str, Any], args: argparse.Namespace, ok: bool) -> int:
    report["load_average_end"] = os.getloadavg()
    print(f"load average (1/5/15 min) at the end: {report['load_average_end']} -- figures measured under that load")
    print(IN_PROCESS_NOTE)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if ok else 1
