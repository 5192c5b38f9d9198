"""The engine supervisor's restart decisions, driven by an injected clock (no processes, no sleeps)."""

from __future__ import annotations

import pytest

from drivers.supervisor import RestartBudget, RestartPolicy

POLICY = RestartPolicy(backoff_initial_s=1.0, backoff_max_s=8.0, backoff_reset_after_s=60.0,
                       max_failures=100, failure_window_s=300.0)


def test_backoff_doubles_up_to_its_cap() -> None:
    budget = RestartBudget(POLICY)
    now, delays = 0.0, []
    for _ in range(6):
        delay = budget.on_failure(now, up_since=None)  # each restart fails at once
        assert delay is not None
        delays.append(delay)
        now += delay
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_an_engine_that_stayed_up_starts_from_the_initial_backoff_again() -> None:
    budget = RestartBudget(POLICY)
    assert budget.on_failure(0.0, up_since=None) == 1.0
    assert budget.on_failure(10.0, up_since=5.0) == 2.0  # up 5 s: still the same streak
    assert budget.on_failure(100.0, up_since=30.0) == 1.0  # up 70 s >= 60 s: a new streak


def test_too_many_deaths_within_the_window_is_a_crash_loop() -> None:
    budget = RestartBudget(RestartPolicy(max_failures=3, failure_window_s=100.0, backoff_reset_after_s=1e9))
    assert budget.on_failure(0.0, None) is not None
    assert budget.on_failure(10.0, 5.0) is not None
    assert budget.on_failure(20.0, 15.0) is None  # the third within 100 s: give up


def test_deaths_spread_wider_than_the_window_never_give_up() -> None:
    budget = RestartBudget(RestartPolicy(max_failures=3, failure_window_s=100.0))
    for i in range(20):
        assert budget.on_failure(i * 60.0, up_since=i * 60.0 - 55.0) is not None  # at most 2 per 100 s


def test_a_policy_that_could_never_restart_is_refused() -> None:
    with pytest.raises(ValueError):
        RestartPolicy(max_failures=0)
    with pytest.raises(ValueError):
        RestartPolicy(backoff_initial_s=10.0, backoff_max_s=1.0)
