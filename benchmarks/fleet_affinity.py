"""`sluice bench fleet-affinity`: what prefix-affinity routing buys over round-robin.

`tenants` distinct ~1,000-token system prompts (one per tenant: the router hashes the first KV blocks,
which differ from the first word) over `workers` native `sluice worker` processes with the bundled
model, each with a KV pool that holds only some of the prompts. The same request sequence (tenants
in a seeded shuffle, `requests_per_tenant` each, sequential) goes through a fresh fleet per policy; printed:
the workers' prefix-cache hit rate (cached prompt tokens / prompt tokens looked up, weighted by the
streams each served) and TTFT p50 of both, against the target hit rate >= 0.85 with affinity.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from benchmarks.config_options import add_config_command, print_load_average, verdict
from benchmarks.pressure import stream_chat
from benchmarks.server_process import ServerProcess
from benchmarks.words import WORDS
from benchmarks.worker_process import WorkerProcess, worker_processes

TARGET_HIT_RATE = 0.85


@dataclass(frozen=True)
class AffinityBenchConfig:
    workers: int = 2
    tenants: int = 4
    requests_per_tenant: int = 10
    system_words: int = 970  # ~1,000 tokens
    max_tokens: int = 4
    kv_cache_memory: str = "64MiB"  # bf16 SmolLM2-135M: 182 blocks, ~2.8 of the 1,000-token prompts per worker
    num_threads: int = 2


def _system_prompts(config: AffinityBenchConfig) -> list[str]:
    prompts = []
    for t in range(config.tenants):
        rng = random.Random(t)
        prompts.append(f"Tenant {t} assistant. Context: " + " ".join(rng.choice(WORDS) for _ in range(config.system_words)))
    return prompts


async def _requests(base: str, config: AffinityBenchConfig) -> list[float]:
    systems = _system_prompts(config)
    ttfts = []
    # Tenants in a shuffled (seeded) order: in a fixed rotation, round-robin over a tenant count that is
    # a multiple of the workers would send each tenant to one worker every time, i.e. be affinity.
    order = [t for t in range(config.tenants) for _ in range(config.requests_per_tenant)]
    random.Random(1).shuffle(order)
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        for i, t in enumerate(order):
            result = await stream_chat(client, {
                "model": "smollm2-135m-instruct", "max_tokens": config.max_tokens, "ignore_eos": True,
                "temperature": 0, "messages": [{"role": "system", "content": systems[t]},
                                               {"role": "user", "content": f"Question {i} of tenant {t}?"}],
            })
            if result["status"] != 200:
                raise RuntimeError(f"request failed: {result}")
            ttfts.append(result["ttft"] * 1000)
    return ttfts


def _hit_rate(base: str, workers: list[WorkerProcess]) -> float:
    nodes = {n["id"]: n for n in httpx.get(f"{base}/admin/nodes", timeout=5).json()["nodes"]}
    served = {w.worker_id: w.served() for w in workers}
    total = sum(served.values())
    return sum(nodes[wid]["prefix_cache_hit_rate"] * n for wid, n in served.items()) / total if total else 0.0


def _measure(config: AffinityBenchConfig, policy: str) -> dict[str, float]:
    native = ["--driver", "native", "--kv-cache-memory", config.kv_cache_memory, "--num-threads",
              str(config.num_threads), "--max-model-len", "2048"]
    with worker_processes(config.workers, *native, startup_timeout_s=300) as workers, \
            ServerProcess(["--driver", "fleet", "--workers", ",".join(w.url for w in workers), "--fleet-policy",
                           policy, "--no-load-shedding"], startup_timeout_s=120) as server:
        ttfts = asyncio.run(_requests(server.base_url, config))
        # The heartbeat's hit rate lags up to one poll (0.5 s) behind the last request.
        asyncio.run(asyncio.sleep(1.5))
        hit = _hit_rate(server.base_url, workers)
    return {"hit_rate": hit, "ttft_p50_ms": statistics.median(ttfts), "requests": len(ttfts)}


def run(config: AffinityBenchConfig) -> dict[str, Any]:
    results = {policy: _measure(config, policy) for policy in ("prefix-affinity", "round-robin")}
    for policy, r in results.items():
        print(f"{policy:<16} prefix-cache hit rate {r['hit_rate']:.3f}  TTFT p50 {r['ttft_p50_ms']:8.1f} ms  "
              f"({r['requests']:.0f} requests)")
    hit = results["prefix-affinity"]["hit_rate"]
    print(f"hit rate with affinity {hit:.3f} (target >= {TARGET_HIT_RATE}) -> "
          f"{verdict(hit >= TARGET_HIT_RATE)}")
    load = print_load_average()
    return {"config": asdict(config), "results": results, "target_hit_rate": TARGET_HIT_RATE,
            "met": hit >= TARGET_HIT_RATE, "load_average": load}


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add_config_command(
        sub, "fleet-affinity", "fleet: prefix-cache hit rate and TTFT, prefix-affinity vs round-robin",
        AffinityBenchConfig(), run, options={
            "workers": "native sluice worker processes",
            "tenants": "distinct system prompts",
            "requests_per_tenant": "requests per tenant",
            "system_words": "words per system prompt",
            "max_tokens": "output tokens per request",
            "kv_cache_memory": "KV pool of each worker",
            "num_threads": "torch threads per worker",
        })
