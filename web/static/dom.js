// Element construction without innerHTML: every value reaches the page as text, never as markup.

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  setAttrs(el, attrs);
  el.append(...flatten(children));
  return el;
}

export function setAttrs(el, attrs) {
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(el.dataset, v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
}

export function flatten(children) {
  return children.flat(Infinity).filter((c) => c !== null && c !== undefined && c !== false)
    .map((c) => (c instanceof Node ? c : String(c)));
}

export function replace(el, ...children) {
  el.replaceChildren(...flatten(children));
}

const integer = new Intl.NumberFormat("en-US");
export const fmtInt = (v) => integer.format(v);
export const fmtMs = (v) => (v === null || v === undefined ? "–" : `${v >= 100 ? Math.round(v) : v.toFixed(1)} ms`);
/** An ISO string or epoch seconds as "YYYY-MM-DD HH:MM:SSZ". */
export function fmtTime(t) {
  if (t === null || t === undefined || t === "") return "–";
  const d = new Date(typeof t === "number" ? t * 1000 : t);
  return Number.isNaN(d.getTime()) ? String(t) : `${d.toISOString().replace("T", " ").slice(0, 19)}Z`;
}
