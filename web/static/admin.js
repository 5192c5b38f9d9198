// The admin's view: tenants (keys issued and revoked, usage, Stripe link and billed usage), nodes and
// their health, models, the billing relay.

import { barChart, COLORS, lineChart, meter } from "./charts.js";
import { fmtInt, fmtMs, fmtTime, h, replace } from "./dom.js";
import { api } from "./api.js";
import { billedPanel, relayTab } from "./billing.js";
import { modelsTab } from "./models.js";
import { rangePicker, usagePanel } from "./usage.js";

const TIERS = ["premium", "standard", "batch"];
const limit = (v) => (v === null ? "∞" : fmtInt(v));
const NODE_REFRESH_MS = 5000;

export async function adminView(root, fail) {
  const panel = h("div", { class: "panel" });
  let timer = null;
  let shown = 0;  // which call of show() is the latest
  const tabs = { tenants: tenantsTab, nodes: nodesTab, latency: latencyTab, models: modelsTab, billing: relayTab };
  const nav = h("nav", { class: "tabs" }, Object.keys(tabs).map((name) =>
    h("button", { "data-tab": name, onclick: () => show(name) }, name[0].toUpperCase() + name.slice(1))));
  // Each tab renders into a view of its own, attached at once (charts measure it): a tab clicked while another is
  // still loading replaces that view, so the slower, older one finishes into a detached view and stops its timer,
  // instead of painting over the tab asked for last.
  async function show(name) {
    const mine = ++shown;
    clearInterval(timer);
    for (const b of nav.children) b.classList.toggle("active", b.dataset.tab === name);
    const view = h("div");
    replace(panel, view);
    replace(view, h("p", { class: "muted" }, "Loading…"));
    try {
      const refresh = await tabs[name](view, fail);
      if (mine === shown) timer = refresh;
      else clearInterval(refresh);
    } catch (e) {
      if (mine === shown) fail(e, view);
    }
  }
  replace(root, nav, panel);
  await show("tenants");
}

// -- tenants ------------------------------------------------------------------------------------

async function tenantsTab(panel, fail) {
  const { data: tenants } = await api("/admin/tenants");
  const detail = h("div", { class: "detail" });
  const name = h("input", { name: "tenant-name", placeholder: "new tenant name", required: true, maxlength: 200 });
  const create = h("form", {
    class: "inline", "data-form": "create-tenant",
    onsubmit: async (e) => {
      e.preventDefault();
      try {
        await api("/admin/tenants", { method: "POST", body: { name: name.value.trim() } });
        await tenantsTab(panel, fail);
      } catch (err) { fail(err, detail); }
    },
  }, name, h("button", { type: "submit" }, "Create tenant"));
  const rows = tenants.map((t) => h("tr", {
    class: "clickable", "data-tenant-id": t.id, "data-tenant-name": t.name,
    onclick: (e) => {
      for (const r of e.currentTarget.parentElement.children) r.classList.toggle("selected", r === e.currentTarget);
      tenantDetail(detail, t, fail);
    },
  },
  h("td", {}, t.name), h("td", { class: "mono" }, t.id.slice(0, 8)), h("td", {}, TIERS[t.priority] ?? t.priority),
  h("td", { class: "num" }, limit(t.requests_per_minute)), h("td", { class: "num" }, limit(t.tokens_per_minute)),
  h("td", { class: "num" }, limit(t.max_concurrent)), h("td", { class: "num" }, limit(t.monthly_token_budget)),
  h("td", {}, h("span", { class: `badge ${t.status}` }, t.status))));
  replace(panel,
    h("div", { class: "toolbar" }, h("h2", {}, `Tenants (${tenants.length})`), create),
    h("table", { class: "card", "data-table": "tenants" },
      h("thead", {}, h("tr", {}, ["Name", "Id", "Tier", "Req/min", "Tokens/min", "Concurrent", "Monthly budget", "Status"].map((c) => h("th", {}, c)))),
      h("tbody", {}, rows.length ? rows : h("tr", {}, h("td", { colspan: 8, class: "muted" }, "No tenants yet")))),
    detail);
  return null;
}

