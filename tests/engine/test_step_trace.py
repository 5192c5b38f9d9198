"""What a step trace says about the inter-token tail, on traces whose answer is known by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine_native.step_trace import (
    StepRecord,
    StepTraceWriter,
    delivery,
    read_trace,
    summarize,
    weighted_quantile,
)

SLUICE = str(Path(sys.executable).parent / "sluice")


def step(interval_s: float, decodes: int, prefill_tokens: int = 0, admitted: int = 0, end: float = 0.0,
         first_gaps: int = 0) -> StepRecord:
    return StepRecord(end=end, interval_s=interval_s, forward_s=interval_s * 0.9, decodes=decodes,
                      prefill_tokens=prefill_tokens, prefill_seqs=admitted, admitted=admitted, cached_tokens=0,
                      sampled=decodes + admitted, running=decodes + admitted, waiting=0, preempted=0,
                      first_gaps=first_gaps)


def test_weighted_quantile_counts_each_value_by_its_weight() -> None:
    assert weighted_quantile([1.0, 2.0, 3.0], [1, 1, 1], 0.5) == 2.0
    assert weighted_quantile([1.0, 9.0], [99, 1], 0.99) == 1.0
    assert weighted_quantile([1.0, 9.0], [98, 2], 0.99) == 9.0
    assert weighted_quantile([5.0, 1.0], [0, 3], 1.0) == 1.0  # weight 0: no stream saw it
    assert weighted_quantile([], [], 0.5) == 0.0


def test_the_tail_is_the_prefill_steps_that_held_the_decodes() -> None:
    # 100 decode steps of 32 streams at 50 ms, then two 500 ms steps that prefilled 1,024 prompt tokens
    # beside 20 decodes each: 40 of 3,240 gaps (1.2%) are 500 ms, so the p99 is one of them.
    trace = [step(0.05, 32) for _ in range(100)] + [step(0.5, 20, 1024, admitted=8) for _ in range(2)]
    s = summarize(trace)
    assert (s.steps, s.decode_gaps) == (102, 3240)
    assert (s.gap_p50_s, s.gap_p99_s) == (0.05, 0.5)
    assert s.tail_kinds == {"prefill+decode": 40}
    assert (s.tail_mean_prefill_tokens, s.tail_mean_admitted) == (1024, 8)
    by_kind = {k.kind: k for k in s.kinds}
    assert by_kind["decode"].steps == 100 and by_kind["prefill+decode"].mean_prefill_tokens == 1024
    assert by_kind["decode"].loop_share == pytest.approx(0.1)
    # with only 20 such gaps (one step), the p99 is a decode step's
    assert summarize(trace[:-1]).gap_p99_s == 0.05
    assert s.tail_first_gaps == 0  # those 40 streams had decoded before


def test_the_tail_says_when_it_is_a_burst_split_across_two_steps() -> None:
    # Waves of 8 requests (a closed loop of 8 whose requests end together): 6 reach the engine in time for
    # one step and are prefilled there; 2 arrive during it and are prefilled in the next, beside the 6's first
    # decodes, whose first inter-token gap that step is (200 ms). 6 of every wave's 8 x 63 gaps: p99.
    wave = [step(0.5, 0, 432, admitted=6), step(0.2, 6, 144, admitted=2, first_gaps=6)]
    wave += [step(0.02, 8) for _ in range(62)]
    s = summarize(wave * 7)
    assert s.gap_p99_s == 0.2
    assert s.tail_kinds == {"prefill+decode": 42} and s.tail_first_gaps == 42
    # with the first gaps of one stream a wave, the tail is the decode steps again
    lone = [step(0.1, 0, 72, admitted=1), step(0.5, 1, 504, admitted=7, first_gaps=1)]
    lone += [step(0.02, 8) for _ in range(62)]
    assert summarize(lone * 7).gap_p99_s == 0.02


def test_written_traces_read_back_and_summarize_from_the_cli(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "traces" / "node-0.jsonl"
    writer = StepTraceWriter(path)
    records = [step(0.05, 4, end=float(i)) for i in range(10)] + [step(0.4, 4, 300, admitted=2, end=10.0)]
    for r in records:
        writer.write(r)
    writer.close()
    assert read_trace(path) == records
    out = subprocess.run([SLUICE, "bench", "steps", str(path), "--since", "5", "--json-out", str(tmp_path / "s.json")],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "6 steps" in out and "prefill+decode 4" in out, out  # steps ending at 5..10; the 0.4 s step's 4 gaps
    assert (tmp_path / "s.json").exists()


def test_a_trace_that_cannot_be_written_stops_without_stopping_the_engine(caplog) -> None:  # type: ignore[no-untyped-def]
    writer = StepTraceWriter("/dev/full")  # every write to it fails with ENOSPC, as on a full disk
    writer.write(step(0.05, 4))
    writer.write(step(0.05, 4))  # no second failure: the trace has stopped
    writer.close()
    assert [r.getMessage() for r in caplog.records if "step trace" in r.getMessage()] == [
        "step trace /dev/full stopped: [Errno 28] No space left on device"
    ]


def test_delivery_sets_each_client_token_against_the_step_before_it() -> None:
    steps = [step(0.05, 2, end=100.0 + 0.05 * i) for i in range(20)]  # steps end at 100.00, 100.05, ..., 100.95
    arrivals = [100.0 + 0.05 * i + 0.002 for i in range(20)] + [100.5 + 0.03, 99.0]  # 2 ms late; one 30; one early
    d = delivery(steps, arrivals)
    assert (d.tokens, d.before_first_step) == (21, 1)
    assert d.p50_s == pytest.approx(0.002) and d.max_s == pytest.approx(0.03)


def test_the_cli_reads_a_detailed_vllm_result_onto_the_trace(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "node-0.jsonl"
    writer = StepTraceWriter(path)
    for i in range(40):
        writer.write(step(0.05, 2, end=1_000.0 + 0.05 * i))
    writer.close()
    # Two requests on the client's monotonic clock (offset 900 s from the wall): first tokens 3 ms after
    # the step at 1,000.10, then one token a step, each 3 ms after its step but one 40 ms late.
    result = {"start_times": [100.0, 100.0], "ttfts": [0.103, 0.103],
              "itls": [[0.05] * 10, [0.05] * 4 + [0.087] + [0.013] + [0.05] * 4]}
    client = tmp_path / "client.json"

    def steps(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([SLUICE, "bench", "steps", str(path), "--client", str(client), *extra],
                              capture_output=True, text=True, timeout=120, check=False)

    client.write_text(json.dumps(result))
    done = steps("--client-clock-offset", "900")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "22 tokens" in out and "p50 3.0 ms" in out and "max 40.0" in out, out
    client.write_text(json.dumps({"itls": []}))  # a result saved without --save-detailed
    failed = steps()
    assert failed.returncode == 2 and "--save-detailed" in failed.stdout
    for bad in ("[1, 2]", "not json"):
        client.write_text(bad)
        failed = steps()
        assert failed.returncode == 2 and str(client) in failed.stdout and "Traceback" not in failed.stderr
