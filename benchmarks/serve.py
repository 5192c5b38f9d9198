"""`sluice bench serve`: load-test any OpenAI-compatible server, in the spirit of `vllm bench serve`.

Random-word prompts of about `input_len` tokens are sent at a Poisson `request_rate`
(inf: all at once), at most `max_concurrency` in flight, each streaming up to
`output_len` tokens. Per request it records TTFT, inter-token latencies and
end-to-end latency from the SSE stream (httpx, not the openai package, so any
compatible server works); the report aggregates them plus goodput under SLOs.
Importable: `await run_benchmark(BenchConfig(...)) -> BenchResult`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx
from tqdm import tqdm

from benchmarks.words import WORDS


@dataclass(frozen=True)
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first model the server lists
    endpoint: Literal["chat", "completions"] = "chat"
    num_prompts: int = 100
    input_len: int = 128
    output_len: int = 128
    request_rate: float = math.inf  # requests/s, Poisson arrivals; inf sends all at once
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = False
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    timeout_s: float = 600.0
    progress: bool = True
    api_key: str | None = None


@dataclass
class RequestRecord:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


@dataclass(frozen=True)
class Stats:
    mean: float
    p50: float
    p90: float
    p99: float

    @staticmethod
    def of(values_s: list[float]) -> Stats:
        """Stats in milliseconds."""
        ms = sorted(v * 1000.0 for v in values_s)
        if not ms:
            return Stats(0.0, 0.0, 0.0, 0.0)
        return Stats(sum(ms) / len(ms), _percentile(ms, 50), _percentile(ms, 90), _percentile(ms, 99))


@dataclass(frozen=True)
class BenchResult:
    model: str
    endpoint: str
    duration_s: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # req/s
    output_throughput: float  # tok/s
    total_token_throughput: float  # tok/s
    goodput: float | None  # req/s meeting every SLO given; None without SLOs
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2e_ms: Stats
    errors: list[str]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _percentile(sorted_values: list[float], q: float) -> float:
    pos = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _prompt(rng: random.Random, length: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, length)))


def _body(config: BenchConfig, model: str, prompt: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": config.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _delta_text(event: dict[str, Any]) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return str(choice["delta"].get("content") or "")
    return str(choice.get("text") or "")


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> RequestRecord:
    record = RequestRecord()
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    record.error = str(event["error"].get("message", "stream error"))
                    return record
                if event.get("usage"):
                    record.output_tokens = int(event["usage"]["completion_tokens"])
                    record.prompt_tokens = int(event["usage"]["prompt_tokens"])
                if _delta_text(event):
                    now = time.perf_counter()
                    if chunks == 0:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last, chunks = now, chunks + 1
        record.e2e_s = time.perf_counter() - start
        record.output_tokens = record.output_tokens or chunks
        record.ok = True
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record


async def _first_model(client: httpx.AsyncClient, base_url: str) -> str:
    response = await client.get(f"{base_url}/v1/models")
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


async def run_benchmark(config: BenchConfig) -> BenchResult:
    base = config.base_url.rstrip("/")
    url = f"{base}/v1/chat/completions" if config.endpoint == "chat" else f"{base}/v1/completions"
    rng = random.Random(config.seed)
    headers = {"authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.max_concurrency or config.num_prompts or 1)
    async with httpx.AsyncClient(timeout=config.timeout_s, headers=headers, limits=limits) as client:
        model = config.model or await _first_model(client, base)
        bodies = [_body(config, model, _prompt(rng, config.input_len)) for _ in range(config.num_prompts)]
        gate = asyncio.Semaphore(config.max_concurrency or max(1, config.num_prompts))
        bar = tqdm(total=config.num_prompts, disable=not config.progress, desc="requests")

        async def limited(body: dict[str, Any]) -> RequestRecord:
            async with gate:
                record = await _one(client, url, body)
            bar.update(1)
            return record

        start = time.perf_counter()
        tasks = []
        for body in bodies:
            tasks.append(asyncio.create_task(limited(body)))
            if not math.isinf(config.request_rate) and config.request_rate > 0:
                await asyncio.sleep(rng.expovariate(config.request_rate))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return _summarize(config, model, records, duration)


def _summarize(config: BenchConfig, model: str, records: list[RequestRecord], duration: float) -> BenchResult:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    goodput = None
    if config.slo_ttft_ms is not None or config.slo_tpot_ms is not None:
        good = [
            r
            for r in ok
            if (config.slo_ttft_ms is None or r.ttft_s * 1000 <= config.slo_ttft_ms)
            and (config.slo_tpot_ms is None or r.tpot_s * 1000 <= config.slo_tpot_ms)
        ]
        goodput = len(good) / duration if duration > 0 else 0.0
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    return BenchResult(
        model=model,
        endpoint=config.endpoint,
        duration_s=duration,
        completed=len(ok),
        failed=len(records) - len(ok),
        total_input_tokens=in_tokens,
        total_output_tokens=out_tokens,
        request_throughput=per_s(len(ok)),
        output_throughput=per_s(out_tokens),
        total_token_throughput=per_s(in_tokens + out_tokens),
        goodput=goodput,
        ttft_ms=Stats.of([r.ttft_s for r in ok]),
        tpot_ms=Stats.of([r.tpot_s for r in ok if r.output_tokens > 1]),
        itl_ms=Stats.of([x for r in ok for x in r.itl_s]),
        e2e_ms=Stats.of([r.e2e_s for r in ok]),
        errors=sorted({r.error for r in records if not r.ok})[:10],
    )


def format_report(result: BenchResult) -> str:
    lines = [
        f"{' Serving Benchmark Result ':=^60}",
        f"{'Model:':<40}{result.model}",
        f"{'Successful requests:':<40}{result.completed}",
        f"{'Failed requests:':<40}{result.failed}",
        f"{'Benchmark duration (s):':<40}{result.duration_s:.2f}",
        f"{'Total input tokens:':<40}{result.total_input_tokens}",
        f"{'Total generated tokens:':<40}{result.total_output_tokens}",
        f"{'Request throughput (req/s):':<40}{result.request_throughput:.2f}",
        f"{'Output token throughput (tok/s):':<40}{result.output_throughput:.2f}",
        f"{'Total token throughput (tok/s):':<40}{result.total_token_throughput:.2f}",
    ]
    if result.goodput is not None:
        lines.append(f"{'Request goodput (req/s):':<40}{result.goodput:.2f}")
    for name, stats in (
        ("TTFT", result.ttft_ms),
        ("TPOT", result.tpot_ms),
        ("ITL", result.itl_ms),
        ("E2E latency", result.e2e_ms),
    ):
        lines.append(f"{' ' + name + ' (ms) ':-^60}")
        for key in ("mean", "p50", "p90", "p99"):
            lines.append(f"{key.capitalize() + ' ' + name + ' (ms):':<40}{getattr(stats, key):.2f}")
    for error in result.errors:
        lines.append(f"error: {error}")
    lines.append("=" * 60)
    return "\n".join(lines)


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="benchmark an OpenAI-compatible server",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = BenchConfig()
    p.add_argument("--base-url", default=d.base_url, help="server root, without /v1")
    p.add_argument("--model", default=None, help="model id; default: the first from /v1/models")
    p.add_argument("--endpoint", choices=["chat", "completions"], default=d.endpoint, help="API to drive")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts, help="requests to send")
    p.add_argument("--input-len", type=int, default=d.input_len, help="approximate prompt length in tokens")
    p.add_argument("--output-len", type=int, default=d.output_len, help="max_tokens of each request")
    p.add_argument("--ignore-eos", action="store_true", help="ask the server to generate exactly output-len")
    p.add_argument(
        "--request-rate", type=float, default=d.request_rate, help="req/s, Poisson; inf = all at once"
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of prompts and arrival times")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT SLO for goodput")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT SLO for goodput")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="per-request timeout in seconds")
    p.add_argument("--api-key", default=None, help="bearer token, if the server needs one")
    p.add_argument("--json-out", default=None, help="also write the result as JSON to this path")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    config = BenchConfig(
        base_url=args.base_url,
        model=args.model,
        endpoint=args.endpoint,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        timeout_s=args.timeout,
        progress=not args.no_progress,
        api_key=args.api_key,
    )
    result = asyncio.run(run_benchmark(config))
    print(format_report(result))
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(result.to_json())
    return 0 if result.completed else 1