async function tenantDetail(detail, tenant, fail) {
  const keys = h("div", {});
  const usage = h("div", {}, h("p", { class: "muted" }, "Loading usage…"));
  let days = 30;
  const billed = h("div", {});
  const base = `/admin/tenants/${encodeURIComponent(tenant.id)}`;
  const loadUsage = async () => {
    try { replace(usage, await usagePanel(base, days)); } catch (e) { fail(e, usage); }
    try { replace(billed, await billedPanel(`${base}/billing`, days)); } catch (e) { fail(e, billed); }
  };
  replace(detail, h("section", { "data-tenant-detail": tenant.id },
    h("h2", {}, `Tenant ${tenant.name}`), h("p", { class: "muted mono" }, tenant.id), stripeLink(tenant, fail), keys,
    h("div", { class: "toolbar" }, h("h3", {}, "Usage"), rangePicker(days, (n) => { days = n; loadUsage(); })),
    usage, h("h3", {}, "Billed usage"), billed));
  await Promise.all([keysPanel(keys, tenant, fail), loadUsage()]);
}

/** The tenant's Stripe customer: linking it starts billing its usage (empty unlinks). */
function stripeLink(tenant, fail) {
  const input = h("input", { name: "stripe-customer-id", placeholder: "cus_…", maxlength: 255, value: tenant.stripe_customer_id ?? "" });
  const note = h("span", { class: "muted", "data-state": "stripe-customer" }, tenant.stripe_customer_id ? "linked" : "not billed through Stripe");
  return h("form", {
    class: "inline", "data-form": "stripe-customer",
    onsubmit: async (e) => {
      e.preventDefault();
      try {
        const value = input.value.trim() || null;
        const updated = await api(`/admin/tenants/${encodeURIComponent(tenant.id)}`, { method: "PATCH", body: { stripe_customer_id: value } });
        tenant.stripe_customer_id = updated.stripe_customer_id;
        note.textContent = updated.stripe_customer_id ? "linked" : "not billed through Stripe";
      } catch (err) { fail(err, note); }
    },
  }, h("label", {}, "Stripe customer "), input, h("button", { type: "submit" }, "Save"), note);
}

async function keysPanel(box, tenant, fail) {
  const { data } = await api(`/admin/tenants/${encodeURIComponent(tenant.id)}/keys`);
  const secretBox = h("div", {});
  const keyName = h("input", { name: "key-name", placeholder: "key name, e.g. laptop", required: true, maxlength: 200 });
  const issue = h("form", {
    class: "inline", "data-form": "issue-key",
    onsubmit: async (e) => {
      e.preventDefault();
      try {
        const created = await api(`/admin/tenants/${encodeURIComponent(tenant.id)}/keys`, { method: "POST", body: { name: keyName.value.trim() } });
        await keysPanel(box, tenant, fail);
        box.prepend(secretNotice(created));
      } catch (err) { fail(err, secretBox); }
    },
  }, keyName, h("button", { type: "submit" }, "Issue key"));
  const rows = data.map((k) => h("tr", { "data-key-id": k.id, "data-key-name": k.name, "data-revoked": String(Boolean(k.revoked_at)) },
    h("td", {}, k.name), h("td", { class: "mono" }, `${k.prefix}…`), h("td", {}, fmtTime(k.created_at)),
    h("td", {}, fmtTime(k.last_used_at)),
    h("td", {}, k.revoked_at ? h("span", { class: "badge revoked" }, "revoked") : h("span", { class: "badge active" }, "active")),
    h("td", {}, k.revoked_at ? "" : revokeButton(k, () => keysPanel(box, tenant, fail), fail, secretBox))));
  replace(box, h("div", { class: "toolbar" }, h("h3", {}, "API keys"), issue), secretBox,
    h("table", { class: "card", "data-table": "keys" },
      h("thead", {}, h("tr", {}, ["Name", "Prefix", "Created", "Last used", "Status", ""].map((c) => h("th", {}, c)))),
      h("tbody", {}, rows.length ? rows : h("tr", {}, h("td", { colspan: 6, class: "muted" }, "No keys")))));
}

