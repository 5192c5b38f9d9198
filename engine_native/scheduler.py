"""Continuous batching: decides, every step, which requests compute how many tokens.

One rule drives everything (see `request.py`): a scheduled request computes
some of its `num_tokens - num_computed_tokens`, capped by the step's token
budget and the per-request chunk limit. Running requests go first (decodes
and unfinished prefill chunks), then waiting ones join while budget, the
running-sequence cap and KV blocks allow. When a running request cannot get
blocks, the least important running request (highest priority value, latest
arrival) is preempted: by recompute (its blocks are freed and it goes back to
the waiting queue with `num_computed_tokens = 0`), or, with a host swap pool
(swap.py), by swap (its KV blocks are copied to the host pool and it keeps its
progress; admitted again, it gets fresh device blocks and the copies back).

A request samples a token only in a step that computes up to its last known
token; so recompute after preemption never repeats or drops a token.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from engine_native.config import SchedulerConfig, default_prompt_order_ms_per_token
from engine_native.errors import QueueFullError
from engine_native.fair_queue import FairShare, WaitingQueue, tenant_of
from engine_native.kv_cache_manager import KVCacheManager, PrefixLookup, cdiv
from engine_native.request import Request, RequestStatus
from engine_native.sampler import TokenLogprobs
from engine_native.stop import check_stop_token
from engine_native.swap import BlockCopies, SwapPolicy


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # Tokens already in the cache before this step (num_computed_tokens at schedule time).
    num_computed_before: int
    # Whether this step computes through the request's last known token, so it samples the next.
    # Fixed at schedule time: the request's token count grows once the step's token is appended.
    samples: bool = False
    # Tokens found in the prefix cache when the request was admitted this step (0 otherwise): served
    # without being computed, so the engine's prefill rate counts them (engine.py, stats()).
    num_cached: int = 0
    # It joined the running set in this step (new, or back after a preemption).
    admitted: bool = False

    @classmethod
    def of(
        cls, request: Request, num_new_tokens: int, num_cached: int = 0, admitted: bool = False
    ) -> ScheduledRequest:
        before = request.num_computed_tokens
        return cls(request, num_new_tokens, before, before + num_new_tokens == request.num_tokens, num_cached, admitted)

    @property
    def is_decode(self) -> bool:
        """One token after the request's prompt: its last sampled one."""
        return self.samples and self.num_new_tokens == 1 and self.num_computed_before >= self.request.num_prompt_tokens

    @property
    def is_first_gap(self) -> bool:
        """A decode right after the request's first token: the step's interval is its first inter-token gap."""
        return self.is_decode and self.num_computed_before == self.request.num_prompt_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # KV block copies to issue before this step's forward, swap-outs first (swap.py).
    swap_out: BlockCopies = field(default_factory=list)  # (device block, host block)
    swap_in: BlockCopies = field(default_factory=list)  # (host block, device block)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class RunnerOutput:
    """What the model runner hands back: one sampled token per sampling request."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)


@dataclass
class TokenUpdate:
    """One request's progress from a step: a new token, and whether it finished."""

    request: Request
    new_token_id: int
    logprobs: TokenLogprobs | None
    finished: bool


def _decodes(request: Request) -> bool:
    """Its next computed token is its last sampled one: a decode, not prompt work (a prompt's last
    token, or a recomputed request's, is prompt work until the request has sampled)."""
    return request.num_tokens_to_compute == 1 and request.num_output_tokens > 0


