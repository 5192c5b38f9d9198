"""`sluice bench engine` (`benchmarks.engine`) runs end to end at --quick sizes and reports every figure (no timing assertions)."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from benchmarks import engine as bench


def test_quick_bench_reports_every_scenario(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    threads = torch.get_num_threads()
    try:
        # One thread: on a busy 2-core host two OpenMP threads stall each other and the run takes minutes.
        assert bench.main(["--quick", "--skip-hf", "--threads", "1", "--json-out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)  # the bench sets it process-wide; later tests keep theirs
    report = json.loads(out.read_text())
    assert report["chat"]["ok"] and "Paris" in report["chat"]["answer"]
    scenarios = {s["id"]: s for s in report["scenarios"]}
    assert sorted(scenarios) == [1, 2, 3, 4]
    for s in scenarios.values():
        assert s["ours"] > 0, s
        assert s["hf"] is None and s["ratio"] is None  # --skip-hf
    assert scenarios[4]["unit"] == "s"
    for sid in (1, 2, 3):
        assert scenarios[sid]["unit"] == "tok/s"
        details = scenarios[sid]["details"]
        assert details["output_tokens"] == details["requested_output_tokens"] > 0
