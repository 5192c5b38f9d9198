"""The engine process: owns an LLMEngine and runs its step loop, so torch never blocks an event loop.

Its whole world is two pipes of msgspec-encoded messages (`messages.py`).
Inputs are drained before every step, so an abort takes effect within one
step; when idle it blocks on the input pipe instead of spinning, and a request that
arrives saying more of its burst are coming (`AddRequest.more_coming`) holds the first
step until they are in or `SchedulerConfig.burst_hold_s` is up. A `SetFault`
makes it slow (a sleep after every step) or stalled (no steps, requests kept,
stats still sent) for chaos testing.

It lives and dies by its client: a `Shutdown`, the end of its pipe (the client's process is gone), or
the client's SIGKILL. SIGINT and SIGTERM are ignored here, because a signal sent to the whole process
group (Ctrl-C in a terminal, systemd's default `KillMode=control-group`, `kill -- -PGID`) is meant for
the gateway or the worker, which drains its requests on this engine before it stops it; taken here as
well, it ended every request in flight with `EngineDeadError` mid-drain. Local tensor-parallel ranks,
started by this process, inherit the ignored signals and die with it (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import msgspec

from engine_native.config import EngineConfig
from engine_native.errors import QueueFullError
from engine_native.host_memory import ask_for_huge_pages
from engine_native.messages import (
    AbortRequest,
    AddRejected,
    AddRequest,
    ClientMessage,
    EngineFailed,
    EngineMessage,
    EngineReady,
    RejectReason,
    SetFault,
    Shutdown,
    StepOutputs,
)

if TYPE_CHECKING:  # the real import happens in the child only: torch must not load in the parent
    from engine_native.engine import LLMEngine

IDLE_POLL_S = 0.25  # how often an idle engine re-sends its stats
STATS_INTERVAL_S = 0.1  # the most often a busy engine sends stats


def engine_main(config: EngineConfig, inbox: Connection, outbox: Connection, progress: bool = True) -> None:
    """Entry point of the spawned process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the client's to handle (module docstring)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=os.environ.get("SLUICE_LOG_LEVEL", "INFO").upper(),
        format=f"%(asctime)s %(levelname)s engine[{config.node_id}] %(name)s: %(message)s",
    )
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(ClientMessage)

    def send(msg: EngineMessage) -> None:
        outbox.send_bytes(encoder.encode(msg))

    ask_for_huge_pages()  # before torch's first allocation
    try:
        from engine_native.engine import LLMEngine  # imported here: torch loads in the child only

        engine = LLMEngine(config, progress=progress)
    except Exception as exc:  # noqa: BLE001 - the parent must learn why start-up failed
        send(EngineFailed(f"{type(exc).__name__}: {exc}"))
        return
    send(
        EngineReady(
            node_id=config.node_id,
            model_name=engine.model_name,
            max_model_len=engine.max_model_len,
            kv_blocks_total=engine.kv_cache.num_blocks,
            block_size=engine.kv_cache.block_size,
            device=engine.device_name,
            attention_backend=engine.attention_backend_name,
        )
    )
    send(engine.stats())  # so that clients see the pool before the first request
    # What start-up made (the tokenizer's vocabulary, the model's modules: ~185k objects) lives as long
    # as the process; out of the collector's sight, a full collection no longer walks it between two
    # steps (~30-50 ms, every decoding stream's inter-token gap, measured on the bundled model).
    gc.freeze()
    log = logging.getLogger("engine_native.process")
    last_stats = 0.0
    fault = SetFault()
    idle_hold = config.scheduler.burst_hold_s
    try:
        while True:
            stepping = engine.has_unfinished and not fault.stall
            timeout = 0.0 if stepping else IDLE_POLL_S
            burst = _NO_HOLD if stepping else _BurstHold(idle_hold)  # only an idle engine holds
            while inbox.poll(timeout):
                msg = decoder.decode(inbox.recv_bytes())
                if isinstance(msg, Shutdown):
                    return
                if isinstance(msg, AbortRequest):
                    aborted = engine.abort(msg.request_ids)
                    if aborted:
                        send(StepOutputs(aborted))
                elif isinstance(msg, AddRequest):
                    _add(engine, msg, send)
                    burst.saw(msg.more_coming)
                elif isinstance(msg, SetFault):
                    fault = msg
                    log.warning("fault injection: step_delay_s=%s stall=%s", msg.step_delay_s, msg.stall)
                timeout = burst.remaining()
            if engine.has_unfinished and not fault.stall:
                outputs = engine.step()
                if outputs:
                    send(StepOutputs(outputs))
                if fault.step_delay_s > 0:
                    time.sleep(fault.step_delay_s)
            now = time.monotonic()
            if now - last_stats >= STATS_INTERVAL_S:
                engine.check_alive()  # an idle parallel engine learns of a lost rank here, not at the next request
                send(engine.stats())
                last_stats = now
    except (EOFError, BrokenPipeError, OSError):
        log.info("client pipe closed; engine exiting")
    except Exception as exc:  # noqa: BLE001 - report, then die: the driver turns this into 503s
        log.error("engine step failed: %s", traceback.format_exc())
        try:
            send(EngineFailed(f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
    finally:
        engine.close()  # a tensor-parallel engine's worker ranks go with it


class _BurstHold:
    """An idle engine's wait for the rest of a burst (SchedulerConfig.burst_hold_s): from the first request
    that says more are coming until one says none are, or the hold's time is up."""

    def __init__(self, hold_s: float) -> None:
        self._hold_s = hold_s  # 0: holding is off
        self._until: float | None = None
        self._expecting = False

    def saw(self, more_coming: bool) -> None:
        self._expecting = more_coming and self._hold_s > 0
        if self._expecting and self._until is None:
            self._until = time.monotonic() + self._hold_s

    def remaining(self) -> float:
        """How long to poll for the next message: 0 unless the rest of a burst is awaited."""
        if not self._expecting or self._until is None:
            return 0.0
        return max(0.0, self._until - time.monotonic())


_NO_HOLD = _BurstHold(0.0)  # never holds, never changes: shared by every step of a busy engine


def _add(engine: LLMEngine, msg: AddRequest, send: Callable[[EngineMessage], None]) -> None:
    try:
        engine.add_request(
            msg.request_id,
            msg.prompt_token_ids,
            msg.sampling_params,
            priority=msg.priority,
            arrival_time=msg.arrival_time,
            tenant_id=msg.tenant_id,
            tenant_weight=msg.tenant_weight,
        )
    except QueueFullError as exc:
        send(AddRejected(request_id=msg.request_id, reason=RejectReason.QUEUE_FULL, message=str(exc)))
    except ValueError as exc:
        send(AddRejected(request_id=msg.request_id, reason=RejectReason.INVALID, message=str(exc)))
