"""Stripe's billing meter API through the official SDK, with every answer turned into a typed outcome.

The SDK's own retries are off (`max_network_retries=0`): the relay owns retrying, with the backoff,
the dead-letter deadline and the bookkeeping in the database that a crash must not lose.

    Stripe answers                                   outcome
    200                                              ACCEPTED
    400 "An event already exists with identifier"    DUPLICATE: an earlier attempt was counted; success
    429, 409 (same key in flight), 5xx, timeout,     RETRY
      connection refused
    a 5xx replayed for our idempotency key           RETRY with a new key: Stripe stores the first answer
                                                     to a key, errors included, so the old key would
                                                     only ever replay it; the identifier de-duplicates
    any other 4xx (validation, unknown customer,     REFUSED: dead-lettered, resending cannot help
      bad key)
"""

from __future__ import annotations

import datetime as dt
import enum
from dataclasses import dataclass
from typing import Any

import stripe

from billing.config import BillingConfig

DUPLICATE_MESSAGE = "already exists with identifier"


class Outcome(enum.StrEnum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    RETRY = "retry"
    REFUSED = "refused"


@dataclass(frozen=True, slots=True)
class SendResult:
    outcome: Outcome
    reason: str = ""  # for RETRY/REFUSED: a metric label ("rate_limited", "server_error", "timeout", ...)
    detail: str = ""  # Stripe's message, for the event's last_error
    new_key: bool = False  # RETRY: the idempotency key is spent on a stored error


@dataclass(frozen=True, slots=True)
class MeterEventToSend:
    event_name: str
    stripe_customer_id: str
    value: int
    timestamp: dt.datetime
    identifier: str
    idempotency_key: str


class StripeMeters:
    def __init__(self, config: BillingConfig) -> None:
        if not config.stripe_api_key:
            raise ValueError("STRIPE_API_KEY is not set")
        self.http = stripe.HTTPXClient(timeout=config.request_timeout_s)
        self.client = stripe.StripeClient(
            config.stripe_api_key,
            base_addresses={"api": config.stripe_api_base},
            http_client=self.http,
            max_network_retries=0,
        )
        self._meter_ids: dict[str, str] = {}

    async def close(self) -> None:
        await self.http.close_async()

    async def send(self, event: MeterEventToSend) -> SendResult:
        params: dict[str, Any] = {
            "event_name": event.event_name,
            "payload": {"stripe_customer_id": event.stripe_customer_id, "value": str(event.value)},
            "identifier": event.identifier,
            "timestamp": int(event.timestamp.timestamp()),
        }
        try:
            await self.client.v1.billing.meter_events.create_async(
                params, {"idempotency_key": event.idempotency_key}  # type: ignore[arg-type]
            )
        except stripe.RateLimitError as exc:
            return SendResult(Outcome.RETRY, "rate_limited", _message(exc))
        except stripe.APIConnectionError as exc:
            return SendResult(Outcome.RETRY, "timeout", _message(exc))
        except stripe.InvalidRequestError as exc:
            if DUPLICATE_MESSAGE in (exc.user_message or str(exc)):
                return SendResult(Outcome.DUPLICATE)
            return SendResult(Outcome.REFUSED, "invalid_request", _message(exc))
        except stripe.IdempotencyError as exc:  # our key reused with other parameters: a bug, not Stripe's
            return SendResult(Outcome.REFUSED, "idempotency", _message(exc))
        except stripe.StripeError as exc:
            status = exc.http_status or 0
            if status == 409 or status >= 500:
                replayed = (exc.headers or {}).get("idempotent-replayed", "").lower() == "true"
                return SendResult(Outcome.RETRY, "server_error" if status >= 500 else "conflict",
                                  _message(exc), new_key=replayed and status >= 500)
            return SendResult(Outcome.REFUSED, f"http_{status}", _message(exc))
        return SendResult(Outcome.ACCEPTED)

    async def meter_id(self, event_name: str) -> str:
        """The id of the active meter with this event_name (summaries are listed per meter id)."""
        if event_name not in self._meter_ids:
            page = await self.client.v1.billing.meters.list_async({"status": "active", "limit": 100})
            async for meter in page.auto_paging_iter():
                self._meter_ids.setdefault(meter.event_name, meter.id)
        if event_name not in self._meter_ids:
            raise LookupError(f"Stripe has no active meter with event_name {event_name!r}")
        return self._meter_ids[event_name]

    async def summed(self, event_name: str, customer: str, start: dt.datetime, end: dt.datetime) -> float:
        """Stripe's aggregated value of a meter for a customer over [start, end) (minute-aligned)."""
        meter = await self.meter_id(event_name)
        page = await self.client.v1.billing.meters.event_summaries.list_async(
            meter,
            {
                "customer": customer,
                "start_time": int(start.timestamp()),
                "end_time": int(end.timestamp()),
                "limit": 100,
            },
        )
        total = 0.0
        async for summary in page.auto_paging_iter():
            total += float(summary.aggregated_value)
        return total


def _message(exc: stripe.StripeError) -> str:
    return f"{exc.http_status or '-'} {exc.user_message or exc}"[:500]
