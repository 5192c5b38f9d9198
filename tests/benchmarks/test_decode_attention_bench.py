"""`sluice bench attention` runs at small sizes, reports both layouts, and finds the same output bits in both;
where the kernels (or their bf16 cache) are not built for the CPU it refuses with exit code 2 and says why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import cli
from engine_native.kernels import cpu_kernels


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_both_layouts_are_measured_and_agree(tmp_path: Path, dtype: str) -> None:
    kernels = cpu_kernels()
    out = tmp_path / "attention.json"
    args = cli.build_parser().parse_args(
        ["attention", "--sequences", "5", "--context", "70", "--layers", "3", "--rounds", "2", "--pool-blocks", "64",
         "--dtype", dtype, "--json-out", str(out)])
    if kernels is None:
        assert args.func(args) == 2 and not out.exists()
        return
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert report["same_results"] is True
    assert set(report["layouts"]) == {"scattered", "contiguous"}
    for layout in report["layouts"].values():
        assert len(layout["rounds_ms"]) == 2 and layout["median_ms"] > 0
    assert report["kv_bytes"] > 0
