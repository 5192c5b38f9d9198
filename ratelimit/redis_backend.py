"""The Redis rate limiter: per-tenant buckets shared by every gateway replica.

Each admission is one EVALSHA of `lua.ADMIT`, which refills, checks and
charges both buckets and the concurrency lease set atomically on Redis' clock;
each release is one EVALSHA of `lua.RELEASE`. The key layout, the bucket math
and the exactly-once rules are drawn in `ratelimit/lua.py`.

Outages (connection refused, timeouts, any Redis error) never escape:
`FailMode.OPEN` admits with `degraded=True`, `FailMode.CLOSED` refuses with
`refused_by="unavailable"`, `retry_after_s=1`. Each outage logs one warning
when it starts and one info line when Redis answers again, and every failed
call is counted in `backend_errors` (an int the gateway may export) and, when a
prometheus `CollectorRegistry` is passed, in `ratelimit_backend_errors_total{operation}`.

Nothing an outage interrupts stays held: an admit whose answer is lost (a
timeout after the script ran, or a caller cancelled mid-call) is rolled back
by its request id when it was not handed to the caller as admitted, and a
release that fails is retried in the background (`ratelimit.pending`) until
Redis answers or the lease has ended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from ratelimit import lua
from ratelimit.base import DEFAULT_LEASE_S, Admission, FailMode, RateLimiter, Reservation, TenantLimits
from ratelimit.buckets import CONCURRENCY_RETRY_S, never_admissible
from ratelimit.headers import ratelimit_headers
from ratelimit.pending import ReleaseRetrier, RetryPolicy

log = logging.getLogger("sluice.ratelimit")

_REFUSED_BY = {1: "requests", 2: "tokens", 3: "concurrency", 4: "released"}
# What a CLOSED limiter tells clients while Redis is away.
UNAVAILABLE_RETRY_S = 1.0
_BACKEND_ERRORS = (RedisError, OSError, TimeoutError)


def _redacted(url: str) -> str:
    """The URL without credentials, for logs."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


