"""The billing layer's one frozen config, read from the environment once, at the edge."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

DAY_S = 86_400
PROMPT, COMPLETION = "prompt", "completion"  # the two meters a tenant's tokens are billed on


@dataclass(frozen=True)
class BillingConfig:
    prompt_meter: str | None = None
    """Stripe meter `event_name` that prompt tokens are sent to (SLUICE_BILLING_PROMPT_METER); None:
    prompt tokens are not billed through Stripe. The ledger has no cached-prompt count: a cached
    prompt token is a prompt token."""
    completion_meter: str | None = None
    """Stripe meter `event_name` for completion tokens (SLUICE_BILLING_COMPLETION_METER)."""
    window_s: int = 300
    """Usage is summed per tenant, meter and window of this many seconds (by the request's time) into
    one billing event (SLUICE_BILLING_WINDOW_S). Divides a day, so windows align with minutes, days
    and months: what Stripe's meter event summaries need for reconciliation."""
    settle_s: float = 15.0
    """A window is sealed into billing events this long after it ends, so usage still buffered in a
    gateway lands first; usage written later gets an event of its own (SLUICE_BILLING_SETTLE_S)."""
    stripe_api_key: str | None = None
    """Secret key for the Stripe API (STRIPE_API_KEY). Never logged."""
    stripe_api_base: str = "https://api.stripe.com"
    """Base address of the Stripe API (SLUICE_STRIPE_API_BASE): the SDK's `api` base address."""
    relay: bool = True
    """Run the relay as a background task of every gateway (SLUICE_BILLING_RELAY=0: only
    `sluice billing relay` sends). Several relays share the work safely."""
    poll_interval_s: float = 5.0
    """Pause between relay passes when there was nothing to send (SLUICE_BILLING_POLL_S)."""
    batch_size: int = 100
    """Events one relay claims per pass."""
    concurrency: int = 8
    """Requests to Stripe in flight at once per relay."""
    request_timeout_s: float = 10.0
    """One request to Stripe may take this long before it counts as a timeout (SLUICE_BILLING_TIMEOUT_S)."""
    lease_s: float = 60.0
    """A claimed event is the claiming relay's for this long; a relay that dies holding it loses it
    then, and another relay resends it (same identifier and idempotency key) (SLUICE_BILLING_LEASE_S).
    Must exceed request_timeout_s."""
    retry_initial_s: float = 1.0
    """First wait after a retryable failure (429, 5xx, timeout); doubles per failure, with full jitter."""
    retry_max_s: float = 300.0
    """Longest wait between two attempts of one event."""
    dedup_horizon_s: float = 23 * 3600.0
    """Stripe enforces identifier uniqueness over a rolling 24 h (at least): an event still failing
    this long after its first attempt is dead-lettered, since a resend could then count twice."""
    max_event_age_s: float = 35 * DAY_S - 3600.0
    """Stripe refuses timestamps older than 35 days: an event whose window is older is dead-lettered
    (reconciliation can still bill it inside the period, within the 35 days)."""

    @property
    def meters(self) -> dict[str, str]:
        """Our meter key ("prompt", "completion") -> the Stripe meter's event_name, configured ones only."""
        named = {PROMPT: self.prompt_meter, COMPLETION: self.completion_meter}
        return {key: name for key, name in named.items() if name}

    @property
    def enabled(self) -> bool:
        """Whether usage is written to the billing outbox at all."""
        return bool(self.meters)

    @property
    def can_send(self) -> bool:
        return self.enabled and bool(self.stripe_api_key)

    def __post_init__(self) -> None:
        if self.window_s < 60 or DAY_S % self.window_s or self.window_s % 60:
            raise ValueError("SLUICE_BILLING_WINDOW_S must be a whole number of minutes that divides a day")
        if self.lease_s <= self.request_timeout_s:
            raise ValueError("SLUICE_BILLING_LEASE_S must exceed SLUICE_BILLING_TIMEOUT_S")
        for name in (self.prompt_meter, self.completion_meter):
            if name is not None and not 0 < len(name) <= 100:
                raise ValueError("a Stripe meter event_name has 1 to 100 characters")

    def __repr__(self) -> str:  # keep the key out of logs
        return f"BillingConfig(meters={self.meters!r}, window_s={self.window_s}, api={self.stripe_api_base!r})"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> BillingConfig:
        e = os.environ if env is None else env
        d = cls()
        return cls(
            prompt_meter=e.get("SLUICE_BILLING_PROMPT_METER") or None,
            completion_meter=e.get("SLUICE_BILLING_COMPLETION_METER") or None,
            window_s=int(e.get("SLUICE_BILLING_WINDOW_S", d.window_s)),
            settle_s=float(e.get("SLUICE_BILLING_SETTLE_S", d.settle_s)),
            stripe_api_key=e.get("STRIPE_API_KEY") or None,
            stripe_api_base=e.get("SLUICE_STRIPE_API_BASE") or d.stripe_api_base,
            relay=e.get("SLUICE_BILLING_RELAY", "1").lower() not in ("0", "false", "off", "no"),
            poll_interval_s=float(e.get("SLUICE_BILLING_POLL_S", d.poll_interval_s)),
            request_timeout_s=float(e.get("SLUICE_BILLING_TIMEOUT_S", d.request_timeout_s)),
            lease_s=float(e.get("SLUICE_BILLING_LEASE_S", d.lease_s)),
        )
