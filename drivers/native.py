"""The driver for Sluice's own engine: tokenizes here, generates in engine processes.

Prompts are tokenized in the gateway process (so lengths can be checked and
charged before dispatch); the engine process detokenizes and applies stop
strings. Requests go to the healthy engine node with the fewest requests in flight
(`native_nodes.NodeRouter` judges health and carries fault injection). An engine
process that dies is restarted by `supervisor.EngineSupervisor`; meanwhile the
others serve (ready, degraded), and the driver is not live once it gave up on one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field, replace

from drivers import retry_after
from drivers.base import (
    Driver,
    DriverError,
    DriverHealth,
    EngineDeadError,
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    InvalidRequestError,
    ModelCard,
    ModelNotFoundError,
    NodesReport,
    OverloadedError,
    ShuttingDownError,
    TokenLogprob,
    TopLogprob,
)
from drivers.native_nodes import NodeRouter
from drivers.options import EngineOptions, overrides
from drivers.portable_tokenizer import TokenizerSpec, encode_prompt, hf_spec
from drivers.supervisor import EngineSupervisor, RestartPolicy
from engine_native import errors as engine_errors
from engine_native.client import AsyncEngineClient
from engine_native.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from engine_native.messages import AddRequest, LogprobEntry, RequestOutput
from engine_native.messages import FinishReason as EngineFinishReason
from engine_native.model.bundled import bundled_model_path
from engine_native.model.token_bytes import TokenBytes
from engine_native.model.tokenizer import TextTokenizer, Tokenizer
from engine_native.model.tokenizer_loader import load_tokenizer
from engine_native.sampling_params import SamplingParams
from engine_native.step_trace import trace_file_name
from observability.node_health import NodeHealthConfig

log = logging.getLogger(__name__)

LOADING_RETRY_AFTER_S = 5.0  # what a request that arrives while the model loads is told

_FINISH = {
    EngineFinishReason.STOP: FinishReason.STOP,
    EngineFinishReason.LENGTH: FinishReason.LENGTH,
    EngineFinishReason.ABORT: FinishReason.ABORT,
}


DEFAULT_SERVED_MODEL_NAME = "smollm2-135m-instruct"  # the bundled model's id


@dataclass(frozen=True)
class NativeDriverConfig:
    """The native driver: its engines (one config, copied per node) and how it watches them."""

    engine: EngineConfig = field(default_factory=lambda: EngineConfig(
        model_path=bundled_model_path(), served_model_name=DEFAULT_SERVED_MODEL_NAME
    ))
    """Every engine's config; `node_id` is set per engine (node-0..N-1)."""
    num_engines: int = 1
    node_health: NodeHealthConfig = field(default_factory=NodeHealthConfig)
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    """How dead engines are restarted, and when to give up (drivers/supervisor.py)."""
    fault_step_delay: Mapping[str, float] = field(default_factory=dict)
    """Chaos testing: extra sleep after every engine step, by node id, from the start."""
    progress: bool = True
    """Show a progress bar while a model loads."""
    step_trace_dir: str | None = None
    """Each engine writes its step trace to `<dir>/<node id>.jsonl` (engine_native/step_trace.py)."""
    node_prefix: str = "node"
    """Engines are nodes `<prefix>-0..N-1`; a second model version on the same host gets its own
    prefix (`<version id>/node`) so that node ids stay unique."""

    @property
    def served_model_name(self) -> str:
        return self.engine.served_model_name or DEFAULT_SERVED_MODEL_NAME

    def engine_config(self, index: int) -> EngineConfig:
        node_id = f"{self.node_prefix}-{index}"
        trace = os.path.join(self.step_trace_dir, trace_file_name(node_id)) if self.step_trace_dir else None
        return replace(self.engine, node_id=node_id, step_trace_path=trace)

    @classmethod
    def from_options(cls, options: EngineOptions) -> NativeDriverConfig:
        """Options left unset keep the defaults of `engine_native.config` and of this class."""
        o = options
        scheduler = replace(SchedulerConfig(), **overrides(
            max_num_seqs=o.max_num_seqs,
            max_num_batched_tokens=o.max_num_batched_tokens,
            long_prefill_token_threshold=o.long_prefill_token_threshold,
            wave_budget_factor=o.wave_budget_factor,
            prompt_order_ms_per_token=o.prompt_order_ms_per_token,
            burst_hold_s=o.burst_hold_ms / 1000.0 if o.burst_hold_ms is not None else None,
            max_waiting=o.max_waiting,
        ))
        if o.prefill_tokens_beside_decodes is not None:  # 0: no cap
            scheduler = replace(scheduler, prefill_tokens_beside_decodes=o.prefill_tokens_beside_decodes or None)
        if o.max_waiting_tokens is not None:  # 0: no token bound
            scheduler = replace(scheduler, max_waiting_tokens=o.max_waiting_tokens or None)
        cache = replace(CacheConfig(), **overrides(
            memory_bytes=o.kv_cache_memory_bytes, enable_prefix_caching=o.enable_prefix_caching
        ))
        engine = EngineConfig(
            model_path=o.model or bundled_model_path(),
            served_model_name=o.served_model_name or DEFAULT_SERVED_MODEL_NAME,
            cache=cache,
            scheduler=scheduler,
            parallel=replace(ParallelConfig(), **overrides(tensor_parallel_size=o.tensor_parallel_size)),
            **overrides(dtype=o.dtype, num_threads=o.num_threads, max_model_len=o.max_model_len, device=o.device,
                        attention_backend=o.attention_backend, prefill_attention_dtype=o.prefill_attention_dtype,
                        bf16_panel_max_rows=o.bf16_panel_max_rows,
                        int8_activation_max_rows=o.int8_activation_max_rows,
                        int16_activation_max_rows=o.int16_activation_max_rows, kv_dtype=o.kv_dtype),
        )
        return cls(
            engine=engine,
            fault_step_delay=dict(o.fault_step_delay),
            step_trace_dir=o.step_trace_dir,
            **overrides(num_engines=o.num_engines, node_health=o.node_health, restart=o.restart),
        )


