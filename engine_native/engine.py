"""The synchronous engine: one `step()` = schedule, run the model, update, detokenize.

    scheduler.schedule() -> SchedulerOutput
    runner.execute(SchedulerOutput) -> RunnerOutput
    scheduler.update_from_output(...) -> list[TokenUpdate] -> list[RequestOutput]

It runs inside the engine process (`engine_native.process`); tests and the
benchmark also drive it directly.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine_native.config import PREFILL_ATTENTION_DTYPES, EngineConfig
from engine_native.cuda_graphs import DecodeGraphs
from engine_native.detokenizer import IncrementalDetokenizer
from engine_native.device import compute_dtype, describe, device_memory_info, resolve_device
from engine_native.device_runner import DeviceForward
from engine_native.forward_batch import KVCache
from engine_native.host_memory import retain_freed_memory
from engine_native.kv_cache_manager import KVCacheManager
from engine_native.messages import EngineStats, LogprobEntry, LogprobTop, RequestOutput
from engine_native.model.attention_backends import SDPA, build_attention_backend, resolve_backend_name
from engine_native.model.base import CausalLM, LoadedModel
from engine_native.model.llama import (
    QUANTIZED_MAX_ROWS,
    QUANTIZED_MAX_ROWS_BESIDE_BF16_PANELS,
    kernels_take_cache,
)
from engine_native.model.loader import load_model
from engine_native.model.quant import (
    INT16_ACTIVATION_MAX_ROWS,
    NO_ROUNDING,
    ActivationRounding,
    int16_activations_pay,
)
from engine_native.model.tokenizer import Tokenizer
from engine_native.precision import parse_dtype
from engine_native.request import Request, RequestStatus
from engine_native.runner import ModelRunner
from engine_native.sampler import TokenLogprobs, make_generator
from engine_native.sampling_params import SamplingParams
from engine_native.scheduler import QueueFullError, Scheduler, TokenUpdate
from engine_native.sizing import num_kv_blocks, num_swap_blocks
from engine_native.step_trace import StepRecord, StepTraceWriter
from engine_native.swap import HostSwapSpace, PreemptionCost, SwapPolicy, copy_blocks

if TYPE_CHECKING:
    from engine_native.parallel.group import EngineGroup

log = logging.getLogger(__name__)

STATS_WINDOW_S = 5.0  # the recent past that rates are measured over


@dataclass(frozen=True)
class _StepRecord:
    end: float  # time.time() when the step ended
    generated: int  # tokens sampled
    prompt: int  # prompt tokens computed
    cached: int  # prompt tokens found in the prefix cache by requests admitted in this step
    interval: float  # seconds since the previous step ended
    backlog: bool  # prompt work was left waiting when the step was scheduled


@dataclass
class _Tracked:
    """Engine-side state of a request beyond what the scheduler keeps."""

    request: Request
    detokenizer: IncrementalDetokenizer | None


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, progress: bool = True) -> None:
        self.config = config
        retain_freed_memory()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        on_cpu = self.device.type == "cpu"
        dtype = compute_dtype(config.dtype, self.device)
        self.group: EngineGroup | None = None
        if config.parallel.world_size > 1 and loaded is None:
            if not on_cpu:
                raise ValueError("tensor and pipeline parallelism run on the CPU (gloo) only so far: use --device cpu")
            from engine_native.parallel.group import EngineGroup  # torch.distributed only when asked for

            self.group = EngineGroup.start(config, dtype, progress)
            loaded = self.group.loaded
        self.loaded = loaded or load_model(config.model_path, dtype=dtype, progress=progress)
        if not on_cpu:
            self.loaded.model.place_on(self.device)
        model_cfg = self.loaded.config
        self.tokenizer: Tokenizer | None = self.loaded.tokenizer
        self.max_model_len = min(config.max_model_len or model_cfg.max_position_embeddings,
                                 model_cfg.max_position_embeddings)
        # Packed first: where the bf16 panels are made, they take the pure-decode steps the blocks are slower at
        # (unless quantized_max_rows is set at or above their bound, which leaves them no step: none made).
        quantized_rows = config.quantized_max_rows
        panels_asked = config.bf16_panel_max_rows
        if quantized_rows is not None and quantized_rows >= panels_asked:
            panels_asked = 0
        num_packed = self.loaded.model.pack_dense(bf16_panel_max_rows=panels_asked) if config.pack_weights and on_cpu else 0
        # 0 where the kernel does not run; an engine sharing a loaded model (tests) finds it packed already.
        panel_rows = getattr(self.loaded.model, "bf16_panel_max_rows", 0) if on_cpu else 0
        if num_packed:
            log.info("%d dense weight matrices pre-packed for oneDNN%s", num_packed,
                     f" (decode steps of <= {panel_rows} sequences through the bf16 panels)" if panel_rows else "")
        if quantized_rows is None:
            quantized_rows = (QUANTIZED_MAX_ROWS_BESIDE_BF16_PANELS if panel_rows > QUANTIZED_MAX_ROWS_BESIDE_BF16_PANELS
                              else QUANTIZED_MAX_ROWS)
        # The quantized blocks are a CPU kernel's: off on an accelerator.
        int16_rows = config.int16_activation_max_rows
        if int16_rows is None:
            int16_rows = INT16_ACTIVATION_MAX_ROWS if int16_activations_pay() else 0
        num_quantized = self.loaded.model.enable_quantized(
            quantized_rows if on_cpu else 0, config.amx_max_rows if on_cpu else 0, config.panel_max_rows if on_cpu else 0,
            rounding=ActivationRounding(int16_rows, config.int8_activation_max_rows),
        )
        if num_quantized:
            panel = getattr(self.loaded.model, "panel_max_rows", 0)  # 0 where the panel kernels do not run
            rounding = getattr(self.loaded.model, "rounding", NO_ROUNDING)
            log.info("steps of <= %d tokens multiply by the quantized blocks of %d weight matrices%s%s%s",
                     quantized_rows, num_quantized, f" (<= {panel} through the panel kernels)" if panel else "",
                     f"; steps of <= {rounding.int8_max_rows} round their activations to int8"
                     if rounding.int8_max_rows > 0 else "",
                     f"; steps of <= {rounding.int16_max_rows} to int16"
                     if rounding.int16_max_rows > rounding.int8_max_rows else "")
        kv_dtype = (parse_dtype(config.kv_dtype) if config.kv_dtype
                    else default_kv_dtype(config.dtype, self.loaded.dtype, on_cpu, model_cfg.head_dim))
        block_size = config.cache.block_size
        self.attention_backend_name = resolve_backend_name(config.attention_backend, self.device, kv_dtype)
        # Engines that share one loaded model (tests) share its backend too: the last one set wins.
        self.loaded.model.attention_backend = build_attention_backend(
            self.attention_backend_name, model_cfg, self.device, kv_dtype
        )
        self.loaded.model.prefill_attention_dtype = _prefill_attention_dtype(config.prefill_attention_dtype, kv_dtype)
        self.loaded.model.prefill_attention_kernel_on = config.prefill_attention_dtype == "float32"
        # A tensor-parallel rank's pool holds only its own KV heads (model.config is the rank's slice).
        num_blocks = num_kv_blocks(config, self.loaded.model.config, kv_dtype, self.max_model_len,
                                   device_memory_info(self.device))
        use_graphs = self.device.type == "cuda" and bool(config.cuda_graph_batch_sizes) and \
            self.attention_backend_name == SDPA
        # Swap-to-host copies one process's pool: not with a parallel group's pools spread over ranks.
        num_swap = 0 if self.group is not None else num_swap_blocks(config, model_cfg, kv_dtype, self.device)
        self.host_kv: KVCache | None = None
        swap: SwapPolicy | None = None
        if num_swap > 0:
            self.host_kv = KVCache.allocate(
                model_cfg.num_layers, num_swap, block_size, model_cfg.num_kv_heads, model_cfg.head_dim, kv_dtype,
                pin_memory=not on_cpu,
            )
            cost = PreemptionCost.for_device(model_cfg, kv_dtype, self.device)
            swap = SwapPolicy(HostSwapSpace(num_swap), config.cache.preemption_mode, cost)
        self.kv_cache = KVCacheManager(
            num_blocks,
            block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            share_prefix_across_tenants=config.cache.share_prefix_across_tenants,
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, self.max_model_len, swap=swap,
                                   device_type=self.device.type)
        if self.group is not None:
            self.runner: ModelRunner = self.group.runner(num_blocks, block_size, kv_dtype)
        else:
            # With graphs, one more block than the allocator knows of: the scratch block of padding rows.
            kv = KVCache.allocate(
                model_cfg.num_layers, num_blocks + use_graphs, block_size, model_cfg.num_kv_heads,
                model_cfg.head_dim, kv_dtype, device=self.device,
            )
            model: CausalLM = self.loaded.model
            if not on_cpu:
                graphs = None
                if use_graphs:
                    graphs = DecodeGraphs(
                        self.loaded.model, kv, config.cuda_graph_batch_sizes,
                        min(config.cuda_graph_max_context, self.max_model_len), block_size, num_blocks, self.device,
                    )
                    graphs.capture()
                model = DeviceForward(self.loaded.model, self.device, graphs)
            self.runner = ModelRunner(model, kv, block_size)
        self.device_name = describe(self.device)
        self.model_name = config.served_model_name or model_cfg.name
        self._tracked: dict[str, _Tracked] = {}
        self._eos = frozenset(self.tokenizer.eos_token_ids) if self.tokenizer else frozenset()
        self.steps = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._recent: deque[_StepRecord] = deque()
        self._last_step_end = time.time()
        self._idle = True  # no work left after the last step: the next one's interval starts with it
        self.trace = StepTraceWriter(config.step_trace_path) if config.step_trace_path else None
        log.info(
            "engine ready: model=%s device=%s attention=%s dtype=%s max_model_len=%d kv_blocks=%d x %d tokens"
            " kv_dtype=%s swap_blocks=%d preemption=%s",
            self.model_name, self.device_name, self.attention_backend_name, dtype, self.max_model_len, num_blocks,
            block_size, kv_dtype, num_swap, config.cache.preemption_mode if num_swap else "recompute",
        )

    # ----- requests --------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        tenant_id: str | None = None,
        tenant_weight: float = 1.0,
    ) -> None:
        """Queue a request. Raises ValueError if it is invalid, QueueFullError if the queue is full."""
        params.validate()
        if not (math.isfinite(tenant_weight) and tenant_weight > 0):
            raise ValueError(f"tenant_weight must be a positive number, not {tenant_weight}")
        vocab = self.loaded.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab})")
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            priority=priority,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            tenant_id=tenant_id,
            tenant_weight=tenant_weight,
            eos_token_ids=self._eos,
            generator=make_generator(params.seed),
        )
        self.scheduler.add_request(request)
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params) if self.tokenizer else None
        self._tracked[request_id] = _Tracked(request, detok)

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        """Abort requests wherever they are; their blocks are free when this returns."""
        outputs = []
        for rid in request_ids:
            request = self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            tracked = self._tracked.pop(rid, None)
            if request is not None and tracked is not None:
                outputs.append(self._final_output(request, [], "", None))
        self._idle = not self.scheduler.has_work  # the next step's interval must not count the wait for it
        return outputs

    def close(self) -> None:
        """Stop the worker ranks of a tensor-parallel engine; close the step trace."""
        if self.trace is not None:
            self.trace.close()
        if self.group is not None:
            self.group.close()

    def check_alive(self) -> None:
        """Raise `RankLostError` when a worker rank of a parallel engine is gone (no-op for one process)."""
        if self.group is not None:
            self.group.check_alive()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ----- the step --------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        started = time.time()
        sched = self.scheduler.schedule()
        if self.host_kv is not None:  # before the forward: swap-outs first, then swap-ins (swap.py)
            copy_blocks(self.runner.kv_cache, self.host_kv, sched.swap_out)
            copy_blocks(self.host_kv, self.runner.kv_cache, sched.swap_in)
        if sched.is_empty:
            return []
        forward_started = time.perf_counter()
        result = self.runner.execute(sched, self.kv_cache.block_table)
        forward_s = time.perf_counter() - forward_started
        updates = self.scheduler.update_from_output(sched, result)
        self.steps += 1
        now = time.time()
        prompt_tokens = sum(
            s.num_new_tokens for s in sched.scheduled if s.num_computed_before < s.request.num_prompt_tokens
        )
        cached_tokens = sum(s.num_cached for s in sched.scheduled)
        self.prompt_tokens_total += prompt_tokens
        self.generation_tokens_total += len(updates)
        # Prompt work was left over: a chunk that did not reach its sample, or requests still waiting. Such
        # steps measure how fast queued prompts are served, which is what a new request would wait on.
        backlog = bool(len(self.scheduler.waiting)) or any(not s.samples for s in sched.scheduled)
        # The time a step costs includes the loop's own work since the previous step, but not a wait for
        # requests: after idle, a step's interval starts when it does. (A step after a minute of idle
        # counted the minute, and the prefill rate it reported made the next burst look minutes long.)
        since = started if self._idle else self._last_step_end
        self._recent.append(_StepRecord(now, len(updates), prompt_tokens, cached_tokens, now - since, backlog))
        self._last_step_end = now
        if self.trace is not None:
            decodes = sum(s.is_decode for s in sched.scheduled)
            self.trace.write(StepRecord(
                end=now,
                interval_s=now - since,
                forward_s=forward_s,
                decodes=decodes,
                prefill_tokens=sched.num_batched_tokens - decodes,
                prefill_seqs=len(sched.scheduled) - decodes,
                admitted=sum(s.admitted for s in sched.scheduled),
                cached_tokens=cached_tokens,
                sampled=len(updates),
                running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting),
                preempted=len(sched.preempted_ids),
                first_gaps=sum(s.is_first_gap for s in sched.scheduled),
            ))
        while self._recent and now - self._recent[0].end > STATS_WINDOW_S:
            self._recent.popleft()
        outputs = [self._process(u, now) for u in updates]
        self._idle = not self.scheduler.has_work  # after the stop strings, which finish requests too
        return outputs

    def _process(self, update: TokenUpdate, now: float) -> RequestOutput:
        request = update.request
        tracked = self._tracked[request.request_id]
        text = ""
        finished = update.finished
        if tracked.detokenizer is not None:
            text = tracked.detokenizer.append(update.new_token_id)
            if tracked.detokenizer.stopped is not None:
                if finished:  # its last allowed token completed the stop string: the text ends there, so "stop"
                    request.status = RequestStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                request.stop_reason = tracked.detokenizer.stopped
                finished = True
            if finished:
                text += tracked.detokenizer.flush()
        logprobs = [self._logprob_entry(update.logprobs)] if update.logprobs is not None else None
        if finished:
            del self._tracked[request.request_id]
            return self._final_output(request, [update.new_token_id], text, logprobs, now)
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=[update.new_token_id],
            new_text=text,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            token_time=now,
            logprobs=logprobs,
        )

    def _final_output(
        self,
        request: Request,
        token_ids: list[int],
        text: str,
        logprobs: list[LogprobEntry] | None,
        now: float | None = None,
    ) -> RequestOutput:
        reason = request.finish_reason
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=token_ids,
            new_text=text,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            token_time=now or time.time(),
            finish_reason=reason,
            stop_reason=request.stop_reason,
            logprobs=logprobs,
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
            finish_time=request.finish_time or now,
            num_preemptions=request.num_preemptions,
            preemption_times=list(request.preemption_times),
            num_cached_tokens=request.num_cached_prompt_tokens,
        )

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else ""

    def _logprob_entry(self, lp: TokenLogprobs) -> LogprobEntry:
        return LogprobEntry(
            token_id=lp.token_id,
            token=self._token_text(lp.token_id),
            logprob=lp.logprob,
            top=[LogprobTop(t, self._token_text(t), v) for t, v in lp.top],
        )

    # ----- reporting -------------------------------------------------------------------

    def stats(self) -> EngineStats:
        usage = self.kv_cache.usage()
        now = time.time()
        window = [w for w in self._recent if now - w.end <= STATS_WINDOW_S]
        # From the start of the window's first step: its tokens are in the sums (from its end, a burst's
        # prefill step followed by one decode read as that prefill done in the decode's time).
        span = (now - (window[0].end - window[0].interval)) if window else 0.0
        rate = sum(w.generated for w in window) / span if span > 0 else 0.0
        # Prompt rates count tokens served, computed or found in the prefix cache, because that is how the
        # work ahead of a request is counted (whole prompts: the gateway's, and the waiting requests' here,
        # whose cache lookup comes when they are admitted). In computed tokens alone, a queue of prompts
        # sharing a 1,000-token cached prefix looked 15x longer than it was, and admission control refused
        # a load the engine served. Served tokens fold the recent cache hit ratio into the rate.
        prompt_rate = sum(w.prompt + w.cached for w in window) / span if span > 0 else 0.0
        busy = [w for w in window if w.backlog]
        busy_s = sum(w.interval for w in busy)
        work: dict[int, int] = {}
        prefill_waiting: dict[int, int] = {}
        for r in self.scheduler.waiting:
            to_compute = r.num_tokens - r.num_computed_tokens  # the prompt, plus outputs after a preemption
            work[r.priority] = work.get(r.priority, 0) + to_compute + r.sampling_params.max_tokens - r.num_output_tokens
            prefill_waiting[r.priority] = prefill_waiting.get(r.priority, 0) + to_compute
        return EngineStats(
            node_id=self.config.node_id,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_blocks_used=usage.num_used,
            kv_blocks_total=usage.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_prefill_chunks=self.scheduler.num_prefill_chunks,
            prefix_cache_hit_rate=self.kv_cache.prefix_hit_rate,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            generation_tokens_per_s=rate,
            steps=self.steps,
            timestamp=now,
            prompt_tokens_per_s=prompt_rate,
            waiting_tokens=self.scheduler.waiting.num_tokens,
            waiting_work_by_priority=work,
            prefill_waiting_by_priority=prefill_waiting,
            prefill_running=sum(max(0, r.num_tokens - r.num_computed_tokens - 1) for r in self.scheduler.running),
            prefill_tokens_per_s=sum(w.prompt + w.cached for w in busy) / busy_s if busy_s > 0 else 0.0,
            max_waiting=self.config.scheduler.max_waiting,
            max_waiting_tokens=self.config.scheduler.max_waiting_tokens,
            forward_s_total=self.group.forward_s if self.group else 0.0,
            collective_s_total=self.group.clock.seconds if self.group else 0.0,
            collective_bytes_total=self.group.clock.bytes if self.group else 0,
        )

    # ----- convenience for tests and benchmarks -----------------------------------------

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion; returns each one's output token ids, in order."""
        all_params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{self.steps}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, all_params, strict=True):
            self.add_request(rid, prompt, p)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished:
            for out in self.step():
                results[out.request_id].extend(out.new_token_ids)
        return [results[rid] for rid in ids]


