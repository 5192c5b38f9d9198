"""The SGLang driver against SGLang stand-ins (real HTTP servers in child processes): streaming in
both of SGLang's modes, stop strings, logprobs, abort on disconnect, error mapping, cache-aware
routing with its load guard, failover from a killed server, and KV events with replay."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
from driver_session import with_driver
from standin_process import StandInProcess, expected_ids, standins, text_of

from drivers.base import (
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
)
from drivers.sglang.config import CacheRoutingConfig, SGLangConfig
from drivers.sglang.driver import SGLangDriver
from tests.polling import await_until

pytestmark = pytest.mark.timeout(180)  # a hang fails this module's test, not the whole run
T = TypeVar("T")
PROMPT = [ord(c) for c in "You are a helpful assistant. Answer briefly, in one line. "]  # 58 tokens


def config(servers: list[StandInProcess], **routing: float) -> SGLangConfig:
    events = tuple(s.kv_events for s in servers if s.kv_events)
    replay = tuple(s.kv_replay for s in servers if s.kv_replay)
    return SGLangConfig(servers=tuple(s.url for s in servers), kv_events=events, kv_replay=replay,
                        routing=CacheRoutingConfig(**routing), poll_s=0.2)  # type: ignore[arg-type]


def run(servers: list[StandInProcess], body: Callable[[SGLangDriver], Awaitable[T]], **routing: float) -> T:
    async def when_all_up(driver: SGLangDriver) -> T:
        async def all_up() -> bool:  # start() waits for one server; a busy machine may lag on the others
            health = await driver.health()
            return health.ready and not health.degraded
        await await_until(all_up, "every stand-in polled up")
        return await body(driver)
    return with_driver(config(servers, **routing), when_all_up)


def request(prompt: list[int], max_tokens: int = 12, **fields: object) -> GenerationRequest:
    return GenerationRequest(request_id=f"r{id(prompt)}-{max_tokens}-{len(fields)}", model="standin",
                             prompt_token_ids=prompt, tokenized_prompt=prompt, max_tokens=max_tokens,
                             **fields)  # type: ignore[arg-type]


async def collect(driver: SGLangDriver, req: GenerationRequest) -> list[GenerationChunk]:
    return [chunk async for chunk in driver.generate(req)]


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
def test_streams_text_ids_and_usage_in_both_modes(incremental: bool) -> None:
    mode = ["--incremental-streaming-output"] if incremental else []
    with standins(1, *mode) as servers:
        async def body(driver: SGLangDriver) -> None:
            chunks = await collect(driver, request(PROMPT, 20))
            ids = [t for c in chunks for t in c.token_ids]
            assert ids == expected_ids(PROMPT, 20)
            assert "".join(c.text for c in chunks) == text_of(ids)
            assert len(chunks) == 20  # one event per token, each a delta
            final = chunks[-1]
            assert final.finish_reason is FinishReason.LENGTH
            assert (final.prompt_tokens, final.completion_tokens) == (len(PROMPT), 20)
            assert final.cached_tokens == 0
            again = await collect(driver, request(PROMPT, 4))
            assert again[-1].cached_tokens == 56  # the prompt's whole pages (4 tokens each) were cached
        run(servers, body)


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
def test_stop_string_is_cut_and_never_sent_in_part(incremental: bool) -> None:
    mode = ["--incremental-streaming-output"] if incremental else []
    text = text_of(expected_ids(PROMPT, 30))
    stop = text[9:12]  # three characters the output reaches after streaming its first 9
    with standins(1, *mode) as servers:
        async def body(driver: SGLangDriver) -> None:
            chunks = await collect(driver, request(PROMPT, 30, stop=[stop]))
            assert "".join(c.text for c in chunks) == text[: text.index(stop)]
            assert chunks[-1].finish_reason is FinishReason.STOP
        run(servers, body)


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
def test_logprobs_one_per_token_with_alternatives(incremental: bool) -> None:
    mode = ["--incremental-streaming-output"] if incremental else []
    with standins(1, *mode) as servers:
        async def body(driver: SGLangDriver) -> None:
            chunks = await collect(driver, request(PROMPT, 8, logprobs=2))
            logprobs = [lp for c in chunks for lp in c.logprobs or []]
            ids = [t for c in chunks for t in c.token_ids]
            assert [lp.token for lp in logprobs] == [chr(t) for t in ids]
            assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].token == lp.token for lp in logprobs)
            assert all(lp.logprob < 0 for lp in logprobs)
            sent = servers[0].state()["seen"]
            assert sent[0]["return_logprob"] is True and sent[0]["top_logprobs_num"] == 2  # type: ignore[index]
        run(servers, body)


def test_closing_the_stream_aborts_on_the_server() -> None:
    with standins(1, "--token-delay-ms", "20") as servers:
        async def body(driver: SGLangDriver) -> None:
            req = request(PROMPT, 400)
            stream = driver.generate(req)
            async with contextlib.aclosing(stream):
                for _ in range(3):
                    await anext(stream)

            async def aborted() -> bool:
                return req.request_id in servers[0].state()["aborted"]  # type: ignore[operator]
            await await_until(aborted, "the stand-in saw the abort")
        run(servers, body)


def test_errors_map_to_bad_request_overloaded_and_unknown_model() -> None:
    with standins(1, "--max-running-requests", "1", "--max-queued-requests", "0", "--token-delay-ms", "20",
                  "--context-length", "128") as servers:
        async def body(driver: SGLangDriver) -> None:
            with pytest.raises(InvalidRequestError, match="context length"):
                await collect(driver, request(list(range(32, 32 + 130)), 5))  # SGLang says no, in its stream
            with pytest.raises(ModelNotFoundError):
                await collect(driver, GenerationRequest(request_id="x", model="nope", prompt_token_ids=PROMPT,
                                                        tokenized_prompt=PROMPT, max_tokens=4))
            hog = driver.generate(request(PROMPT, 100))
            async with contextlib.aclosing(hog):
                await anext(hog)
                with pytest.raises(OverloadedError, match="queue is full"):
                    await collect(driver, request(PROMPT[:20], 4))
        run(servers, body)


def test_shared_prefix_sticks_to_one_server_and_spills_under_imbalance() -> None:
    with standins(2, "--token-delay-ms", "30") as servers:
        async def body(driver: SGLangDriver) -> None:
            homes = set()
            for i in range(4):  # one after the other: the cache decides
                chunks = await collect(driver, request(PROMPT + [ord("a") + i], 2))
                homes.add(chunks[-1].node_id)
            assert len(homes) == 1
            assert driver.router.picks["cache"] == 3

            # Many at once with the same prefix: the home server fills up, the rest spill.
            streams = [driver.generate(request(PROMPT + [ord("k") + i], 200)) for i in range(8)]
            firsts = [await anext(s) for s in streams]
            for s in streams:
                await s.aclose()
            used = {c.node_id for c in firsts}
            assert used == {servers[0].id, servers[1].id}
            assert driver.router.picks["balance"] >= 1

            # Misses on an idle fleet spread instead of landing on one replica. Idle as the router sees
            # it: the aborted streams gone from its count and from the servers' polled load (under load
            # a poll can lag the aborts, and the balance guard then picks instead; seen in CI).
            async def idle() -> bool:
                return all(driver.router.load(n) == 0 for n in driver.servers)

            await await_until(idle, "both servers idle again after the aborted streams")
            for i in range(4):
                await collect(driver, request([ord("z") - i] * 40, 1))
            assert driver.router.picks["miss"] >= 4
        run(servers, body, balance_abs=2, balance_rel=1.5, min_match_tokens=16)


def test_without_get_load_the_load_comes_from_metrics_and_routing_follows_it() -> None:
    """One server lacks /get_load but serves SGLang's /metrics; the other offers neither. Streams that
    another client opened on the first (this gateway never saw them) show in its load through /metrics,
    and a cache miss goes to the other; the server with no load source still serves, counted by what
    this gateway sent it."""
    with standins(1, "--no-get-load", "--enable-metrics", "--token-delay-ms", "40") as metered, \
            standins(1, "--no-get-load", "--token-delay-ms", "40") as blind:
        busy, other = metered[0], blind[0]

        async def body(driver: SGLangDriver) -> None:
            def node(server: StandInProcess) -> dict[str, object]:
                return next(dataclasses.asdict(n) for n in driver.servers if n.id == server.id)

            assert node(busy)["load_source"] == "/metrics" and node(other)["load_source"] == ""
            async with httpx.AsyncClient(timeout=30) as direct:
                bodies = [{"input_ids": PROMPT + [ord("a") + i], "sampling_params": {"max_new_tokens": 500},
                           "stream": True} for i in range(4)]
                async with contextlib.AsyncExitStack() as open_streams:
                    for b in bodies:
                        response = await open_streams.enter_async_context(
                            direct.stream("POST", busy.url + "/generate", json=b))
                        assert response.status_code == 200

                    async def seen() -> bool:
                        return node(busy)["running"] == 4
                    await await_until(seen, "the other client's 4 streams in the polled /metrics load")
                    assert 0 < (node(busy)["kv_usage"] or 0) < 1
                    report = {n.id: n for n in driver.nodes().nodes}
                    assert report[busy.id].running == 4 and report[busy.id].load_source == "/metrics"
                    chunks = await collect(driver, request([ord("q")] * 30, 3))
                    assert chunks[-1].node_id == other.id  # the least loaded, as /metrics told
            assert node(other)["running"] == 0  # no source: only what this gateway has open counts
        run([*metered, *blind], body)


def test_a_killed_server_fails_over_and_the_text_continues() -> None:
    with standins(2, "--token-delay-ms", "25") as servers:
        async def body(driver: SGLangDriver) -> None:
            stream = driver.generate(request(PROMPT, 40))
            chunks = [await anext(stream) for _ in range(5)]
            victim = next(s for s in servers if s.id == chunks[0].node_id)
            victim.kill()
            chunks += [c async for c in stream]
            ids = [t for c in chunks for t in c.token_ids]
            assert ids == expected_ids(PROMPT, 40)  # nothing repeated, nothing skipped
            assert "".join(c.text for c in chunks) == text_of(ids)
            assert chunks[-1].completion_tokens == 40 and chunks[-1].node_id != victim.id
            assert driver.failovers == 1
        run(servers, body)


def test_kv_events_route_precisely_and_a_fresh_gateway_replays_them() -> None:
    with standins(2, kv_events=True) as servers:
        async def first(driver: SGLangDriver) -> str:
            async def connected() -> bool:
                return all(s.connected for s in driver.router.events.values())
            await await_until(connected, "subscribed to both servers' KV events")
            chunks = await collect(driver, request(PROMPT, 2))
            home = chunks[-1].node_id
            assert home is not None

            async def stored() -> bool:
                return driver.router.events[home].index.match(PROMPT) == 56
            await await_until(stored, "the BlockStored events arrived")
            return home

        home = run(servers, first)

        async def fresh(driver: SGLangDriver) -> None:  # a new gateway replica: it has routed nothing
            async def replayed() -> bool:
                return driver.router.cached(home, PROMPT) == 56
            await await_until(replayed, "the replay rebuilt the index")
            assert not driver.router.trees  # from the events, not from its own routing
            chunks = await collect(driver, request(PROMPT + [33], 2))
            assert chunks[-1].node_id == home and chunks[-1].cached_tokens == 56
            async with httpx.AsyncClient() as http:
                await http.post(next(s for s in servers if s.id == home).url + "/flush_cache")

            async def cleared() -> bool:
                return driver.router.cached(home, PROMPT) == 0
            await await_until(cleared, "AllBlocksCleared emptied the index")
        run(servers, fresh, min_match_tokens=16)




def test_a_server_side_abort_mid_stream_resumes_elsewhere() -> None:
    with standins(2, "--token-delay-ms", "25") as servers:
        async def body(driver: SGLangDriver) -> None:
            req = request(PROMPT, 30)
            stream = driver.generate(req)
            chunks = [await anext(stream) for _ in range(4)]
            home = next(s for s in servers if s.id == chunks[0].node_id)
            async with httpx.AsyncClient() as http:  # e.g. an operator's abort, or the server shutting down
                await http.post(home.url + "/abort_request", json={"rid": req.request_id})
            chunks += [c async for c in stream]
            ids = [t for c in chunks for t in c.token_ids]
            assert ids == expected_ids(PROMPT, 30)
            assert chunks[-1].finish_reason is FinishReason.LENGTH and chunks[-1].node_id != home.id
        run(servers, body)


def test_a_restarted_gateway_reloads_its_approximate_trees(tmp_path: Path) -> None:
    snapshot = str(tmp_path / "trees.msgpack")
    with standins(2) as servers:
        def with_snapshot(body: Callable[[SGLangDriver], Awaitable[T]]) -> T:
            return with_driver(dataclasses.replace(config(servers), snapshot_path=snapshot), body)

        async def first(driver: SGLangDriver) -> str:
            chunks = await collect(driver, request(PROMPT, 2))
            return str(chunks[-1].node_id)

        home = with_snapshot(first)

        async def restarted(driver: SGLangDriver) -> None:
            assert driver.router.cached(home, PROMPT) == 48  # three 16-token pages, from the snapshot
        with_snapshot(restarted)
