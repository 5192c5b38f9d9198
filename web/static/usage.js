// A tenant's usage and latency as cards and charts: the tenant's own view (/v1/usage) and the
// admin's view of one tenant (/admin/tenants/{id}/usage) draw the same thing from the same shapes.

import { barChart, COLORS, lineChart } from "./charts.js";
import { fmtInt, fmtMs, h } from "./dom.js";
import { api, windowDays, windowStart } from "./api.js";

/** URLs of the four reports for one tenant: `base` is "/v1/usage" or "/admin/tenants/{id}". */
function reports(base, days) {
  const start = encodeURIComponent(windowStart(days));
  const usage = base === "/v1/usage" ? "/v1/usage" : `${base}/usage`;
  const latency = base === "/v1/usage" ? "/v1/usage/latency" : `${base}/latency`;
  return Promise.all([
    api(`${usage}?group_by=day&start=${start}`),
    api(`${usage}?group_by=model&start=${start}`),
    api(`${latency}?group_by=day&start=${start}`),
    api(`${latency}?group_by=model&start=${start}`),
  ]);
}

function stat(metric, label, value, text = fmtInt(value)) {
  return h("div", { class: "card stat", "data-metric": metric, "data-value": value },
    h("div", { class: "stat-label" }, label), h("div", { class: "stat-value" }, text));
}

const pct = (bucket, field, q) => bucket?.[field]?.[q] ?? null;

export async function usagePanel(base, days) {
  const [byDay, byModel, latDay, latModel] = await reports(base, days);
  const dayIndex = new Map(byDay.data.map((b) => [b.group, b]));
  const days_ = windowDays(days);
  const perDay = (f) => days_.map((d) => dayIndex.get(d)?.[f] ?? 0);
  const total = (f) => byDay.data.reduce((a, b) => a + b[f], 0);
  const models = byModel.data.map((b) => b.group);
  const latIndex = new Map(latDay.data.map((b) => [b.group, b]));
  const overall = latDay.overall;

  const stats = h("div", { class: "stats" },
    stat("requests", "Requests", total("requests")),
    stat("prompt_tokens", "Prompt tokens", total("prompt_tokens")),
    stat("completion_tokens", "Completion tokens", total("completion_tokens")),
    stat("total_tokens", "Total tokens", total("total_tokens")),
    stat("latency_p50", "Latency p50", pct(overall, "latency_ms", "p50") ?? "", fmtMs(pct(overall, "latency_ms", "p50"))),
    stat("ttft_p50", "TTFT p50", pct(overall, "ttft_ms", "p50") ?? "", fmtMs(pct(overall, "ttft_ms", "p50"))),
  );

  const charts = h("div", { class: "charts" },
    barChart({
      id: "requests-per-day", title: "Requests per day", categories: days_,
      series: [{ key: "requests", name: "Requests", color: COLORS.requests, values: perDay("requests") }],
    }),
    barChart({
      id: "tokens-per-day", title: "Tokens per day", categories: days_, stacked: true,
      series: [
        { key: "prompt_tokens", name: "Prompt", color: COLORS.prompt, values: perDay("prompt_tokens") },
        { key: "completion_tokens", name: "Completion", color: COLORS.completion, values: perDay("completion_tokens") },
      ],
    }),
    barChart({
      id: "tokens-per-model", title: "Tokens per model", categories: models, stacked: true,
      series: [
        { key: "prompt_tokens", name: "Prompt", color: COLORS.prompt, values: byModel.data.map((b) => b.prompt_tokens) },
        { key: "completion_tokens", name: "Completion", color: COLORS.completion, values: byModel.data.map((b) => b.completion_tokens) },
      ],
    }),
    barChart({
      id: "latency-percentiles", title: "Latency percentiles (time to first token, end to end)", unit: " ms",
      note: `${fmtInt(overall.requests)} completed requests`,
      categories: overall.requests ? ["TTFT", "End to end"] : [],
      series: ["p50", "p90", "p99"].map((q) => ({
        key: q, name: q, color: COLORS[q],
        values: [pct(overall, "ttft_ms", q) ?? 0, pct(overall, "latency_ms", q) ?? 0],
      })),
    }),
    lineChart({
      id: "latency-per-day", title: "End-to-end latency per day", categories: days_, unit: " ms",
      series: ["p50", "p99"].map((q) => ({
        key: q, name: q, color: COLORS[q], values: days_.map((d) => pct(latIndex.get(d), "latency_ms", q)),
      })),
    }),
  );

  const latByModel = new Map(latModel.data.map((b) => [b.group, b]));
  const table = h("table", { class: "card", "data-table": "per-model" },
    h("thead", {}, h("tr", {}, ["Model", "Requests", "Prompt tokens", "Completion tokens", "TTFT p50 / p99", "Latency p50 / p90 / p99"].map((t) => h("th", {}, t)))),
    h("tbody", {}, byModel.data.length ? byModel.data.map((b) => {
      const l = latByModel.get(b.group);
      return h("tr", { "data-model": b.group },
        h("td", {}, b.group), h("td", { class: "num" }, fmtInt(b.requests)),
        h("td", { class: "num" }, fmtInt(b.prompt_tokens)), h("td", { class: "num" }, fmtInt(b.completion_tokens)),
        h("td", { class: "num" }, `${fmtMs(pct(l, "ttft_ms", "p50"))} / ${fmtMs(pct(l, "ttft_ms", "p99"))}`),
        h("td", { class: "num" }, ["p50", "p90", "p99"].map((q) => fmtMs(pct(l, "latency_ms", q))).join(" / ")));
    }) : h("tr", {}, h("td", { colspan: 6, class: "muted" }, "No requests in this range"))));

  return h("div", { class: "usage", "data-tenant": byDay.tenant_id }, stats, charts,
    h("h3", {}, "Per model"), table,
    latDay.truncated ? h("p", { class: "muted" }, "Latency figures cover the most recent 100,000 requests.") : null);
}

export function rangePicker(days, onChange) {
  return h("label", { class: "range" }, "Range ",
    h("select", { "data-control": "range", onchange: (e) => onChange(Number(e.target.value)) },
      [7, 30, 90].map((n) => h("option", { value: n, selected: n === days }, `last ${n} days`))));
}
