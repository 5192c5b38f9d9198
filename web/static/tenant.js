// The tenant's view: its own usage over time, latency percentiles and billed usage.

import { billedPanel } from "./billing.js";
import { h, replace } from "./dom.js";
import { rangePicker, usagePanel } from "./usage.js";

export async function tenantView(root, fail) {
  let days = 30;
  const body = h("div", { "data-view": "tenant-usage" }, h("p", { class: "muted" }, "Loading usage…"));
  const billed = h("div", {});
  const refresh = async () => {
    try {
      replace(body, await usagePanel("/v1/usage", days));
    } catch (e) {
      fail(e, body);
    }
    try {
      replace(billed, await billedPanel("/v1/billing", days));
    } catch (e) {
      fail(e, billed);
    }
  };
  replace(root,
    h("div", { class: "toolbar" }, h("h2", {}, "Your usage"),
      rangePicker(days, (n) => { days = n; refresh(); }),
      h("button", { class: "secondary", "data-action": "refresh", onclick: refresh }, "Refresh")),
    body, h("h2", {}, "Billed usage"), billed);
  await refresh();
}