// Two clicks: the first arms the button for a few seconds, the second revokes.
function revokeButton(key, done, fail, errors) {
  let armed = null;
  const button = h("button", {
    class: "danger", "data-action": "revoke",
    onclick: async () => {
      if (!armed) {
        button.textContent = "Confirm revoke";
        button.dataset.armed = "true";
        armed = setTimeout(() => { armed = null; button.textContent = "Revoke"; delete button.dataset.armed; }, 5000);
        return;
      }
      clearTimeout(armed);
      button.disabled = true;
      try { await api(`/admin/keys/${encodeURIComponent(key.id)}`, { method: "DELETE" }); await done(); } catch (e) { fail(e, errors); }
    },
  }, "Revoke");
  return button;
}

function secretNotice(created) {
  const code = h("code", { "data-secret": created.id }, created.key);
  return h("div", { class: "card notice", "data-notice": "new-key" },
    h("strong", {}, `Key "${created.name}" issued. `), "Copy it now: it is shown only this once.",
    h("div", { class: "secret" }, code,
      h("button", { class: "secondary", onclick: () => navigator.clipboard?.writeText(created.key) }, "Copy")));
}

// -- nodes --------------------------------------------------------------------------------------

async function nodesTab(panel, fail) {
  const body = h("div", {});
  const refresh = async () => {
    let report;
    try {
      report = await api("/admin/nodes");
    } catch (e) {
      if (e.status === 401) return fail(e, body);
      replace(body, h("div", { class: "card unavailable", "data-state": "nodes-unavailable" },
        h("strong", {}, "Nodes unavailable"),
        h("p", {}, e.status === 404 ? "This gateway has no node report (GET /admin/nodes is not served)." : `GET /admin/nodes failed: ${e.message}`),
        h("p", { class: "muted" }, "Retrying every few seconds.")));
      return;
    }
    replace(body, nodesPanel(report));
  };
  replace(panel, h("div", { class: "toolbar" }, h("h2", {}, "Nodes"), h("span", { class: "muted" }, "refreshes every 5 s")), body);
  await refresh();
  return setInterval(refresh, NODE_REFRESH_MS);
}

function scalingCard(scaling) {
  if (!scaling) return null;
  const held = Object.values(scaling.held_by_priority ?? {}).reduce((a, b) => a + b, 0);
  const stat = (metric, label, value) => h("div", { class: "card stat", "data-metric": metric, "data-value": value },
    h("div", { class: "stat-label" }, label), h("div", { class: "stat-value" }, String(value)));
  return h("div", { class: "stats", "data-view": "scaling" },
    stat("desired_workers", `desired workers (${scaling.driver})`, scaling.desired_workers),
    stat("ready_workers", "ready workers", scaling.ready_workers),
    stat("waiting", "waiting (held)", `${fmtInt(scaling.waiting)} (${fmtInt(held)})`),
    stat("kv_cache_usage", "KV cache used", `${Math.round((scaling.kv_cache_usage ?? 0) * 100)}%`));
}

