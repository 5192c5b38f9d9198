// The admin's Models tab: what the driver serves, and the model registry — each public name's
// versions and their states, the alias (weights, generation in the database and the one this
// replica routes by), and the canary beside the current version: requests, errors, TTFT and latency
// per version on this replica (GET /admin/models/{name}/metrics).

import { barChart, COLORS } from "./charts.js";
import { fmtInt, fmtMs, fmtTime, h, replace } from "./dom.js";
import { api } from "./api.js";

const REFRESH_MS = 5000;
const VERSION_COLORS = { current: "#5b6cff", canary: "#f59e0b", other: "#9ca3af" };

export async function modelsTab(panel, fail) {
  const served = h("div", {});
  const registry = h("div", {});
  const refresh = async () => {
    try {
      replace(registry, await registryPanel());
    } catch (e) {
      fail(e, registry);
    }
  };
  const { data } = await api("/admin/models");
  replace(served, h("table", { class: "card", "data-table": "models" },
    h("thead", {}, h("tr", {}, ["Model", "Owned by", "Context (tokens)", "Created"].map((c) => h("th", {}, c)))),
    h("tbody", {}, data.map((m) => h("tr", { "data-model": m.id },
      h("td", { class: "mono" }, m.id), h("td", {}, m.owned_by), h("td", { class: "num" }, fmtInt(m.max_model_len)),
      h("td", {}, fmtTime(new Date(m.created * 1000).toISOString())))))));
  replace(panel, h("div", { class: "toolbar" }, h("h2", {}, `Served models (${data.length})`)), served,
    h("div", { class: "toolbar" }, h("h2", {}, "Model registry"), h("span", { class: "muted" }, "this replica's figures; refreshes every 5 s")),
    registry);
  await refresh();
  return setInterval(refresh, REFRESH_MS);
}

async function registryPanel() {
  const { data: models } = await api("/admin/registry");
  if (!models.length) {
    return h("p", { class: "card unavailable", "data-state": "no-registered-models" },
      "No model is registered. ", h("span", { class: "muted" }, "sluice models register NAME VERSION SOURCE (docs/versions.md)"));
  }
  const metrics = await Promise.all(models.map((m) => api(`/admin/models/${encodeURIComponent(m.name)}/metrics`)));
  return h("div", {}, models.map((m, i) => modelCard(m, metrics[i])));
}

/** "current" is the version the alias gives the most traffic, "canary" any other it names. */
function roleOf(version, weights) {
  const named = Object.entries(weights ?? {});
  if (!(version in (weights ?? {}))) return "other";
  const top = Math.max(...named.map(([, w]) => w));
  const first = named.find(([, w]) => w === top)[0];
  return version === first ? "current" : "canary";
}

function modelCard(model, metrics) {
  const weights = model.applied?.weights ?? model.alias?.weights ?? {};
  const figures = Object.fromEntries(metrics.versions.map((f) => [f.id, f]));
  const versions = model.versions.filter((v) => v.state !== "retired" || figures[v.id]?.requests);
  const compared = versions.filter((v) => roleOf(v.version, weights) !== "other" || figures[v.id]?.requests);
  const pending = model.alias && model.applied && model.alias.generation !== model.applied.generation;
  const series = (key, name, color) => ({ key, name, color, values: compared.map((v) => figures[v.id]?.[key] ?? 0) });
  return h("section", { class: "card model-card", "data-registry-model": model.name },
    h("div", { class: "toolbar" }, h("h3", { class: "mono" }, model.name),
      h("span", { "data-state": "generation", "data-value": model.alias?.generation ?? 0 },
        `generation ${model.alias?.generation ?? "–"}`),
      h("span", { class: pending ? "badge sluggish" : "muted", "data-state": "applied-generation", "data-value": model.applied?.generation ?? 0 },
        model.applied ? `routing by ${model.applied.generation} since ${fmtTime(model.applied.applied_at)}` : "no alias applied here"),
      h("span", { class: "weights", "data-state": "weights" }, Object.entries(weights).map(([v, w]) =>
        h("span", { class: `badge ${roleOf(v, weights)}`, "data-weight": v, "data-value": w }, `${v} ${w}%`)))),
    h("table", { "data-table": "versions" },
      h("thead", {}, h("tr", {}, ["Version", "Role", "State", "Weight", "Here (in flight)", "Requests", "Errors",
        "TTFT p50 / p99", "ITL p50 / p99", "Latency p50 / p99", "Source", "Changed"].map((c) => h("th", {}, c)))),
      h("tbody", {}, versions.map((v) => {
        const f = figures[v.id] ?? {};
        const role = roleOf(v.version, weights);
        return h("tr", { "data-version": v.version, "data-state": v.state, "data-role": role },
          h("td", { class: "mono" }, v.id), h("td", {}, role === "other" ? "" : h("span", { class: `badge ${role}` }, role)),
          h("td", {}, h("span", { class: `badge ${v.state}` }, v.state)),
          h("td", { class: "num", "data-metric": "weight", "data-value": weights[v.version] ?? 0 }, `${weights[v.version] ?? 0}%`),
          h("td", { "data-metric": "hosted", "data-value": String(v.hosted_here) }, v.hosted_here ? `yes (${fmtInt(v.in_flight)})` : "no"),
          h("td", { class: "num", "data-metric": "requests", "data-value": f.requests ?? 0 }, fmtInt(f.requests ?? 0)),
          h("td", { class: "num", "data-metric": "errors", "data-value": f.errors ?? 0 }, fmtInt(f.errors ?? 0)),
          h("td", { class: "num" }, `${fmtMs(f.ttft_p50_ms)} / ${fmtMs(f.ttft_p99_ms)}`),
          h("td", { class: "num" }, `${fmtMs(f.itl_p50_ms)} / ${fmtMs(f.itl_p99_ms)}`),
          h("td", { class: "num" }, `${fmtMs(f.e2e_p50_ms)} / ${fmtMs(f.e2e_p99_ms)}`),
          h("td", { class: "mono small", title: v.source }, v.source.split("/").at(-1)),
          h("td", { class: "small", title: v.detail ?? "" }, fmtTime(v.updated_at), h("div", { class: "muted" }, `by ${v.updated_by}`)));
      }))),
    compared.length ? h("div", { class: "charts" },
      barChart({
        id: "version-ttft", title: "TTFT per version", categories: compared.map((v) => v.version), unit: " ms",
        series: [series("ttft_p50_ms", "p50", COLORS.p50), series("ttft_p99_ms", "p99", COLORS.p99)],
      }),
      barChart({
        id: "version-requests", title: "Requests and errors per version", categories: compared.map((v) => v.version),
        series: [series("requests", "requests", VERSION_COLORS.current), series("errors", "errors", COLORS.p99)],
      })) : null);
}
