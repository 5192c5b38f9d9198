"""How long a request refused because an engine's queue is full is told to wait (Retry-After).

From what the engine measured, not from a guess of tokens per request:

    work_ahead   = tokens the waiting requests of priority <= p still have to compute
                   (rest of the prompt + max_tokens not yet generated; EngineStats.waiting_work_by_priority)
    throughput   = tokens the engine computed per second recently (prompt + generation, last 5 s)
    retry_after  = work_ahead / throughput, within [MIN_S, MAX_S]

That is when the queue the client saw has been served, so a retry then meets a queue with room;
a longer queue, or a slower engine, gives a longer wait. With no throughput measured (an engine
that computed nothing for 5 s: just started, or stalled) the answer is UNMEASURED_S.
"""

from __future__ import annotations

from collections.abc import Mapping

MIN_S = 1.0  # Retry-After is whole seconds; never tell a client to retry at once
MAX_S = 60.0  # beyond a minute the estimate says little; the client should look elsewhere meanwhile
UNMEASURED_S = 5.0


def work_ahead(waiting_work_by_priority: Mapping[int, int], priority: int) -> int:
    """Tokens queued ahead of a new request of `priority` (lower = more important; ties go first)."""
    return sum(work for p, work in waiting_work_by_priority.items() if p <= priority)


def retry_after_s(work_ahead_tokens: int, tokens_per_s: float) -> float:
    if tokens_per_s <= 0:
        return UNMEASURED_S
    return max(MIN_S, min(MAX_S, work_ahead_tokens / tokens_per_s))
