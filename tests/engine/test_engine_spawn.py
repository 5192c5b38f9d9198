"""`AsyncEngineClient.spawn()`: the engine process starts loading before any event loop runs (`sluice serve`
spawns it ahead of the gateway's own imports), `start()` takes that process over, and one spawned and never
started does not keep its parent from exiting."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest
from tiny_models import prompt, save_tiny_llama

from engine_native.client import AsyncEngineClient
from engine_native.config import CacheConfig, EngineConfig
from engine_native.messages import AddRequest, RequestOutput
from engine_native.sampling_params import SamplingParams
from tests.polling import wait_until


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-spawn")
    save_tiny_llama(path)
    return path


def _config(model: Path) -> EngineConfig:
    return EngineConfig(model_path=str(model), dtype="float32", num_threads=1,
                        cache=replace(CacheConfig(), num_blocks=32, block_size=16))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_start_takes_over_the_process_that_spawn_began(tiny: Path) -> None:
    client = AsyncEngineClient(_config(tiny), progress=False)
    client.spawn()  # no event loop here
    pid = client.pid
    assert pid is not None and _alive(pid)
    client.spawn()  # a second call spawns nothing more
    assert client.pid == pid

    async def serve() -> list[int]:
        await client.start(timeout_s=120)
        try:
            assert client.pid == pid and client.alive
            greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
            stream = client.add(AddRequest(request_id="r", prompt_token_ids=prompt(8, 0), sampling_params=greedy,
                                           arrival_time=time.time()))
            tokens: list[int] = []
            while True:
                out = await asyncio.wait_for(stream.get(), 60)
                assert isinstance(out, RequestOutput), out
                tokens += out.new_token_ids
                if out.finish_reason is not None:
                    return tokens
        finally:
            await client.shutdown()

    assert len(asyncio.run(serve())) == 3
    assert not _alive(pid)


def test_a_request_that_cannot_be_encoded_leaves_no_stream_in_flight(tiny: Path) -> None:
    """msgpack carries integers below 2**64 only: such a request raises in add() and is not counted in flight
    (the count routes requests and refuses them past the engine's capacity); the next one is served."""

    async def serve() -> tuple[int, int]:
        client = AsyncEngineClient(_config(tiny), progress=False)
        await client.start(timeout_s=120)
        try:
            huge = SamplingParams(max_tokens=2, temperature=1.0, seed=2**70)
            with pytest.raises(OverflowError):
                client.add(AddRequest(request_id="huge", prompt_token_ids=prompt(8, 0), sampling_params=huge,
                                      arrival_time=time.time()))
            after = client.num_in_flight
            greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
            stream = client.add(AddRequest(request_id="ok", prompt_token_ids=prompt(8, 0), sampling_params=greedy,
                                           arrival_time=time.time()))
            while True:
                out = await asyncio.wait_for(stream.get(), 60)
                assert isinstance(out, RequestOutput), out
                if out.finish_reason is not None:
                    return after, out.num_output_tokens
        finally:
            await client.shutdown()

    assert asyncio.run(serve()) == (0, 2)


def test_a_process_spawned_and_never_started_does_not_hold_up_its_parents_exit(tiny: Path, tmp_path: Path) -> None:
    """The engine ignores SIGTERM (engine_native/process.py) and its pipe stays open in the parent, so
    multiprocessing's exit handler, which sends SIGTERM and then waits, would wait for it forever."""
    script = tmp_path / "abandon.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        from dataclasses import replace
        from engine_native.client import AsyncEngineClient
        from engine_native.config import CacheConfig, EngineConfig

        if __name__ == "__main__":
            config = EngineConfig(model_path={str(tiny)!r}, dtype="float32", num_threads=1,
                                  cache=replace(CacheConfig(), num_blocks=32, block_size=16))
            client = AsyncEngineClient(config, progress=False)
            client.spawn()
            print(client.pid, flush=True)
            sys.stdin.readline()  # the test says when
            raise RuntimeError("the server failed before it started its driver")
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        pid = int(proc.stdout.readline())
        _wait_ignoring_sigterm(pid)
        proc.stdin.write("\n")
        proc.stdin.flush()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 1 and "the server failed" in err
    assert not _alive(pid)


def _wait_ignoring_sigterm(pid: int) -> None:
    """Until the engine process runs engine_main, which ignores SIGTERM first thing: before that, the exit
    handler's SIGTERM would still end it."""

    def ignoring() -> bool:
        status = Path(f"/proc/{pid}/status").read_text()
        ignored = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), 16)
        return bool(ignored & (1 << (signal.SIGTERM - 1)))

    wait_until(ignoring, "the engine process to reach engine_main")


def test_a_start_cancelled_while_the_model_loads_stops_the_process(tiny: Path) -> None:
    """The server stopping while its engines load (a port already taken, a signal) cancels their start: a stop,
    said as such, and no process left."""
    client = AsyncEngineClient(_config(tiny), progress=False)

    async def cancel_midway() -> None:
        starting = asyncio.create_task(client.start(timeout_s=120))
        await asyncio.sleep(0.2)  # spawned, still importing torch
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting

    asyncio.run(cancel_midway())
    assert client.dead_reason == "its start was cancelled"
    assert client.pid is not None and not _alive(client.pid)
