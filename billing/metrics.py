"""The relay's counters and the outbox's state as Prometheus metrics, read at scrape time (no query
per scrape: the state is the one the relay's last pass read)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from billing.models import EventStatus
from billing.relay import BillingRelay


class BillingRelayCollector(Collector):
    def __init__(self, relay: BillingRelay) -> None:
        self.relay = relay

    def collect(self) -> Iterator[Metric]:
        r = self.relay
        yield CounterMetricFamily("sluice_billing_events_sent", "Billing events Stripe counted", value=r.sent)
        yield CounterMetricFamily(
            "sluice_billing_duplicates",
            "Sends Stripe answered 'identifier already exists' (an earlier attempt was counted)",
            value=r.duplicates,
        )
        yield CounterMetricFamily(
            "sluice_billing_dead_lettered", "Billing events given up on (see /admin/billing)", value=r.dead_lettered
        )
        failures = CounterMetricFamily(
            "sluice_billing_send_failures", "Failed sends to Stripe, by reason", labels=["reason"]
        )
        for reason, count in sorted(r.failures.items()):
            failures.add_metric([reason], count)
        yield failures
        state, at = r.state, r.state_at
        if state is None or at is None:
            return
        events = GaugeMetricFamily("sluice_billing_events", "Billing events by status", labels=["status"])
        for status in EventStatus:
            events.add_metric([status.value], state.events.get(status.value, (0, 0))[0])
        yield events
        yield GaugeMetricFamily(
            "sluice_billing_unsealed_lines", "Ledger lines of linked tenants not in an event yet",
            value=state.unsealed_lines,
        )
        oldest = [t for t in (state.oldest_pending_at, state.oldest_unsealed_window) if t is not None]
        lag = max(0.0, (at - min(oldest)).total_seconds()) if oldest else 0.0
        yield GaugeMetricFamily(
            "sluice_billing_lag_seconds",
            "Age of the oldest usage not yet at Stripe (pending event or unsealed window), at the last pass",
            value=lag,
        )
