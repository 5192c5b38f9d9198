"""Usage billing with Stripe meters: the outbox written beside the usage ledger, the relay that sends
it, and reconciliation against Stripe's meter event summaries. See docs/billing.md."""
