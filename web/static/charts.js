// Bar and line charts drawn as SVG. No library: the console must work offline, without a build.
// Every mark carries data-series, data-category and data-value (the exact number, unrounded), and
// the <svg> carries data-chart, so what a chart shows can be read back by a test or a screen reader.

import { h } from "./dom.js";

const NS = "http://www.w3.org/2000/svg";
const W = 640;
const H = 240;
const M = { top: 18, right: 12, bottom: 34, left: 56 };

export const COLORS = {
  requests: "#5b6cff", prompt: "#3b82f6", completion: "#f59e0b",
  p50: "#10b981", p90: "#f59e0b", p99: "#ef4444",
  healthy: "#10b981", sluggish: "#f59e0b", stalled: "#ef4444", dead: "#6b7280",
};

function s(tag, attrs = {}, text) {
  const el = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== undefined && v !== null) el.setAttribute(k, String(v));
  if (text !== undefined) el.textContent = String(text);
  return el;
}

export function compact(v) {
  const a = Math.abs(v);
  if (a >= 1e9) return `${+(v / 1e9).toFixed(1)}G`;
  if (a >= 1e6) return `${+(v / 1e6).toFixed(1)}M`;
  if (a >= 1e4) return `${+(v / 1e3).toFixed(1)}k`;
  return Number.isInteger(v) ? String(v) : String(+v.toFixed(1));
}

// The top of the y axis: four equal steps of 1, 2, 2.5 or 5 times a power of ten, so every
// gridline is a round number (whole numbers for counts of 4 or more).
function niceMax(v) {
  if (!(v > 0)) return 4;
  const raw = v / 4;
  const power = 10 ** Math.floor(Math.log10(raw));
  for (const m of [1, 2, 2.5, 5, 10]) {
    const step = m * power;
    if (step >= raw && (v < 4 || Number.isInteger(step))) return 4 * step;
  }
  return 40 * power;
}

function shortLabel(category) {
  if (/^\d{4}-\d{2}-\d{2}$/.test(category)) return category.slice(5); // a day: MM-DD
  return category.length > 16 ? `${category.slice(0, 15)}…` : category;
}

