// Billing: a tenant's billed usage per day (what Stripe counted, what is on its way) and, for the
// admin, the relay's state (events pending, sent, dead-lettered; lag). Shapes: docs/billing.md.

import { fmtInt, fmtTime, h, replace } from "./dom.js";
import { api, windowStart } from "./api.js";

const STATES = ["sent", "pending", "unsealed", "dead", "adjusted"];

function stat(metric, label, value, text = fmtInt(value)) {
  return h("div", { class: "card stat", "data-metric": metric, "data-value": value },
    h("div", { class: "stat-label" }, label), h("div", { class: "stat-value" }, text));
}

/** `url`: "/v1/billing" (the tenant's own) or "/admin/tenants/{id}/billing". */
export async function billedPanel(url, days) {
  const billed = await api(`${url}?start=${encodeURIComponent(windowStart(days))}`);
  const total = (state) => billed.data.reduce((a, d) => a + d[state], 0);
  const rows = billed.data.map((d) => h("tr", { "data-day": d.day, "data-meter": d.meter },
    h("td", {}, d.day), h("td", {}, d.meter),
    STATES.map((s) => h("td", { class: "num", "data-state": s, "data-value": d[s] }, fmtInt(d[s])))));
  return h("div", { "data-view": "billed-usage" },
    h("div", { class: "stats" },
      stat("billed_sent", "Tokens billed (Stripe counted)", total("sent")),
      stat("billed_on_the_way", "Tokens on their way", total("pending") + total("unsealed")),
      stat("billed_dead", "Tokens held back (dead-lettered)", total("dead"))),
    h("table", { class: "card", "data-table": "billed-usage" },
      h("thead", {}, h("tr", {}, ["Day (UTC)", "Meter", ...STATES.map((s) => s[0].toUpperCase() + s.slice(1))].map((c) => h("th", {}, c)))),
      h("tbody", {}, rows.length ? rows : h("tr", {}, h("td", { colspan: 7, class: "muted" }, "No billed usage in this range")))));
}

/** The admin's Billing tab: the outbox and relay. */
export async function relayTab(panel) {
  const s = await api("/admin/billing");
  const lagFrom = [s.oldest_pending_at, s.oldest_unsealed_window].filter((t) => t).map((t) => new Date(t).getTime());
  const lag = lagFrom.length ? Math.max(0, Math.round((Date.now() - Math.min(...lagFrom)) / 1000)) : 0;
  const dead = s.dead.map((e) => h("tr", { "data-identifier": e.identifier },
    h("td", { class: "mono" }, e.identifier), h("td", { class: "mono" }, e.tenant_id.slice(0, 8)), h("td", {}, e.meter),
    h("td", {}, fmtTime(e.window_start)), h("td", { class: "num" }, fmtInt(e.value)), h("td", { class: "num" }, e.attempts),
    h("td", {}, e.last_error ?? "")));
  replace(panel,
    h("div", { class: "toolbar" }, h("h2", {}, "Billing relay"),
      h("span", { class: `badge ${s.relay_running ? "active" : "suspended"}`, "data-state": "relay" },
        !s.enabled ? "billing off" : s.relay_running ? "relay running here" : "no relay in this gateway")),
    h("div", { class: "stats", "data-view": "relay-state" },
      ["pending", "sent", "dead", "adjusted"].map((k) =>
        stat(`events_${k}`, `Events ${k} (${fmtInt(s.events[k].tokens)} tokens)`, s.events[k].events)),
      stat("unsealed_lines", "Ledger lines in open windows", s.unsealed_lines),
      stat("unlinked_lines", "Lines of unlinked tenants", s.unlinked_lines),
      stat("lag_s", "Lag", lag, `${fmtInt(lag)} s`)),
    h("h3", {}, "Dead-lettered events"),
    h("table", { class: "card", "data-table": "dead-events" },
      h("thead", {}, h("tr", {}, ["Identifier", "Tenant", "Meter", "Window", "Tokens", "Attempts", "Last error"].map((c) => h("th", {}, c)))),
      h("tbody", {}, dead.length ? dead : h("tr", {}, h("td", { colspan: 7, class: "muted" }, "None")))));
  return null;
}