class RedisRateLimiter(RateLimiter):
    """Token buckets (requests, tokens) and leased concurrency slots per tenant, in Redis."""

    def __init__(
        self,
        url: str,
        fail_mode: FailMode = FailMode.OPEN,
        key_prefix: str = "sluice:rl:",
        timeout_s: float = 0.25,
        lease_s: float = DEFAULT_LEASE_S,
        registry: CollectorRegistry | None = None,
        retry: RetryPolicy | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """
        `timeout_s` bounds every Redis call (connect and reply); past it the call counts as an outage.
        `lease_s` is how long an admitted request holds its slots if it is never released (its
        replica died): longer than any request may run (see `ratelimit.base.lease_for`).
        `registry`: where to register `ratelimit_backend_errors_total`; None keeps only `backend_errors`.
        `retry`: how failed releases are retried (None: `RetryPolicy()`).
        `clock` (seconds): None uses Redis' own clock, which replicas share; tests pass one they move
        by hand.
        """
        self.fail_mode = fail_mode
        self.key_prefix = key_prefix
        self.timeout_s = timeout_s
        self.lease_s = lease_s
        self._clock = clock
        self.backend_errors = 0
        self._url = _redacted(url)
        self._healthy = True
        self._outage_errors = 0
        # No retries: a limiter that waits out an outage adds its latency to every request.
        self._redis: Redis = Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        # register_script: EVALSHA, and a transparent SCRIPT LOAD after a Redis restart.
        self._admit_script = self._redis.register_script(lua.ADMIT)
        self._release_script = self._redis.register_script(lua.RELEASE)
        self._retrier = ReleaseRetrier(self._try_release, lease_s, retry or RetryPolicy())
        self._errors_counter: Counter | None = None
        if registry is not None:
            self._errors_counter = Counter(
                "ratelimit_backend_errors_total",
                "Rate-limit backend calls that failed (unreachable, timeout, error).",
                ["operation"],
                registry=registry,
            )

    @property
    def releases_pending(self) -> int:
        """Releases waiting for Redis to answer (retried in the background)."""
        return self._retrier.pending

    @property
    def releases_abandoned(self) -> int:
        """Releases given up on (their lease ended first, or too many waited): their refunds are lost."""
        return self._retrier.abandoned

    def _keys(self, tenant_id: str) -> tuple[str, str, str, str, str]:
        """req, tok, flight, seqs, done (drawn in `ratelimit.lua`)."""
        base = f"{self.key_prefix}{{{tenant_id}}}"
        return f"{base}:req", f"{base}:tok", f"{base}:flight", f"{base}:seqs", f"{base}:done"

    def _now_ms(self) -> float:
        return -1.0 if self._clock is None else round(self._clock() * 1000, 3)

    async def admit(
        self, tenant_id: str, request_id: str, limits: TenantLimits, tokens: int, sequences: int = 1
    ) -> Admission:
        tokens, sequences = max(0, tokens), max(1, sequences)
        reservation = Reservation(tenant_id, request_id, tokens, limits, sequences)
        if limits == TenantLimits():
            return Admission(True, reservation=reservation)
        args: list[str | int | float] = [
            _arg(limits.requests_per_minute),
            _arg(limits.tokens_per_minute),
            _arg(limits.max_concurrent),
            tokens,
            request_id,
            round(self.lease_s * 1000),
            round(CONCURRENCY_RETRY_S * 1000),
            sequences,
            self._now_ms(),
        ]
        try:
            async with asyncio.timeout(self.timeout_s * 2):
                reply = await self._admit_script(keys=self._keys(tenant_id), args=args)
        except asyncio.CancelledError:
            # The caller is gone (a client disconnect) and the script may have run, or may yet run
            # from a socket buffer: give back by id whatever it charges.
            self._retrier.add(reservation, tokens)
            raise
        except _BACKEND_ERRORS as exc:
            self._failed("admit", exc)
            if self.fail_mode is FailMode.OPEN:
                return Admission(True, reservation=reservation, degraded=True)  # the caller releases it
            self._retrier.add(reservation, tokens)  # refused, so nobody else will release what it charged
            return Admission(
                False,
                refused_by="unavailable",
                retry_after_s=UNAVAILABLE_RETRY_S,
                degraded=True,
                message="rate limiting is unavailable; retry shortly",
            )
        self._succeeded()

        refused, never, retry_ms, req_left, req_reset_ms, tok_left, tok_reset_ms = (int(x) for x in reply)
        headers = ratelimit_headers(limits, req_left, req_reset_ms / 1000, tok_left, tok_reset_ms / 1000)
        if refused == 0:
            return Admission(True, reservation=reservation, headers=headers)
        if refused == 4:
            message: str | None = (
                f"request {request_id} was released before it was admitted: nothing is charged"
            )
        else:
            verdict = never_admissible(limits, tokens, sequences) if never else None
            message = verdict.message if verdict else None
        return Admission(
            False,
            refused_by=_REFUSED_BY[refused],
            retry_after_s=retry_ms / 1000,
            headers=headers,
            message=message,
        )

    async def release(self, reservation: Reservation, tokens_used: int) -> None:
        if reservation.limits == TenantLimits():
            return
        refund = max(0, reservation.tokens - max(0, tokens_used))
        try:
            landed = await self._try_release(reservation, refund)
        except asyncio.CancelledError:
            self._retrier.add(reservation, refund)
            raise
        if not landed:
            self._retrier.add(reservation, refund)

    async def _try_release(self, reservation: Reservation, refund: int) -> bool:
        """One RELEASE; False (counted, logged once per outage) when Redis did not answer in time."""
        _, tok_key, flight_key, seqs_key, done_key = self._keys(reservation.tenant_id)
        args: list[str | int | float] = [
            _arg(reservation.limits.tokens_per_minute),
            refund,
            reservation.request_id,
            round(self.lease_s * 1000),
            self._now_ms(),
        ]
        try:
            async with asyncio.timeout(self.timeout_s * 2):
                await self._release_script(keys=[tok_key, flight_key, seqs_key, done_key], args=args)
        except _BACKEND_ERRORS as exc:
            self._failed("release", exc)
            return False
        self._succeeded()
        return True

    async def close(self) -> None:
        """Deliver what releases it can (one last round), then disconnect."""
        await self._retrier.close()
        try:
            await self._redis.aclose()
        except _BACKEND_ERRORS:
            pass

    def _failed(self, operation: str, exc: BaseException) -> None:
        self.backend_errors += 1
        self._outage_errors += 1
        if self._errors_counter is not None:
            self._errors_counter.labels(operation=operation).inc()
        if self._healthy:
            self._healthy = False
            log.warning(
                "ratelimit backend unreachable",
                extra={
                    "backend": "redis",
                    "url": self._url,
                    "operation": operation,
                    "error": type(exc).__name__,
                    "detail": str(exc)[:200],
                    "fail_mode": str(self.fail_mode),
                },
            )

    def _succeeded(self) -> None:
        if not self._healthy:
            self._healthy = True
            log.info(
                "ratelimit backend recovered",
                extra={"backend": "redis", "url": self._url, "failed_calls": self._outage_errors},
            )
            self._outage_errors = 0


def _arg(limit: int | None) -> int:
    """A limit as a script argument: -1 for unlimited."""
    return -1 if limit is None else limit
