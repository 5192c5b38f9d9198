"""The fleet simulator: exact against a first-come-first-served queue on the same sample path, within a
few percent of the M/M/c closed form (Erlang C), and a (short) day of traffic through every policy,
down to the PNGs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from simulator.cli import main, mmc_run
from simulator.fleet import FleetConfig, simulate
from simulator.policies import Fixed
from simulator.profile import CostProfile, available_profiles
from simulator.queueing import erlang_c, fcfs_waits, mmc_mean_wait
from simulator.traffic import Arrivals


def test_erlang_c_closed_form() -> None:
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: P(wait) = rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert mmc_mean_wait(1.0, 2.0, 1) == pytest.approx(0.5)  # rho / (mu - lambda)
    assert mmc_mean_wait(3.0, 1.0, 3) == math.inf


def test_the_simulator_reproduces_mmc_waiting_time() -> None:
    simulated, closed, waits, arrivals = mmc_run(servers=2, load=0.5, requests=150_000, seed=1)
    assert simulated == pytest.approx(closed, rel=0.05)
    # The same sample path through the exact FCFS recursion: the fleet model is that queue, to the float.
    services = ((arrivals.output - 1) * 0.001).tolist()
    exact = fcfs_waits(arrivals.time.tolist(), services, 2)
    assert np.allclose(waits, exact, atol=1e-6)


def test_a_worker_batches_and_prefill_pauses_its_decodes() -> None:
    """Two requests on one worker: the second's prefill delays the first's remaining decode steps."""
    profile = CostProfile("toy", step_base_s=0.01, per_seq_s=0.0, per_context_token_s=0.0,
                          prefill_tokens_per_s=1000.0, max_num_seqs=8, cold_start_s=0.0)
    arrivals = Arrivals(np.array([0.0, 0.105]), np.array([1, 1]), np.array([100, 200]), np.array([21, 11]))
    result = simulate(profile, FleetConfig(initial_workers=1), Fixed(1), arrivals)
    assert result.ttft[0] == pytest.approx(0.1)  # 100 tokens at 1,000/s
    assert result.ttft[1] == pytest.approx(0.2)  # 200 tokens, from its arrival at 0.105
    # Both decode from 0.305 in 10 ms steps: the first's 20 steps end at 0.505, not at 0.3 (paused).
    assert result.finish[1] == pytest.approx(0.405)
    assert result.finish[0] == pytest.approx(0.505)
    assert not result.shed.any()


def test_profiles_load() -> None:
    assert {"cpu-smollm2-135m", "h100-llama70b-tp8"} <= set(available_profiles())
    for name in available_profiles():
        p = CostProfile.load(name)
        assert p.decode_step_s(64, 64 * 1000) > p.step_base_s > 0
        assert p.prefill_tokens_per_s > 0 and p.cold_start_s > 0


def test_a_day_through_every_policy_writes_the_summary_and_plots(tmp_path: Path) -> None:
    # A slow worker (~1 request/s of short requests) keeps the day small: ~40,000 requests.
    slow = CostProfile("slow", step_base_s=0.02, per_seq_s=0.001, per_context_token_s=0.0,
                       prefill_tokens_per_s=400.0, prefill_base_s=0.01, max_num_seqs=16, cold_start_s=60.0)
    (tmp_path / "slow.json").write_text(json.dumps(slow.to_json()))
    out = tmp_path / "sim"
    assert main(["day", "--profile", str(tmp_path / "slow.json"), "--peak-rps", "1", "--bursts", "2",
                 "--prompt-median", "200", "--output-median", "50", "--out", str(out)]) == 0
    report = json.loads((out / "summary.json").read_text())
    names = [p["policy"] for p in report["policies"]]
    assert names[1:] == ["reactive", "reactive+forecast"] and names[0].startswith("fixed-")
    for policy in report["policies"]:
        assert policy["worker_hours"] > 0
        assert [t["name"] for t in policy["tiers"]] == ["premium", "standard", "batch"]
        assert all(0 <= t["attainment"] <= 1 for t in policy["tiers"])
    fixed, reactive = report["policies"][0], report["policies"][1]
    assert reactive["worker_hours"] < fixed["worker_hours"]  # the night is cheaper when it scales down
    for png in ("fleet.png", "attainment.png", "summary.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