class NativeDriver(Driver):
    def __init__(self, config: NativeDriverConfig | None = None) -> None:
        self.config = config or NativeDriverConfig()
        self.served_model_name = self.config.served_model_name
        self.router: NodeRouter | None = None
        self.supervisor: EngineSupervisor | None = None
        self.engines: list[AsyncEngineClient] = []
        self.tokenizer: Tokenizer | None = None
        self._token_bytes: TokenBytes | None = None  # logprobs' bytes, built at the first request for them
        self._tokenizer_spec: TokenizerSpec | None = None  # built once: a large tokenizer's JSON is MBs
        self.ready = False  # True once every engine has loaded its model, until stop()
        self.max_model_len = 0
        self.max_request_tokens = 0  # tokens the smallest engine's KV pool holds
        # Prompts being tokenized now: a request sent while some are tells the engine that more are coming
        # (AddRequest.more_coming), so that an idle engine prefills a burst in one step.
        self.tokenizing = 0

    @classmethod
    def from_options(cls, options: EngineOptions) -> NativeDriver:
        return cls(NativeDriverConfig.from_options(options))

    # ----- lifecycle -------------------------------------------------------------------

    def begin_start(self) -> None:
        """Spawn the engine processes: they load the model from here on, and `start()` waits for them."""
        if not self.engines:
            config = self.config
            self.engines = [
                AsyncEngineClient(config.engine_config(i), progress=config.progress) for i in range(config.num_engines)
            ]
        for engine in self.engines:
            engine.spawn()

    async def start(self) -> None:
        config = self.config
        self.begin_start()
        # The tokenizer loads in this process while the engines load the model.
        self.tokenizer, infos = await asyncio.gather(
            asyncio.to_thread(load_tokenizer, config.engine.model_path),
            asyncio.gather(*(e.start() for e in self.engines)),
        )
        self.max_model_len = min(i.max_model_len for i in infos)
        self.max_request_tokens = min(i.kv_blocks_total * i.block_size for i in infos)
        self.router = NodeRouter(self.engines, config.node_health, config.fault_step_delay)
        await self.router.start()
        self.supervisor = EngineSupervisor(self.engines, config.restart, listener=self.router)
        await self.supervisor.start()
        self.ready = True
        log.info("native driver ready: model=%s nodes=%d max_model_len=%d",
                 self.served_model_name, len(self.engines), self.max_model_len)

    async def stop(self) -> None:
        """Stop supervising (nothing is restarted any more), then shut the engines down: requests on
        them end with an error. Idempotent."""
        self.ready = False
        if self.supervisor is not None:
            await self.supervisor.stop()
        if self.router is not None:
            await self.router.stop()
        engines, self.engines = self.engines, []
        await asyncio.gather(*(e.shutdown() for e in engines), return_exceptions=True)

    # ----- the seam --------------------------------------------------------------------

    def models(self) -> list[ModelCard]:
        pool = self.max_request_tokens if 0 < self.max_request_tokens < self.max_model_len else None
        return [ModelCard(id=self.served_model_name, max_model_len=self.max_model_len, max_request_tokens=pool)]

    def _check_model(self, request: GenerationRequest) -> None:
        if request.model != self.served_model_name:
            raise ModelNotFoundError(request.model)

    async def tokenize(self, request: GenerationRequest) -> list[int]:
        self._check_model(request)
        if not self.ready:
            raise OverloadedError("the model is still loading", retry_after=LOADING_RETRY_AFTER_S)
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        tok = self.tokenizer
        if tok is None:
            raise InvalidRequestError("this model has no tokenizer; send prompt token ids", param="prompt")
        # A worker thread: a 1 MiB prompt takes most of a second to encode (the tokenizer releases
        # the GIL meanwhile), and the event loop serves every other stream in the meantime.
        self.tokenizing += 1
        try:
            return await asyncio.to_thread(encode_prompt, tok, request)
        finally:
            self.tokenizing -= 1

    def tokenizer_spec(self, model: str) -> TokenizerSpec | None:
        if model != self.served_model_name or self.tokenizer is None:
            return None
        if self._tokenizer_spec is None:
            self._tokenizer_spec = hf_spec(self.tokenizer)
        return self._tokenizer_spec

    def _sampling_params(self, request: GenerationRequest, n_prompt: int) -> SamplingParams:
        room = self.max_model_len - n_prompt
        max_tokens = request.max_tokens if request.max_tokens is not None else room
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            min_p=request.min_p,
            repetition_penalty=request.repetition_penalty,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            seed=request.seed,
            stop=list(request.stop),
            stop_token_ids=list(request.stop_token_ids),
            ignore_eos=request.ignore_eos,
            logit_bias=dict(request.logit_bias),
            logprobs=request.logprobs,
        )
        try:
            params.validate()
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from exc
        if n_prompt + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} "
                "for the completion). Please reduce the prompt or max_tokens.",
                param="max_tokens",
            )
        return params

    def _pick_engine(self) -> AsyncEngineClient:
        alive = [e for e in self.engines if e.alive]
        if not alive:
            if self.supervisor is None:
                raise EngineDeadError("no engine is running")
            states = "; ".join(f"{e.config.node_id}: {self.supervisor.describe(e.config.node_id)}" for e in self.engines)
            raise EngineDeadError(f"no engine is running ({states})")
        if self.router is None:
            return min(alive, key=lambda e: e.num_in_flight)
        return self.router.pick(alive)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        prompt_ids = request.tokenized_prompt
        if prompt_ids is None:
            prompt_ids = await self.tokenize(request)
        else:
            self._check_model(request)
        params = self._sampling_params(request, len(prompt_ids))
        engine = self._pick_engine()
        capacity = engine.config.scheduler.max_num_seqs + engine.config.scheduler.max_waiting
        if engine.num_in_flight >= capacity:
            raise OverloadedError(f"{engine.num_in_flight} requests in flight on {engine.config.node_id}",
                                  retry_after=self._retry_after(engine, request.priority))
        arrival = time.time()
        try:
            stream = engine.add(AddRequest(
                request_id=request.request_id,
                prompt_token_ids=prompt_ids,
                sampling_params=params,
                priority=request.priority,
                arrival_time=arrival,
                tenant_id=request.tenant_id,
                tenant_weight=request.tenant_weight,
                more_coming=self.tokenizing > 0,
            ))
        except engine_errors.EngineError as exc:
            raise self._driver_error(exc, engine, request.priority) from exc
        timer = self.router.timer(engine, arrival, len(prompt_ids)) if self.router else None
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, engine_errors.EngineError):
                    finished = True
                    raise self._driver_error(item, engine, request.priority)
                finished = item.finish_reason is not None
                if timer is not None:
                    timer.on_output(item)
                yield self._chunk(item, engine.config.node_id)
                if finished:
                    return
        finally:
            if not finished:
                engine.abort([request.request_id])

    def _driver_error(
        self, exc: engine_errors.EngineError, engine: AsyncEngineClient, priority: int
    ) -> DriverError:
        """The one mapping of the engine's errors to the driver seam's."""
        if isinstance(exc, engine_errors.QueueFullError):
            return OverloadedError(str(exc), retry_after=self._retry_after(engine, priority))
        if isinstance(exc, engine_errors.InvalidRequestError):
            return InvalidRequestError(str(exc))
        if isinstance(exc, engine_errors.EngineShutDownError):
            return ShuttingDownError("The server is shutting down; retry the request", retry_after=1.0)
        return EngineDeadError(str(exc))

    @staticmethod
    def _retry_after(engine: AsyncEngineClient, priority: int) -> float:
        """Seconds until the queue ahead of `priority` has been served, at the engine's measured pace
        (drivers/retry_after.py has the formula)."""
        stats = engine.stats
        if stats is None:
            return retry_after.UNMEASURED_S
        ahead = retry_after.work_ahead(stats.waiting_work_by_priority, priority)
        return retry_after.retry_after_s(ahead, stats.prompt_tokens_per_s + stats.generation_tokens_per_s)

    def _chunk(self, out: RequestOutput, node_id: str) -> GenerationChunk:
        return GenerationChunk(
            request_id=out.request_id,
            text=out.new_text,
            token_ids=out.new_token_ids,
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=out.num_output_tokens,
            finish_reason=_FINISH[out.finish_reason] if out.finish_reason is not None else None,
            logprobs=[self._logprob(e) for e in out.logprobs] if out.logprobs is not None else None,
            arrival_time=out.arrival_time,
            first_scheduled_time=out.first_scheduled_time,
            first_token_time=out.first_token_time,
            finish_time=out.finish_time,
            node_id=node_id,
            token_time=out.token_time,
            preemption_times=out.preemption_times,
            cached_tokens=out.num_cached_tokens,
        )

    def _logprob(self, entry: LogprobEntry) -> TokenLogprob:
        return TokenLogprob(
            token=entry.token,
            logprob=entry.logprob,
            bytes=self._bytes_of(entry.token_id, entry.token),
            top_logprobs=[TopLogprob(t.token, t.logprob, self._bytes_of(t.token_id, t.token)) for t in entry.top],
        )

    def _bytes_of(self, token_id: int, text: str) -> list[int]:
        """A token's own bytes (engine_native/model/token_bytes.py), not its text's: a token holding part of
        a UTF-8 character decodes alone to U+FFFD. Without a tokenizer to read them from, its text's."""
        if self._token_bytes is None and isinstance(self.tokenizer, TextTokenizer):
            self._token_bytes = TokenBytes(self.tokenizer)  # at the first logprobs: not every server needs it
        own = self._token_bytes(token_id) if self._token_bytes is not None else b""
        return list(own or text.encode("utf-8"))

    def nodes(self) -> NodesReport:
        return self.router.report() if self.router is not None else NodesReport([], [])

    async def set_fault(self, node_id: str, step_delay_s: float, stall: bool) -> None:
        if self.router is None:
            raise InvalidRequestError("the driver is not started")
        await self.router.set_fault(node_id, step_delay_s, stall)

    async def abort(self, request_id: str) -> None:
        for engine in self.engines:
            engine.abort([request_id])

    async def health(self) -> DriverHealth:
        """Ready while any engine runs; degraded while some do not; not live once the supervisor gave up."""
        alive = [e for e in self.engines if e.alive]
        stats = [e.stats for e in alive if e.stats is not None]
        if self.supervisor is None:
            return DriverHealth(ready=False, detail="the model is loading", starting=True)
        if not self.ready:
            return DriverHealth(ready=False, detail="the driver is stopped")
        down = [e for e in self.engines if not e.alive]
        detail = "; ".join(f"{e.config.node_id}: {self.supervisor.describe(e.config.node_id)}" for e in down)
        return DriverHealth(
            ready=bool(alive),
            detail=f"degraded: {len(alive)} of {len(self.engines)} engines up; {detail}" if down else "",
            live=not self.supervisor.gave_up,
            degraded=bool(down),
            running=sum(s.running for s in stats),
            waiting=sum(s.waiting for s in stats),
            kv_blocks_used=sum(s.kv_blocks_used for s in stats),
            kv_blocks_total=sum(s.kv_blocks_total for s in stats),
            preemptions=sum(s.num_preemptions for s in stats),
            generation_tokens_per_s=sum(s.generation_tokens_per_s for s in stats),
            prompt_tokens_per_s=sum(s.prompt_tokens_per_s for s in stats),
            waiting_tokens=sum(s.waiting_tokens for s in stats),
            waiting_work_by_priority=_sum_by_key(s.waiting_work_by_priority for s in stats),
            prefill_waiting_by_priority=_sum_by_key(s.prefill_waiting_by_priority for s in stats),
            prefill_running=sum(s.prefill_running for s in stats),
            prefill_tokens_per_s=sum(s.prefill_tokens_per_s for s in stats),
            max_waiting=sum(s.max_waiting for s in stats),
            max_num_seqs=sum(e.config.scheduler.max_num_seqs for e in alive),
            max_waiting_tokens=sum(s.max_waiting_tokens or 0 for s in stats),
            prefix_cache_hit_rate=(sum(s.prefix_cache_hit_rate for s in stats) / len(stats)) if stats else 0.0,
            timestamp=min((s.timestamp for s in stats), default=0.0),
        )


def _sum_by_key(maps: Iterable[dict[int, int]]) -> dict[int, int]:
    total: dict[int, int] = {}
    for m in maps:
        for key, value in m.items():
            total[key] = total.get(key, 0) + value
    return total


