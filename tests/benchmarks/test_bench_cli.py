"""`sluice bench` is one entry to every benchmark, and the service never imports the benchmarks."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest
from gateway_server import SLUICE

from benchmarks import cli, engine

BENCHMARKS = ["serve", "engine", "gateway", "priority", "prefix", "spike", "sweep", "ratelimit", "tenants",
              "observability", "stall", "steps", "attention"]
PRODUCT_PACKAGES = ["gateway", "drivers", "engine_native", "tenants", "ratelimit", "observability", "web"]
ROOT = Path(__file__).resolve().parents[2]


def test_bench_help_lists_every_benchmark() -> None:
    out = subprocess.run([SLUICE, "bench", "--help"], capture_output=True, text=True, timeout=120, check=True)
    listed = {line.split()[0] for line in out.stdout.splitlines() if line.startswith("    ") and line.split()}
    assert set(BENCHMARKS) <= listed, out.stdout
    top = subprocess.run([SLUICE, "--help"], capture_output=True, text=True, timeout=120, check=True)
    assert "bench" in top.stdout


def test_each_benchmark_has_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    for name in BENCHMARKS:
        with pytest.raises(SystemExit) as exit_:
            if name == "engine":  # parses its own options, handed through unparsed
                engine.build_parser().parse_args(["--help"])
            else:
                cli.build_parser().parse_args([name, "--help"])
        assert exit_.value.code == 0
        assert f"sluice bench {name}" in capsys.readouterr().out, name


def test_product_packages_do_not_import_benchmarks() -> None:
    offenders = []
    for package in PRODUCT_PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "benchmarks"]
    assert offenders == []