function frame(id, max, unit) {
  const svg = s("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "data-chart": id, class: "chart" });
  const plotH = H - M.top - M.bottom;
  const y = (v) => M.top + plotH - (v / max) * plotH;
  for (let i = 0; i <= 4; i++) {
    const v = (max * i) / 4;
    svg.append(s("line", { x1: M.left, x2: W - M.right, y1: y(v), y2: y(v), class: i ? "grid" : "axis" }));
    svg.append(s("text", { x: M.left - 6, y: y(v) + 4, class: "tick", "text-anchor": "end" }, compact(v) + (i === 4 ? unit : "")));
  }
  return { svg, y };
}

function xLabels(svg, categories, x, band) {
  const every = Math.ceil(categories.length / 12);
  categories.forEach((c, i) => {
    if (i % every !== 0 && i !== categories.length - 1) return;
    const label = s("text", { x: x(i) + band / 2, y: H - M.bottom + 16, class: "tick", "text-anchor": "middle" }, shortLabel(c));
    label.append(s("title", {}, c));
    svg.append(label);
  });
}

function legend(series) {
  return h("div", { class: "legend" }, series.map((se) => {
    const swatch = s("svg", { viewBox: "0 0 10 10", class: "swatch" });
    swatch.append(s("rect", { width: 10, height: 10, rx: 2, fill: se.color }));
    return h("span", {}, swatch, se.name);
  }));
}

function figure(id, title, svg, series, note) {
  return h("figure", { class: "card chart-card", "data-figure": id },
    h("figcaption", {}, title, note ? h("span", { class: "note" }, note) : null), svg, legend(series));
}

function empty(id, title) {
  const svg = s("svg", { viewBox: `0 0 ${W} ${H / 2}`, "data-chart": id, "data-empty": "true", class: "chart" });
  svg.append(s("text", { x: W / 2, y: H / 4, class: "empty", "text-anchor": "middle" }, "No data in this range"));
  return h("figure", { class: "card chart-card", "data-figure": id }, h("figcaption", {}, title), svg);
}

/**
 * Vertical bars. series: [{key, name, color, values}] with one value per category.
 * stacked: one bar per category with the series on top of each other; else side by side.
 */
export function barChart({ id, title, categories, series, stacked = false, unit = "", note }) {
  if (!categories.length) return empty(id, title);
  const totals = categories.map((_, i) => series.reduce((a, se) => a + (se.values[i] ?? 0), 0));
  const max = niceMax(stacked ? Math.max(...totals) : Math.max(...series.flatMap((se) => se.values.map((v) => v ?? 0))));
  const { svg, y } = frame(id, max, unit);
  const plotW = W - M.left - M.right;
  const band = plotW / categories.length;
  const x = (i) => M.left + i * band;
  const perSeries = stacked ? 1 : series.length;
  const barW = Math.min((band * 0.8) / perSeries, 56); // a lone category must not become a wall
  const pad = (band - barW * perSeries) / 2;
  const labelled = categories.length <= 12;
  categories.forEach((c, i) => {
    let base = 0;
    series.forEach((se, j) => {
      const v = se.values[i] ?? 0;
      const x0 = stacked ? x(i) + pad : x(i) + pad + j * barW;
      const top = y(base + v);
      const rect = s("rect", {
        x: x0, y: top, width: Math.max(barW - (stacked ? 0 : 1), 1), height: Math.max(y(base) - top, 0),
        fill: se.color, class: "bar", "data-series": se.key, "data-category": c, "data-value": v,
      });
      rect.append(s("title", {}, `${se.name} · ${c}: ${v.toLocaleString("en-US")}${unit}`));
      svg.append(rect);
      if (labelled && !stacked && v > 0) {
        svg.append(s("text", { x: x0 + barW / 2, y: top - 4, class: "value", "text-anchor": "middle" }, compact(v)));
      }
      if (stacked) base += v;
    });
    if (labelled && stacked && totals[i] > 0) {
      svg.append(s("text", { x: x(i) + band / 2, y: y(totals[i]) - 4, class: "value", "text-anchor": "middle", "data-total": totals[i] }, compact(totals[i])));
    }
  });
  xLabels(svg, categories, x, band);
  return figure(id, title, svg, series, note);
}

/** Lines over categories; a null value leaves a gap (no data that day). */
export function lineChart({ id, title, categories, series, unit = "", note }) {
  const present = series.flatMap((se) => se.values.filter((v) => v !== null && v !== undefined));
  if (!present.length) return empty(id, title);
  const max = niceMax(Math.max(...present));
  const { svg, y } = frame(id, max, unit);
  const plotW = W - M.left - M.right;
  const band = plotW / categories.length;
  const x = (i) => M.left + i * band;
  for (const se of series) {
    let d = "";
    let pen = false;
    se.values.forEach((v, i) => {
      if (v === null || v === undefined) { pen = false; return; }
      d += `${pen ? "L" : "M"}${(x(i) + band / 2).toFixed(1)},${y(v).toFixed(1)}`;
      pen = true;
    });
    svg.append(s("path", { d, stroke: se.color, class: "line", fill: "none" }));
    se.values.forEach((v, i) => {
      if (v === null || v === undefined) return;
      const dot = s("circle", {
        cx: x(i) + band / 2, cy: y(v), r: 3.5, fill: se.color, class: "dot",
        "data-series": se.key, "data-category": categories[i], "data-value": v,
      });
      dot.append(s("title", {}, `${se.name} · ${categories[i]}: ${v}${unit}`));
      svg.append(dot);
    });
  }
  xLabels(svg, categories, x, band);
  return figure(id, title, svg, series, note);
}

/** A horizontal meter (e.g. KV blocks used of total). */
export function meter(used, total, label) {
  const frac = total > 0 ? Math.min(used / total, 1) : 0;
  const svg = s("svg", { viewBox: "0 0 100 8", class: "meter", preserveAspectRatio: "none", "data-used": used, "data-total": total });
  svg.append(s("rect", { width: 100, height: 8, rx: 2, class: "meter-bg" }));
  svg.append(s("rect", { width: 100 * frac, height: 8, rx: 2, class: frac > 0.9 ? "meter-fill hot" : "meter-fill" }));
  svg.append(s("title", {}, label));
  return svg;
}
