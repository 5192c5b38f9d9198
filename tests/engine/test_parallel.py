"""Tensor parallelism on CPU (gloo): the same greedy tokens as one process, and one death for all.

Every engine here runs real worker processes joined by torch.distributed over TCP. The runs on a
tiny random Llama push the scheduler through continuous batching (requests added mid-run),
chunked prefill and preemption, and count that each happened.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from engine_native.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from engine_native.engine import LLMEngine
from engine_native.errors import EngineDeadError
from engine_native.messages import EngineStats
from engine_native.model.bundled import bundled_model_path
from engine_native.parallel.sharding import HeadLayout
from engine_native.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(4, 2, 2), (9, 3, 2), (9, 3, 3), (4, 1, 2), (8, 8, 3)])
def test_every_head_is_computed_once_and_local_groups_are_uniform(heads: int, kv_heads: int, tp: int) -> None:
    g = heads // kv_heads
    layouts = [HeadLayout.for_rank(heads, kv_heads, tp, r) for r in range(tp)]
    real = [h for layout in layouts for h in layout.q_heads if h is not None]
    assert sorted(real) == list(range(heads))
    for layout in layouts:
        local_g = len(layout.q_heads) // len(layout.kv_heads)
        assert len(layout.q_heads) == local_g * len(layout.kv_heads)
        for slot, h in enumerate(layout.q_heads):  # slot's local KV head is the global KV head of h
            assert h is None or layout.kv_heads[slot // local_g] == h // g


def test_smollm2_kv_heads_replicated_at_tp2() -> None:
    r0, r1 = (HeadLayout.for_rank(9, 3, 2, r) for r in range(2))
    assert (r0.q_heads, r0.kv_heads) == ((0, 1, 2, 3, None, None), (0, 1))
    assert (r1.q_heads, r1.kv_heads) == ((4, 5, None, 6, 7, 8), (1, 2))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    HFLlama(cfg).eval().save_pretrained(path)
    return str(Path(path))


def _config(path: str, tp: int, pp: int = 1, num_blocks: int = 64) -> EngineConfig:
    return EngineConfig(
        model_path=path,
        dtype="float32",
        quantized_max_rows=0,
        num_threads=1,
        cache=CacheConfig(block_size=4, num_blocks=num_blocks, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24, long_prefill_token_threshold=8),
        parallel=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
    )


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run_staggered(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    """Half the prompts at once, the rest one per step while those run (continuous batching)."""
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    for i, p in pending[: len(prompts) // 2]:
        engine.add_request(f"r{i}", p, GREEDY)
    pending = pending[len(prompts) // 2 :]
    while engine.has_unfinished or pending:
        if pending:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, GREEDY)
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        engine.kv_cache.check_integrity()
    return [out[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def tiny_prompts() -> list[list[int]]:
    return [_prompt(n, seed) for seed, n in enumerate([5, 30, 17, 40, 9, 23])]


def _staggered_run(path: str, prompts: list[list[int]], tp: int, pp: int) -> tuple[list[list[int]], EngineStats]:
    engine = LLMEngine(_config(path, tp, pp, num_blocks=24), progress=False)
    try:
        return _run_staggered(engine, prompts), engine.stats()
    finally:
        engine.close()


@pytest.fixture(scope="module")
def tiny_tp1(tiny_llama: str, tiny_prompts: list[list[int]]) -> list[list[int]]:
    tokens, _ = _staggered_run(tiny_llama, tiny_prompts, 1, 1)
    assert all(len(r) == GREEDY.max_tokens for r in tokens)
    return tokens


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)])
def test_greedy_tokens_equal_one_process_under_batching_chunking_and_preemption(
    tiny_llama: str, tiny_prompts: list[list[int]], tiny_tp1: list[list[int]], tp: int, pp: int
) -> None:
    tokens, stats = _staggered_run(tiny_llama, tiny_prompts, tp, pp)
    assert tokens == tiny_tp1
    assert stats.num_prefill_chunks > 0 and stats.num_preemptions > 0
    assert stats.collective_s_total > 0 and stats.forward_s_total > stats.collective_s_total


def _smollm2_greedy(tp: int, pp: int = 1) -> list[list[int]]:
    engine = LLMEngine(_config(bundled_model_path(), tp, pp, num_blocks=64), progress=False)
    try:
        assert engine.tokenizer is not None
        prompts = [engine.tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):")]
        return engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))
    finally:
        engine.close()


@pytest.fixture(scope="module")
def smollm2_tp1() -> list[list[int]]:
    return _smollm2_greedy(1)


# SmolLM2-135M: 9 heads, 3 KV heads. At TP 2 the KV head of the middle group is on both ranks and
# each rank pads a group with zero heads; at TP 3 each rank holds one whole group; PP 2: 15 + 15
# layers. (TP 3 is the slowest: every rank dequantizes the whole embedding.)
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (3, 1), (1, 2)])
def test_bundled_smollm2_greedy_tokens_equal_tp1(smollm2_tp1: list[list[int]], tp: int, pp: int) -> None:
    assert _smollm2_greedy(tp, pp) == smollm2_tp1


@pytest.mark.parametrize("tp", [2, 3])
def test_smollm2_head_geometry_9_heads_3_kv_heads(tmp_path: Path, tp: int) -> None:
    torch.manual_seed(1)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=72, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=128, tie_word_embeddings=True,
    )
    HFLlama(cfg).eval().save_pretrained(tmp_path)
    prompts = [_prompt(n, seed) for seed, n in enumerate([7, 26, 13])]
    results = {}
    for size in (1, tp):
        engine = LLMEngine(_config(str(tmp_path), size), progress=False)
        try:
            results[size] = engine.generate(prompts, GREEDY)
        finally:
            engine.close()
    assert results[tp] == results[1]


async def _stream_until_rank_dies(path: str) -> tuple[int, BaseException | None, bool]:
    from engine_native.client import AsyncEngineClient
    from engine_native.messages import AddRequest, RequestOutput

    client = AsyncEngineClient(_config(path, 2, num_blocks=64), progress=False)
    await client.start(timeout_s=240)
    try:
        stream = client.add(AddRequest(
            request_id="victim", prompt_token_ids=_prompt(8, 1), arrival_time=time.time(),
            sampling_params=SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True),
        ))
        client.set_fault(step_delay_s=0.05)  # slow steps, so that the kill lands mid-stream
        tokens, error = 0, None
        while True:
            item = await asyncio.wait_for(stream.get(), 60)
            if isinstance(item, BaseException):
                error = item
                break
            assert isinstance(item, RequestOutput)
            tokens += len(item.new_token_ids)
            if tokens == 3:
                _kill_worker_of(client.pid)
            if item.finish_reason is not None:
                break
        await asyncio.wait_for(client.wait_dead(), 60)
        return tokens, error, client.alive
    finally:
        await client.shutdown()


async def _kill_rank_while_idle(path: str) -> str:
    from engine_native.client import AsyncEngineClient

    client = AsyncEngineClient(_config(path, 2), progress=False)
    await client.start(timeout_s=240)
    try:
        _kill_worker_of(client.pid)
        return await asyncio.wait_for(client.wait_dead(), 60)
    finally:
        await client.shutdown()


def test_an_idle_engine_is_reported_dead_when_a_rank_dies(tiny_llama: str) -> None:
    assert "rank 1 exited" in asyncio.run(_kill_rank_while_idle(tiny_llama))


def _kill_worker_of(engine_pid: int | None) -> None:
    assert engine_pid is not None
    children = Path(f"/proc/{engine_pid}/task/{engine_pid}/children").read_text().split()
    workers = [int(c) for c in children if b"engine_native.parallel.worker" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(workers) == 1
    os.kill(workers[0], 9)


def test_killing_a_rank_mid_stream_kills_the_engine_and_ends_its_requests_with_an_error(tiny_llama: str) -> None:
    tokens, error, alive = asyncio.run(_stream_until_rank_dies(tiny_llama))
    assert 3 <= tokens < 200
    assert isinstance(error, EngineDeadError), error
    assert not alive


@pytest.fixture
def network_namespace() -> Iterator[tuple[str, str, str, str]]:
    """A network namespace joined to this one by a veth pair: (namespace, our address, our interface,
    its interface). Skips where namespaces cannot be made (not root, no `ip`)."""
    tag = f"{os.getpid() % 100000}"
    ns, ours, theirs = f"sluicetp{tag}", f"vtp{tag}a", f"vtp{tag}b"
    subnet = f"10.213.{os.getpid() % 250}"
    setup = [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", ours, "type", "veth", "peer", "name", theirs],
        ["ip", "link", "set", theirs, "netns", ns],
        ["ip", "addr", "add", f"{subnet}.1/24", "dev", ours],
        ["ip", "link", "set", ours, "up"],
        ["ip", "netns", "exec", ns, "ip", "addr", "add", f"{subnet}.2/24", "dev", theirs],
        ["ip", "netns", "exec", ns, "ip", "link", "set", theirs, "up"],
        ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"],
    ]
    try:
        for cmd in setup:
            if subprocess.run(cmd, capture_output=True, check=False).returncode != 0:
                pytest.skip(f"cannot build a network namespace here ({' '.join(cmd)} failed)")
        yield ns, f"{subnet}.1", ours, theirs
    finally:
        subprocess.run(["ip", "link", "del", ours], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def test_ranks_in_separate_network_namespaces_talk_over_a_veth_link(
    tiny_llama: str, network_namespace: tuple[str, str, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ns, address, ours, theirs = network_namespace
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", ours)  # rank 0 (this process) sends through the veth
    prompts = [_prompt(n, seed) for seed, n in enumerate([6, 19, 11])]
    reference = LLMEngine(_config(tiny_llama, 1), progress=False).generate(prompts, GREEDY)
    parallel = ParallelConfig(
        tensor_parallel_size=2,
        master_addr=address,
        worker_launch_prefix=(("ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={theirs}"),),
    )
    config = dataclasses.replace(_config(tiny_llama, 2), parallel=parallel)
    sent_before = int(Path(f"/sys/class/net/{ours}/statistics/tx_bytes").read_text())
    engine = LLMEngine(config, progress=False)
    try:
        assert engine.generate(prompts, GREEDY) == reference
        collective_bytes = engine.stats().collective_bytes_total
    finally:
        engine.close()
    sent = int(Path(f"/sys/class/net/{ours}/statistics/tx_bytes").read_text()) - sent_before
    # Every element of rank 0's all-reduce input reaches rank 1, so rank 0 sends at least the payload.
    assert sent >= collective_bytes > 0


def test_micro_batches_are_runs_of_whole_sequences_that_keep_every_logits_row() -> None:
    from engine_native.forward_batch import ForwardBatch
    from engine_native.parallel.micro_batch import split_micro_batches

    lens = [30, 1, 1, 20]
    starts = [0, 30, 31, 32]
    batch = ForwardBatch(
        input_ids=torch.arange(52), positions=torch.arange(52), slot_mapping=torch.arange(52),
        query_starts=starts, query_lens=lens, context_lens=[30, 9, 12, 20],
        block_tables=torch.arange(16).view(4, 4), logits_indices=torch.tensor([30, 31, 51]), block_size=16,
    )
    first, second = split_micro_batches(batch, 2)
    assert (first.query_lens, second.query_lens) == ([30], [1, 1, 20])
    assert second.query_starts == [0, 1, 2] and second.block_tables.tolist() == batch.block_tables[1:].tolist()
    assert first.logits_indices.tolist() == [] and second.logits_indices.tolist() == [0, 1, 21]
    assert torch.equal(torch.cat([first.input_ids, second.input_ids]), batch.input_ids)
    assert split_micro_batches(batch, 1) == [batch]
