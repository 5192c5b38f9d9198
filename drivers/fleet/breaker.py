"""A circuit breaker per worker: stop sending to a worker that keeps failing, probe it later.

    CLOSED --failures_to_open consecutive failures (or one refused connection)--> OPEN
    OPEN   --open_s elapsed--> HALF_OPEN: exactly one request goes through as a probe
    HALF_OPEN --probe succeeds--> CLOSED;  --probe fails--> OPEN again

A success is a stream that delivered its first token (or a clean refusal: the worker answered).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerConfig:
    failures_to_open: int = 2
    """Consecutive failures (timeouts, lost streams) that open the circuit."""
    open_s: float = 5.0
    """How long an open circuit keeps the worker out before one probe request."""


class CircuitBreaker:
    def __init__(self, config: BreakerConfig) -> None:
        self.config = config
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.opened_at = 0.0
        self._probing = False

    def allows(self, now: float) -> bool:
        if self.state is BreakerState.OPEN and now >= self.opened_at + self.config.open_s:
            self.state, self._probing = BreakerState.HALF_OPEN, False
        if self.state is BreakerState.HALF_OPEN:
            return not self._probing
        return self.state is BreakerState.CLOSED

    def picked(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self._probing = True

    def succeeded(self) -> None:
        self.state, self.failures, self._probing = BreakerState.CLOSED, 0, False

    def failed(self, now: float, definite: bool = False) -> None:
        """`definite`: the worker is certainly unreachable now (connection refused): open at once."""
        self.failures += 1
        if definite or self.state is BreakerState.HALF_OPEN or self.failures >= self.config.failures_to_open:
            self.state, self.opened_at, self._probing = BreakerState.OPEN, now, False
