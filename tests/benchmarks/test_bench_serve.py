"""`sluice bench serve`: vLLM's prompt construction and metric definitions, checked on tiny runs against
a synthetic server (structure and consistency only, never speed)."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import subprocess
from pathlib import Path
from typing import Any

import pytest
from gateway_server import SLUICE, Server

from benchmarks.serve import BenchConfig, arrival_times, build_prompts, run_benchmark
from benchmarks.serve_metrics import percentile

OUTPUT_LEN = 8


def check_definitions(result: dict[str, Any], endpoint: str) -> None:
    """The figures of a 4-prompt run of OUTPUT_LEN tokens each, against vLLM's definitions."""
    assert (result["completed"], result["failed"], result["failed_by_status"]) == (4, 0, {})
    requests = result["requests"]
    assert len(requests) == 4 and all(r["ok"] and r["status"] == 200 for r in requests)

    for r in requests:
        assert r["output_tokens"] == OUTPUT_LEN  # the usage the server reports (ignore_eos)
        assert r["prompt_tokens"] > 0
        assert 0 < r["ttft_ms"] <= r["e2el_ms"]
        # E2EL ends at the last chunk, so the first chunk plus every gap after it is the whole request.
        assert r["ttft_ms"] + sum(r["itl_ms"]) == pytest.approx(r["e2el_ms"])
        assert r["tpot_ms"] == pytest.approx((r["e2el_ms"] - r["ttft_ms"]) / (OUTPUT_LEN - 1))
        # Every chunk with choices counts: one a token here, and chat's role chunk before them.
        assert len(r["itl_ms"]) >= OUTPUT_LEN - 1 + (endpoint == "chat")

    def check(stats: dict[str, float], values: list[float]) -> None:
        ordered = sorted(values)
        assert stats["mean"] == pytest.approx(statistics.fmean(values))
        assert stats["p50"] == pytest.approx(percentile(ordered, 50))
        assert stats["p99"] == pytest.approx(percentile(ordered, 99))
        assert stats["p50"] <= stats["p90"] <= stats["p99"] <= max(values) + 1e-9

    check(result["ttft_ms"], [r["ttft_ms"] for r in requests])
    check(result["tpot_ms"], [r["tpot_ms"] for r in requests])
    check(result["itl_ms"], [x for r in requests for x in r["itl_ms"]])
    check(result["e2e_ms"], [r["e2el_ms"] for r in requests])
    assert result["total_output_tokens"] == 4 * OUTPUT_LEN
    assert result["total_input_tokens"] == sum(r["prompt_tokens"] for r in requests)
    duration = result["duration_s"]
    assert result["output_throughput"] == pytest.approx(4 * OUTPUT_LEN / duration)
    assert result["request_throughput"] == pytest.approx(4 / duration)


def test_cli_figures_follow_their_definitions(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [SLUICE, "bench", "serve", "--base-url", server.base_url, "--num-prompts", "4", "--input-len", "16",
         "--output-len", str(OUTPUT_LEN), "--ignore-eos", "--request-rate", "inf", "--max-concurrency", "2",
         "--seed", "3", "--slo-ttft-ms", "60000", "--save-detailed", "--json-out", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Serving Benchmark Result" in proc.stdout and "Median TPOT (ms):" in proc.stdout
    result = json.loads(out.read_text())
    assert result["endpoint"] == "completions"  # vLLM's client's default too
    check_definitions(result, "completions")
    assert result["goodput"] == pytest.approx(result["request_throughput"])  # a 60 s TTFT SLO: all good


def test_chat_figures_follow_their_definitions(server: Server) -> None:
    config = BenchConfig(
        base_url=server.base_url, endpoint="chat", num_prompts=4, input_len=16, output_len=OUTPUT_LEN,
        ignore_eos=True, request_rate=200.0, seed=5, progress=False, save_detailed=True,
    )
    result = asyncio.run(run_benchmark(config))
    check_definitions(json.loads(result.to_json()), "chat")


def test_failures_counted_by_status(slow_server: Server) -> None:
    config = BenchConfig(
        base_url=slow_server.base_url, dataset_name="words", num_prompts=8, input_len=4, output_len=10,
        progress=False,
    )
    result = asyncio.run(run_benchmark(config))
    # All 8 at once against 2 running + 2 waiting slots: 4 are shed with 503.
    assert (result.completed, result.failed, result.failed_by_status) == (4, 4, {"503": 4})
    assert any("503" in e for e in result.errors)
    assert result.total_output_tokens == 4 * 10 and result.goodput is None


def test_random_prompts_are_vllms_construction() -> None:
    config = BenchConfig(num_prompts=16, input_len=40, output_len=20, range_ratio=0.5, prefix_len=6, seed=7)
    prompts, tokenizer = build_prompts(config)
    assert tokenizer is not None and tokenizer.num_special_tokens_to_add == 0  # SmolLM2 adds no BOS
    again, _ = build_prompts(config)
    assert prompts == again  # one seed, one set of prompts
    other, _ = build_prompts(BenchConfig(**{**config.__dict__, "seed": 8}))
    assert [p.text for p in other] != [p.text for p in prompts]
    for p in prompts:
        assert 6 + 20 <= p.prompt_len <= 6 + 60  # prefix + [40 * 0.5, 40 * 1.5]
        assert 10 <= p.output_len <= 30
        assert len(tokenizer.encode(p.text)) == p.prompt_len  # decoded, re-encoded and fitted
    assert len({p.prompt_len for p in prompts}) > 1 and len({p.output_len for p in prompts}) > 1
    words, _ = build_prompts(BenchConfig(dataset_name="words", num_prompts=3, input_len=12, seed=1))
    assert [len(p.text.split()) for p in words] == [p.prompt_len for p in words] == [12, 12, 12]


def test_arrivals_at_the_requested_rate() -> None:
    assert arrival_times(5, float("inf"), 1.0, random.Random(0)) == [0.0] * 5
    times = arrival_times(50, 10.0, 1.0, random.Random(0))
    assert times == sorted(times) and times[0] > 0
    assert times[-1] == pytest.approx(50 / 10.0)  # scaled so the rate holds whatever the seed
    assert times == arrival_times(50, 10.0, 1.0, random.Random(0))


def test_a_connection_broken_mid_stream_says_how_far_the_stream_got() -> None:
    """A stand-in that answers one SSE chunk, then resets the connection: a transport error whose detail
    says the status and the chunks received (and the exception under httpx's, whose message is often empty)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        chunk = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.transport.abort()  # RST, not a clean end of the chunked body

    async def bench() -> Any:
        stand_in = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = stand_in.sockets[0].getsockname()[1]
        config = BenchConfig(base_url=f"http://127.0.0.1:{port}", model="m", dataset_name="words", num_prompts=1,
                             input_len=4, output_len=4, progress=False)
        async with stand_in:
            return await run_benchmark(config)

    result = asyncio.run(bench())
    assert (result.completed, result.failed_by_status) == (0, {"transport error": 1})
    assert result.errors[0].endswith("status 200, after 1 chunks"), result.errors