function nodesPanel({ nodes = [], events = [], scaling = null }) {
  const counts = {};
  for (const n of nodes) counts[n.status] = (counts[n.status] ?? 0) + 1;
  const ids = nodes.map((n) => String(n.id));
  return h("div", { "data-view": "nodes" },
    scalingCard(scaling),
    h("div", { class: "stats" }, ["healthy", "sluggish", "stalled", "dead"].map((st) =>
      h("div", { class: `card stat ${st}`, "data-metric": `nodes_${st}`, "data-value": counts[st] ?? 0 },
        h("div", { class: "stat-label" }, st), h("div", { class: "stat-value" }, fmtInt(counts[st] ?? 0))))),
    h("div", { class: "charts" },
      barChart({
        id: "node-itl", title: "Inter-token latency per node", categories: ids, unit: " ms",
        series: [
          { key: "itl_p50_ms", name: "ITL p50", color: COLORS.p50, values: nodes.map((n) => n.itl_p50_ms ?? 0) },
          { key: "itl_p99_ms", name: "ITL p99", color: COLORS.p99, values: nodes.map((n) => n.itl_p99_ms ?? 0) },
        ],
      }),
      barChart({
        id: "node-throughput", title: "Tokens per second per node", categories: ids,
        series: [{ key: "tokens_per_s", name: "tokens/s", color: COLORS.requests, values: nodes.map((n) => n.tokens_per_s ?? 0) }],
      })),
    h("table", { class: "card", "data-table": "nodes" },
      h("thead", {}, h("tr", {}, ["Node", "Status", "Running", "Waiting", "KV blocks", "Tokens/s", "ITL p50 / p99", "TTFT p50", "Since", "Reason"].map((c) => h("th", {}, c)))),
      h("tbody", {}, nodes.length ? nodes.map((n) => h("tr", { "data-node-id": n.id, "data-status": n.status },
        h("td", { class: "mono" }, n.id), h("td", {}, h("span", { class: `badge ${n.status}` }, n.status)),
        h("td", { class: "num" }, fmtInt(n.running ?? 0)), h("td", { class: "num" }, fmtInt(n.waiting ?? 0)),
        h("td", {}, meter(n.kv_blocks_used ?? 0, n.kv_blocks_total ?? 0, `${n.kv_blocks_used} of ${n.kv_blocks_total} blocks`),
          h("span", { class: "muted small" }, ` ${fmtInt(n.kv_blocks_used ?? 0)} / ${fmtInt(n.kv_blocks_total ?? 0)}`)),
        h("td", { class: "num" }, n.tokens_per_s === null || n.tokens_per_s === undefined ? "–" : n.tokens_per_s.toFixed(1)),
        h("td", { class: "num" }, `${fmtMs(n.itl_p50_ms)} / ${fmtMs(n.itl_p99_ms)}`), h("td", { class: "num" }, fmtMs(n.ttft_p50_ms)),
        h("td", {}, fmtTime(n.since)), h("td", {}, n.reason ?? ""))) : h("tr", {}, h("td", { colspan: 10, class: "muted" }, "No nodes reported")))),
    h("h3", {}, "Events"),
    h("table", { class: "card", "data-table": "node-events" },
      h("thead", {}, h("tr", {}, ["Time", "Node", "Event", "Reason"].map((c) => h("th", {}, c)))),
      h("tbody", {}, events.length ? [...events].reverse().map((e) => h("tr", {},
        h("td", {}, fmtTime(e.time)), h("td", { class: "mono" }, e.node), h("td", {}, h("span", { class: `badge ${e.kind}` }, e.kind)), h("td", {}, e.reason ?? "")))
        : h("tr", {}, h("td", { colspan: 4, class: "muted" }, "No events")))));
}

// -- latency by token length -------------------------------------------------------------------

const BUCKET_COLORS = ["#4e79a7", "#59a14f", "#f28e2b", "#e15759", "#b07aa1"];

async function latencyTab(panel, fail) {
  const body = h("div", {});
  const refresh = async () => {
    try {
      replace(body, latencyPanel(await api("/admin/latency/by-length")));
    } catch (e) {
      fail(e, body);
    }
  };
  replace(panel, h("div", { class: "toolbar" }, h("h2", {}, "Latency by token length"),
    h("span", { class: "muted" }, "p90 per minute, last hour; refreshes every 5 s")), body);
  await refresh();
  return setInterval(refresh, NODE_REFRESH_MS);
}

function latencyPanel(report) {
  // Only the minutes that saw requests, so the lines are not lost in an empty hour.
  const used = report.minutes.map((_, i) => [report.ttft_by_prompt, report.itl_by_prompt, report.itl_by_position]
    .some((lines) => lines.some((l) => l.points[i] !== null))).map((u, i) => (u ? i : -1)).filter((i) => i >= 0);
  const categories = used.map((i) => fmtTime(report.minutes[i]).slice(11, 16));
  const chart = (id, title, lines, note) => lineChart({
    id, title, categories, unit: " ms", note,
    series: lines.map((l, k) => ({
      key: l.bucket, name: l.bucket, color: BUCKET_COLORS[k % BUCKET_COLORS.length],
      values: used.map((i) => (l.points[i] === null ? null : l.points[i].p90_ms)),
    })),
  });
  return h("div", { "data-view": "latency" },
    h("div", { class: "charts" },
      chart("ttft-by-prompt", "TTFT p90 by prompt length (tokens)", report.ttft_by_prompt,
        "a line rising alone: long prompts regress"),
      chart("itl-by-prompt", "Inter-token latency p90 by prompt length (tokens)", report.itl_by_prompt),
      chart("itl-by-position", "Inter-token latency p90 by output position (token)", report.itl_by_position)));
}