def _victim_order(request: Request) -> tuple[int, float]:
    """Larger = preempted first: least important priority, then most recent arrival."""
    return (request.priority, request.arrival_time)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        max_model_len: int,
        swap: SwapPolicy | None = None,
        device_type: str = "cpu",
    ) -> None:
        """`swap`: preempt to a host pool where it says so; None: every preemption recomputes. `device_type`:
        where the steps run ("cpu", "cuda"), for the defaults that depend on it."""
        self.config = config
        self.swap = swap
        self.num_swaps = 0  # preemptions that swapped out instead of recomputing
        self._swap_out: BlockCopies = []
        self._swap_in: BlockCopies = []
        self._swapped_in_now: set[str] = set()
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.fair_share = FairShare(config.tenant_weights)
        order_ms = config.prompt_order_ms_per_token
        if order_ms is None:
            order_ms = default_prompt_order_ms_per_token(device_type)
        if not 0 <= order_ms < math.inf:  # also refuses nan
            raise ValueError(f"prompt_order_ms_per_token must be a finite number, 0 or more, not {order_ms}")
        self.waiting = WaitingQueue(self.fair_share, order_ms / 1000)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_prefill_chunks = 0
        self.num_prefix_waits = 0  # admissions put off a step for a prefix another request computes

    # ----- admission -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; raises ValueError if it can never run, QueueFullError if the queue is full."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        n_prompt = request.num_prompt_tokens
        if n_prompt == 0:
            raise ValueError("the prompt is empty")
        if n_prompt >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n_prompt} tokens; the context length is {self.max_model_len}"
            )
        # A request alone must always fit in the pool, or preemption could never make room.
        worst_case = min(n_prompt + request.sampling_params.max_tokens, self.max_model_len)
        if cdiv(worst_case, self.kv_cache.block_size) > self.kv_cache.num_blocks:
            raise ValueError(
                f"prompt ({n_prompt}) + max_tokens ({request.sampling_params.max_tokens}) need "
                f"{cdiv(worst_case, self.kv_cache.block_size)} KV blocks; the pool has {self.kv_cache.num_blocks}"
            )
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_waiting} requests)")
        token_bound = self.config.max_waiting_tokens
        if token_bound is not None and len(self.waiting) and self.waiting.num_tokens + n_prompt > token_bound:
            raise QueueFullError(
                f"the waiting queue is full ({self.waiting.num_tokens} + {n_prompt} tokens > {token_bound})"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request from outside the step (abort, stop string); frees its blocks."""
        assert status.is_finished
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        request.finish_time = time.time()
        self.kv_cache.free(request_id)
        if self.swap is not None:
            self.swap.space.free(request_id)
        return request

    @property
    def has_work(self) -> bool:
        return bool(self.running or len(self.waiting))

    # ----- one step --------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self.swap is not None:
            self.swap.space.end_step()  # the last step's copies were issued before its forward
        out = self._schedule()
        out.swap_out, out.swap_in = self._swap_out, self._swap_in
        self._swap_out, self._swap_in = [], []
        self._swapped_in_now.clear()
        return out

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._step_budget()
        # Most important first, so the tail holds the preemption victims.
        self.running.sort(key=_victim_order)

        # A request more important than everything running gets a step of its own for its first
        # chunk: its time to first token is then one prefill, not a prefill plus everyone's decodes.
        # The running requests miss one step; later chunks share steps as usual.
        if self.running and len(self.waiting):
            least_running = min(r.priority for r in self.running)
            if self.waiting.peek().priority < least_running:
                self._admit_waiting(out, budget, below_priority=least_running)
                if out.scheduled:
                    return out

        prefill_left = self._prefill_allowance(budget)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n_new = min(request.num_tokens_to_compute, self.config.long_prefill_token_threshold, budget)
            prompt_work = not _decodes(request)
            if prompt_work:
                n_new = min(n_new, prefill_left)
                if n_new == 0:  # the step's prompt allowance is spent: this chunk waits a step
                    i += 1
                    continue
            total = request.num_computed_tokens + n_new
            while self.kv_cache.allocate_slots(request.request_id, total) is None:
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest.of(request, n_new))
                budget -= n_new
                if prompt_work:
                    prefill_left -= n_new
                i += 1
                continue
            break  # the request preempted itself: nothing after it can fit either

        # New work joins only if nothing had to be preempted for room this step (it would take the
        # blocks just freed and thrash); a more important request gets its turn next step.
        if not out.preempted_ids:
            self._admit_waiting(out, min(budget, prefill_left))
        return out

    def _step_budget(self) -> int:
        """`max_num_batched_tokens`, or `wave_budget_factor` times it while requests wait and at most one
        running request decodes: the start of a wave, whose bigger step stalls one stream at most."""
        budget = self.config.max_num_batched_tokens
        if self.config.wave_budget_factor > 1 and len(self.waiting) and sum(map(_decodes, self.running)) <= 1:
            return budget * self.config.wave_budget_factor
        return budget

    def _prefill_allowance(self, budget: int) -> int:
        """Prompt tokens this step may compute: all of the budget, unless more than twice as many requests
        are decoding as have prompt work, and `prefill_tokens_beside_decodes` caps what the decoders wait for.

        Prompt work computed now stalls every decoder; prompt work put off delays the requests whose
        prompts it is. So the cap holds only where it spares many more streams than it delays: a steady
        mixed load (~30 decoders, a few prompts arriving) is capped; the rest of a wave of prompts is not
        (16 decoders that have just started and 16 prompts left, or 17 and 15, or 20 and 12), and the wave
        ends in one step instead of being spread over several. A wave split once more runs, finishes and
        is replaced in one more group, and every replacement group's prompts stall the other groups'
        decodes: at 32 streams of 128/128 four groups put ~100 of 8,128 gaps at 0.3-1.3 s, past the
        1% of the ITL p99 (310-331 ms), three keep them under it (64-94 ms; docs/engine.md). Where the
        decoders outnumber the prompts only 1-2x the stall the cap spares is smaller than the group it
        adds. The cap also yields to the
        backlog: a 1/`prefill_backlog_steps` share of the prompt tokens still to compute (partly
        prefilled and waiting requests), so that when prompts arrive faster than the cap computes them,
        prefill keeps up instead of their time to first token growing without bound."""
        cap = self.config.prefill_tokens_beside_decodes
        if cap is None:
            return budget
        prompting = [r for r in self.running if not _decodes(r)]
        decoding = len(self.running) - len(prompting)
        if decoding <= 2 * (len(prompting) + len(self.waiting)):
            return budget
        backlog = self.waiting.num_tokens + sum(r.num_tokens_to_compute for r in prompting)
        return min(budget, max(cap, backlog // self.config.prefill_backlog_steps))

    def _admit_waiting(self, out: SchedulerOutput, budget: int, below_priority: int | None = None) -> None:
        """Move waiting requests (only those with priority < `below_priority`, if given) into the
        step while budget, the running cap and blocks allow; at the cap or out of blocks, a more
        important request preempts less important running ones."""
        chunk_cap = self.config.long_prefill_token_threshold
        while len(self.waiting) and budget > 0:
            request = self.waiting.peek()
            if below_priority is not None and request.priority >= below_priority:
                return
            if len(self.running) >= self.config.max_num_seqs:
                restored = self._preempt_less_important(request, out)
                if restored is None:
                    return
                budget += restored
                continue
            # Waiting requests hold no device blocks (new, preempted, swapped out): a swapped one resumes
            # where it stopped, the others start from their cached prefix. Looked up once there is room:
            # it hashes the whole prompt.
            swapped = self.swap is not None and self.swap.space.holds(request.request_id)
            lookup = PrefixLookup([], [], None)
            if self.kv_cache.enable_prefix_caching and not swapped:
                lookup = self.kv_cache.lookup_prefix(
                    request.token_ids_slice(0, request.num_tokens), self.kv_cache.salt(request.tenant_id)
                )
                if self._computing_elsewhere(lookup, request):
                    # A running request is computing the next blocks of this prompt (a burst of requests
                    # sharing a system prompt): wait the step or few until they are cached rather than
                    # compute them again. Those behind it in the queue wait too: strict order.
                    self.num_prefix_waits += 1
                    return
            cached = lookup.blocks
            start = request.num_computed_tokens if swapped else len(cached) * self.kv_cache.block_size
            n_new = min(request.num_tokens - start, chunk_cap, budget)
            if self.kv_cache.allocate_slots(request.request_id, start + n_new, cached) is None:
                restored = self._preempt_less_important(request, out)
                if restored is None:
                    return
                budget += restored
                continue
            if swapped:
                assert self.swap is not None
                table = self.kv_cache.block_table(request.request_id)
                self._swap_in.extend(self.swap.space.swap_in(request.request_id, table))
                self._swapped_in_now.add(request.request_id)
            request.num_computed_tokens = start
            if self.kv_cache.enable_prefix_caching and not swapped:
                self.kv_cache.record_prefix_lookup(request.num_tokens, start)
                self.kv_cache.note_in_flight(request.request_id, lookup.uncached)
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
                request.num_cached_prompt_tokens = min(start, request.num_prompt_tokens)  # usage's cached_tokens
            self.running.append(request)
            out.scheduled.append(ScheduledRequest.of(request, n_new, 0 if swapped else start, admitted=True))
            budget -= n_new

    def _computing_elsewhere(self, lookup: PrefixLookup, request: Request) -> bool:
        """Whether another request, running, computes the first block of `request`'s prompt that
        the cache lacks (one preempted or finished has let go of its blocks in flight)."""
        owner = self.requests.get(lookup.in_flight_by) if lookup.in_flight_by is not None else None
        return owner is not None and owner is not request and owner.status == RequestStatus.RUNNING

    def _preempt_less_important(self, request: Request, out: SchedulerOutput) -> int | None:
        """Preempt the least important running request if it is strictly less important than
        `request`; un-schedule it if it was scheduled this step. Returns the step tokens given back,
        or None when there is no such request."""
        candidates = [r for r in self.running if r.priority > request.priority]
        if not candidates:
            return None
        victim = max(candidates, key=_victim_order)
        restored = 0
        for i, s in enumerate(out.scheduled):
            if s.request is victim:
                restored = s.num_new_tokens
                del out.scheduled[i]
                break
        self._preempt(victim)
        out.preempted_ids.append(victim.request_id)
        return restored

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        if not self._swap_out_blocks(request):
            request.num_computed_tokens = 0
        self.kv_cache.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        request.preemption_times.append(time.time())
        self.num_preemptions += 1
        self.waiting.push(request)

    def _swap_out_blocks(self, request: Request) -> bool:
        """Record the copies of the request's computed blocks to the host pool, when the policy says
        swap; False: it recomputes. One swapped in this very step recomputes instead: its copies
        back have not run, so its device blocks hold nothing yet (they are dropped)."""
        rid = request.request_id
        table = self.kv_cache.block_table(rid)
        if rid in self._swapped_in_now:
            mine = set(table)
            self._swap_in = [(h, d) for h, d in self._swap_in if d not in mine]
            return False
        computed = table[: cdiv(request.num_computed_tokens, self.kv_cache.block_size)]
        if self.swap is None or not self.swap.should_swap(request.num_computed_tokens, len(computed)):
            return False
        copies = self.swap.space.swap_out(rid, computed)
        if copies is None:
            return False
        self._swap_out.extend(copies)
        self.num_swaps += 1
        return True

    def update_from_output(self, sched: SchedulerOutput, result: RunnerOutput) -> list[TokenUpdate]:
        updates: list[TokenUpdate] = []
        now = time.time()
        for s in sched.scheduled:
            request = s.request
            request.num_computed_tokens = s.num_computed_before + s.num_new_tokens
            # Charge only tokens computed for the first time: a recompute after preemption is the
            # engine's choice, not more service to the tenant (nor is a cached prefix, never computed).
            first_time = request.num_computed_tokens - max(s.num_computed_before, request.max_computed_tokens)
            if first_time > 0:
                self.fair_share.charge(tenant_of(request), first_time)
                request.max_computed_tokens = request.num_computed_tokens
            self.kv_cache.cache_full_blocks(
                request.request_id,
                request.num_computed_tokens,
                request.token_ids_slice,
                self.kv_cache.salt(request.tenant_id),
            )
            if not s.samples:
                self.num_prefill_chunks += 1
                request.num_prefill_chunks += 1
                continue
            token = result.sampled_token_ids[request.request_id]
            request.output_token_ids.append(token)
            if request.first_token_time is None:
                request.first_token_time = now
            finished = self._check_stop(request, token)
            if finished:
                self.running.remove(request)
                self.requests.pop(request.request_id, None)
                request.finish_time = now
                self.kv_cache.free(request.request_id)
            updates.append(TokenUpdate(request, token, result.logprobs.get(request.request_id), finished))
        return updates

    def _check_stop(self, request: Request, token: int) -> bool:
        reason = check_stop_token(token, request.sampling_params, request.eos_token_ids, request.num_output_tokens)
        if reason == "stop":
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token
            return True
        if reason == "length" or request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
