"""Autoscaling signals and scale from zero through a real `sluice serve --driver synthetic`: the
desired-workers figure rises under a real load and falls back when it is gone; requests sent before any
worker is ready are held and served once one is, and those beyond the hold's bound get 503 +
Retry-After."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import httpx

from benchmarks.server_process import ServerProcess
from tests.polling import wait_until

HANG_S = 60.0  # deadlines only catch hangs


def metric(text: str, name: str, labels: str = "") -> float:
    """One sample of a Prometheus text exposition, by name and exact label set."""
    pattern = "^" + re.escape(name) + (re.escape("{" + labels + "}") if labels else "") + r" (\S+)$"
    match = re.search(pattern, text, re.MULTILINE)
    assert match is not None, f"{name}{{{labels}}} not exported"
    return float(match.group(1))


def complete(base_url: str, max_tokens: int) -> httpx.Response:
    body = {"model": "synthetic", "prompt": "how many workers now", "max_tokens": max_tokens}
    return httpx.post(f"{base_url}/v1/completions", json=body, timeout=HANG_S * 2)


def poll(until: Callable[[], bool], what: str) -> None:
    wait_until(until, what, HANG_S, interval_s=0.1)


def test_desired_workers_rises_with_load_and_falls_when_it_is_gone() -> None:
    # 4 slots decoding 50 tokens/s each: 16 requests of 60 tokens are 4 waves, ~1.2 s each.
    options = ["--driver", "synthetic", "--max-num-seqs", "4", "--max-waiting", "64",
               "--synthetic-tokens-per-second", "50", "--synthetic-ttft-ms", "5"]
    with ServerProcess(options, startup_timeout_s=HANG_S) as server, ThreadPoolExecutor(16) as pool:
        idle = httpx.get(f"{server.base_url}/admin/nodes", timeout=HANG_S).json()["scaling"]
        assert (idle["desired_workers"], idle["ready_workers"], idle["driver"]) == (1, 1, "idle")
        calls = [pool.submit(complete, server.base_url, 60) for _ in range(16)]
        peak: dict[str, object] = {}
        seen_waiting = 0.0
        while not all(c.done() for c in calls):
            signal = httpx.get(f"{server.base_url}/admin/nodes", timeout=HANG_S).json()["scaling"]
            if signal["desired_workers"] > peak.get("desired_workers", 0):  # type: ignore[operator]
                peak = signal
            text = httpx.get(f"{server.base_url}/metrics", timeout=HANG_S).text
            seen_waiting = max(seen_waiting, metric(text, "vllm:num_requests_waiting", 'model_name="synthetic"'))
            time.sleep(0.1)
        assert all(c.result().status_code == 200 for c in calls)
        # 12 queued behind 4 busy slots: every slot taken (occupancy 1 / 0.9) or the queued work's wait.
        assert peak["desired_workers"] >= 2, peak  # type: ignore[operator]
        assert peak["driver"] in ("queue_wait", "occupancy"), peak
        assert seen_waiting >= 1

        def back_to_one() -> bool:
            text = httpx.get(f"{server.base_url}/metrics", timeout=HANG_S).text
            return metric(text, "sluice_desired_workers") == 1

        poll(back_to_one, "the desired workers to fall back to 1")
        text = httpx.get(f"{server.base_url}/metrics", timeout=HANG_S).text
        assert metric(text, "vllm:num_requests_running", 'model_name="synthetic"') == 0
        assert metric(text, "sluice_ready_workers") == 1


def test_requests_are_held_until_a_worker_is_ready_and_beyond_the_bound_get_503() -> None:
    # The engine takes 12 s to come up (a cold start); 3 standard requests may wait for it.
    options = ["--driver", "synthetic", "--synthetic-start-delay", "12", "--synthetic-tokens-per-second", "200"]
    env = {"SLUICE_COLD_HOLD_MAX": "3,3,3", "SLUICE_COLD_HOLD_TIMEOUT_S": "120", "SLUICE_SCALING_MIN_WORKERS": "0"}
    with ServerProcess(options, startup_timeout_s=HANG_S, env=env, ready_path="/healthz") as server, \
            ThreadPoolExecutor(3) as pool:
        base = server.base_url
        assert httpx.get(f"{base}/readyz", timeout=HANG_S).status_code == 503
        held: list[Future[httpx.Response]] = [pool.submit(complete, base, 8) for _ in range(3)]

        def all_held() -> bool:
            text = httpx.get(f"{base}/metrics", timeout=HANG_S).text
            return metric(text, "sluice_requests_held", 'priority="1"') == 3

        poll(all_held, "3 requests held")
        text = httpx.get(f"{base}/metrics", timeout=HANG_S).text
        assert metric(text, "sluice_activation") == 1
        assert metric(text, "sluice_desired_workers") == 1
        assert metric(text, "vllm:num_requests_waiting", 'model_name="synthetic"') == 3
        assert httpx.get(f"{base}/admin/nodes", timeout=HANG_S).json()["scaling"]["driver"] == "activation"

        beyond = complete(base, 8)  # the 4th of its tier while no worker is ready
        assert beyond.status_code == 503
        assert int(beyond.headers["retry-after"]) >= 1
        assert beyond.json()["error"]["type"] == "overloaded_error"
        assert not any(f.done() for f in held)  # refused at once, the held ones still wait

        for f in held:
            r = f.result(timeout=HANG_S * 2)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 8
        assert httpx.get(f"{base}/readyz", timeout=HANG_S).status_code == 200
        text = httpx.get(f"{base}/metrics", timeout=HANG_S).text
        assert metric(text, "sluice_cold_start_requests_total", 'outcome="served",priority="1"') == 3
        assert metric(text, "sluice_cold_start_requests_total", 'outcome="hold_full",priority="1"') == 1
        assert metric(text, "sluice_requests_held", 'priority="1"') == 0
        assert metric(text, "sluice_activation") == 0
        assert complete(base, 4).status_code == 200  # ready now: straight through
