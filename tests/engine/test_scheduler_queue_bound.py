"""The waiting queue's token bound, without a model: a burst of long prompts is refused, not queued."""

from __future__ import annotations

import pytest
from test_scheduler import make_request, make_scheduler, run_step

from engine_native.request import RequestStatus
from engine_native.scheduler import QueueFullError


def test_token_bound_refuses_past_the_bound_and_admits_again_once_drained() -> None:
    s = make_scheduler(max_num_seqs=1, max_waiting=100, max_waiting_tokens=100)
    for i in range(4):
        s.add_request(make_request(f"r{i}", 25))
    assert s.waiting.num_tokens == 100
    with pytest.raises(QueueFullError, match="tokens"):
        s.add_request(make_request("over", 1))
    assert "over" not in s.requests
    run_step(s)  # r0 starts running: its tokens leave the queue
    assert s.waiting.num_tokens == 75
    s.add_request(make_request("fits", 25))
    assert s.waiting.num_tokens == 100


def test_a_prompt_longer_than_the_bound_is_admitted_to_an_empty_queue() -> None:
    s = make_scheduler(max_waiting_tokens=10)
    s.add_request(make_request("long", 50))  # refusing it forever would make it unservable
    with pytest.raises(QueueFullError):
        s.add_request(make_request("next", 5))


def test_token_count_follows_aborts_and_preemptions() -> None:
    s = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4, max_waiting_tokens=1000)
    s.add_request(make_request("low", 8, max_tokens=12, priority=2))
    run_step(s)
    s.add_request(make_request("a", 4))
    s.add_request(make_request("b", 4))
    assert s.waiting.num_tokens == 8
    s.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert s.waiting.num_tokens == 4
    for _ in range(30):
        if not s.has_work:
            break
        run_step(s)
        assert s.waiting.num_tokens == sum(r.num_tokens for r in s.waiting)
    assert s.waiting.num_tokens == 0


def test_no_token_bound() -> None:
    s = make_scheduler(max_waiting=1000, max_waiting_tokens=None)
    for i in range(50):
        s.add_request(make_request(f"r{i}", 100))
    assert s.waiting.num_tokens == 5000