def default_kv_dtype(dtype_setting: str, model_dtype: torch.dtype, on_cpu: bool, head_dim: int) -> torch.dtype:
    """The KV cache's dtype where EngineConfig.kv_dtype leaves it open: the model's, except where `dtype` is
    "auto" and the model computes in fp32 on the CPU (no native bf16) while Sluice's kernels can attend over a
    bf16 cache: bf16 there, as on the bf16 hosts. Half the bytes every decode step reads: on a 2-core AVX2-only
    EPYC the decode attention over 32 sequences of 125-250 tokens took 21.8 against 31.2 ms, and fresh servers
    served 32 streams 18-22% faster (docs/engine.md, "The AVX2-only EPYC a fourth time"). K and V are rounded
    to bf16 (2^-9 of each value) as stored and read exactly; the eight questions of
    tests/engine/test_numerics.py still agree with Hugging Face fp32 at 1.000. An explicit "float32" keeps the
    cache fp32: fp32 throughout, as asked."""
    fp32_on_cpu = on_cpu and model_dtype == torch.float32
    if dtype_setting == "auto" and fp32_on_cpu and kernels_take_cache(torch.bfloat16, head_dim):
        return torch.bfloat16
    return model_dtype


def _prefill_attention_dtype(setting: str, kv_dtype: torch.dtype) -> torch.dtype:
    if setting in ("float32", "float32-sdpa"):
        return torch.float32
    if setting == "kv":
        return kv_dtype
    raise ValueError(f"prefill_attention_dtype must be one of {PREFILL_ATTENTION_DTYPES}, not {setting!r}")


__all__ = ["LLMEngine", "QueueFullError", "parse_dtype"]
