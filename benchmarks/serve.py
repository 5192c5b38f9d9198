"""`sluice bench serve`: load-test any OpenAI-compatible server the way `vllm bench serve` does.

Prompts are built as vLLM's `--dataset-name random` builds them, from the served model's tokenizer
(`benchmarks.serve_prompts`; `--dataset-name words` needs no tokenizer). They are sent at `request_rate`
(gamma-distributed gaps, Poisson at burstiness 1; inf: all at once), at most `max_concurrency` in
flight, each streaming up to its output length, with `stream_options.include_usage`. From the SSE
stream of each request it records TTFT, every inter-chunk gap and the end-to-end latency, and takes
token counts from the usage the server reports; `benchmarks.serve_metrics` defines each figure as
vLLM's client does and aggregates them (mean, median, p90, p99), plus throughputs, goodput under
SLOs and the failed requests by status. httpx, not the openai package, so any compatible server works.
Importable: `await run_benchmark(BenchConfig(...)) -> BenchResult`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import math
import random
import time
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from tqdm import tqdm

from benchmarks.serve_metrics import BenchResult, RequestRecord, Slos, Stats, format_report, summarize
from benchmarks.serve_prompts import (
    DatasetName,
    Prompt,
    PromptSpec,
    PromptTokenizer,
    ServedModelTokenizer,
    make_prompts,
)
from benchmarks.sse_lines import sse_lines

__all__ = ["BenchConfig", "BenchResult", "RequestRecord", "Stats", "run_benchmark"]


@dataclass(frozen=True)
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first model the server lists
    endpoint: Literal["chat", "completions"] = "completions"  # vLLM's client defaults to completions too
    dataset_name: DatasetName = "random"
    tokenizer: str | None = None  # the served model's (GGUF file or HF folder); None: the bundled model's
    num_prompts: int = 100
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0  # lengths drawn from [len * (1 - r), len * (1 + r)]
    prefix_len: int = 0  # tokens of a random prefix shared by every prompt
    request_rate: float = math.inf  # requests/s; inf sends all at once
    burstiness: float = 1.0  # shape of the gamma distribution of gaps; 1: Poisson arrivals
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = False
    temperature: float | None = None  # None: not sent, the server's default (as vLLM's client)
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    timeout_s: float = 600.0
    progress: bool = True
    api_key: str | None = None
    save_detailed: bool = False  # per-request figures in the result

    @property
    def prompt_spec(self) -> PromptSpec:
        return PromptSpec(
            self.num_prompts, self.input_len, self.output_len, self.range_ratio, self.prefix_len, self.seed
        )


@functools.lru_cache(maxsize=4)
def served_model_tokenizer(path: str | None) -> ServedModelTokenizer:
    if path is None:
        from engine_native.model.bundled import bundled_model_path

        path = bundled_model_path()
    return ServedModelTokenizer(path)


def build_prompts(config: BenchConfig) -> tuple[list[Prompt], PromptTokenizer | None]:
    tokenizer = served_model_tokenizer(config.tokenizer) if config.dataset_name == "random" else None
    return make_prompts(config.dataset_name, config.prompt_spec, tokenizer), tokenizer


def arrival_times(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Seconds from the start at which each request is sent. Gaps are gamma-distributed with mean 1/rate,
    then scaled so that the last request goes at n / rate exactly, as vLLM's client does: throughput then
    does not move with the seed."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    times, at = [], 0.0
    for _ in range(n):
        at += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        times.append(at)
    scale = (n / rate) / times[-1] if times and times[-1] > 0 else 1.0
    return [t * scale for t in times]


def _body(config: BenchConfig, model: str, prompt: Prompt) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.temperature is not None:
        body["temperature"] = config.temperature
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.text}]
        body["max_completion_tokens"] = prompt.output_len
    else:
        body["prompt"] = prompt.text
        body["max_tokens"] = prompt.output_len
    return body


def _choice_text(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        return str(choice["delta"].get("content") or "")
    return str(choice.get("text") or "")


async def _one(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    prompt: Prompt,
    tokenizer: PromptTokenizer | None,
) -> RequestRecord:
    record = RequestRecord(prompt_tokens=prompt.prompt_len)
    text: list[str] = []
    reported_output: int | None = None
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as response:
            record.status = response.status_code
            if response.status_code != 200:
                record.failure = str(response.status_code)
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record
            async for line in sse_lines(response):
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    record.failure = "stream error"
                    record.error = str(event["error"].get("message", "stream error"))
                    return record
                if event.get("choices"):  # a chunk, whatever its text (vLLM's definition)
                    now = time.perf_counter()
                    if chunks == 0:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last, chunks = now, chunks + 1
                    text.append(_choice_text(event["choices"][0]))
                elif event.get("usage"):
                    reported_output = int(event["usage"]["completion_tokens"])
                    if event["usage"].get("prompt_tokens") is not None:
                        record.prompt_tokens = int(event["usage"]["prompt_tokens"])
    except httpx.HTTPError as exc:
        # httpx's own message is often empty ("ReadError: "): the exception under it and how far the
        # stream got say whether the connection broke before the response or in the middle of it.
        root: BaseException = exc
        while (cause := root.__cause__ or root.__context__) is not None:
            root = cause
        same = (type(root).__name__, str(root)) == (type(exc).__name__, str(exc))  # httpcore's twin of httpx's
        under = "" if same else f" ({type(root).__name__}: {root})"
        record.failure = "transport error"
        record.error = f"{type(exc).__name__}: {exc}{under}, status {record.status}, after {chunks} chunks"
        return record
    except (json.JSONDecodeError, KeyError, ValueError, TypeError, AttributeError) as exc:
        record.failure, record.error = "bad event", f"{type(exc).__name__}: {exc}"
        return record
    if chunks == 0:
        record.failure, record.error = "no chunk", "the stream ended without a chunk"
        return record
    record.e2e_s = last - start
    if reported_output is not None:
        record.output_tokens = reported_output
    elif tokenizer is not None:
        record.output_tokens = len(tokenizer.encode("".join(text)))
    else:
        record.output_tokens = sum(1 for t in text if t)
    record.ok = True
    return record


async def _first_model(client: httpx.AsyncClient, base_url: str) -> str:
    response = await client.get(f"{base_url}/v1/models")
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


async def run_benchmark(config: BenchConfig) -> BenchResult:
    base = config.base_url.rstrip("/")
    url = f"{base}/v1/chat/completions" if config.endpoint == "chat" else f"{base}/v1/completions"
    prompts, tokenizer = build_prompts(config)
    times = arrival_times(len(prompts), config.request_rate, config.burstiness, random.Random(config.seed))
    headers = {"authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.max_concurrency or config.num_prompts or 1)
    async with httpx.AsyncClient(timeout=config.timeout_s, headers=headers, limits=limits) as client:
        model = config.model or await _first_model(client, base)
        gate = asyncio.Semaphore(config.max_concurrency or max(1, config.num_prompts))
        bar = tqdm(total=config.num_prompts, disable=not config.progress, desc="requests")

        async def limited(prompt: Prompt) -> RequestRecord:
            async with gate:
                record = await _one(client, url, _body(config, model, prompt), prompt, tokenizer)
            bar.update(1)
            return record

        # What was loaded so far (the tokenizer, torch) stays; a full collection walking it mid-run
        # would pause this client for 100+ ms and show as the server's latency. vLLM's client does the same.
        gc.collect()
        gc.freeze()
        start = time.perf_counter()
        tasks = []
        for prompt, at in zip(prompts, times, strict=True):
            wait = start + at - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(limited(prompt)))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return summarize(
        records,
        duration,
        model=model,
        endpoint=config.endpoint,
        dataset=_describe_prompts(config, prompts),
        slos=Slos(config.slo_ttft_ms, config.slo_tpot_ms),
        detailed=config.save_detailed,
    )


def _describe_prompts(config: BenchConfig, prompts: list[Prompt]) -> str:
    source = "words"
    if config.dataset_name == "random":
        source = f"random ids, tokenizer {config.tokenizer or 'bundled'}"
    lens = [p.prompt_len for p in prompts] or [0]
    return (f"{source}, {min(lens)}-{max(lens)} prompt tokens (prefix {config.prefix_len}), "
            f"max_tokens {config.output_len} x (1 +- {config.range_ratio})")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="benchmark an OpenAI-compatible server as `vllm bench serve` does",
        description=__doc__,
        formatter_class=_HelpFormatter,
    )
    d = BenchConfig()
    p.add_argument("--base-url", default=d.base_url, help="server root, without /v1")
    p.add_argument("--model", default=None, help="model id; default: the first from /v1/models")
    p.add_argument("--endpoint", choices=["chat", "completions"], default=d.endpoint, help="API to drive")
    p.add_argument("--dataset-name", choices=["random", "words"], default=d.dataset_name,
                   help="random: vLLM's random token prompts (needs the tokenizer); words: random words")
    p.add_argument("--tokenizer", default=None,
                   help="the served model's tokenizer: GGUF file or HF folder; default: the bundled model")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts, help="requests to send")
    p.add_argument("--input-len", "--random-input-len", type=int, default=d.input_len,
                   help="prompt tokens (mean, with --random-range-ratio)")
    p.add_argument("--output-len", "--random-output-len", type=int, default=d.output_len,
                   help="max_tokens of each request (mean, with --random-range-ratio)")
    p.add_argument("--random-range-ratio", dest="range_ratio", type=float, default=d.range_ratio,
                   help="lengths uniform in [len * (1 - r), len * (1 + r)], 0 <= r < 1")
    p.add_argument("--random-prefix-len", dest="prefix_len", type=int, default=d.prefix_len,
                   help="tokens of a random prefix shared by every prompt, before the random part")
    p.add_argument("--ignore-eos", action="store_true", help="ask the server to generate exactly max_tokens")
    p.add_argument("--temperature", type=float, default=None, help="sent if given; default: the server's")
    p.add_argument("--request-rate", type=float, default=d.request_rate, help="req/s; inf = all at once")
    p.add_argument("--burstiness", type=float, default=d.burstiness,
                   help="gamma shape of the gaps between requests: 1 = Poisson, < 1 burstier")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of prompts and arrival times")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT SLO for goodput")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT SLO for goodput")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="per-request timeout in seconds")
    p.add_argument("--api-key", default=None, help="bearer token, if the server needs one")
    p.add_argument("--json-out", default=None, help="also write the result as JSON to this path")
    p.add_argument("--save-detailed", action="store_true", help="per-request figures in the JSON")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    config = BenchConfig(
        base_url=args.base_url,
        model=args.model,
        endpoint=args.endpoint,
        dataset_name=args.dataset_name,
        tokenizer=args.tokenizer,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        prefix_len=args.prefix_len,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        timeout_s=args.timeout,
        progress=not args.no_progress,
        api_key=args.api_key,
        save_detailed=args.save_detailed,
    )
    result = asyncio.run(run_benchmark(config))
    print(format_report(result))
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(result.to_json())
    return 0 if result.completed else 1
