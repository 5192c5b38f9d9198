// Sign in and out, and which view a key gets. The key is never logged, never put in a URL, and
// kept only in sessionStorage (see api.js).

import { ApiError, roleOf, session } from "./api.js";
import { adminView } from "./admin.js";
import { h, replace } from "./dom.js";
import { tenantView } from "./tenant.js";

const main = document.getElementById("main");
const who = document.getElementById("who");
const signOutButton = document.getElementById("sign-out");

function signOut(message) {
  session.end();
  renderSignIn(message);
}

/** Show an error where it happened; a refused key (401) ends the session. */
function fail(error, where) {
  // Signed out already (a panel loading beside the one that saw the 401): the sign-in screen
  // says why, and this panel's error would replace that reason with a keyless request's.
  if (!session.key) return;
  if (error instanceof ApiError && error.status === 401) {
    signOut(`Your key was refused: ${error.message}`);
    return;
  }
  replace(where, h("div", { class: "card error", role: "alert" }, error instanceof ApiError ? error.message : "Something went wrong."));
}

function renderSignIn(message) {
  who.textContent = "";
  signOutButton.hidden = true;
  document.body.dataset.role = "";
  const key = h("input", {
    id: "key", name: "key", type: "password", autocomplete: "off", spellcheck: "false",
    placeholder: "sk-sluice-… or the admin key", required: true,
  });
  const error = h("p", { class: "error-text", role: "alert", "data-state": "sign-in-error" }, message ?? "");
  const form = h("form", {
    class: "card sign-in", "data-form": "sign-in",
    onsubmit: async (e) => {
      e.preventDefault();
      const value = key.value.trim();
      error.textContent = "";
      try {
        const role = await roleOf(value);
        session.start(value, role);
        key.value = "";
        await renderSession();
      } catch (err) {
        error.textContent = err instanceof ApiError && err.status === 401 ? `Key refused: ${err.message}` : err.message;
      }
    },
  },
  h("h2", {}, "Sign in"),
  h("p", { class: "muted" }, "A tenant's API key shows that tenant's usage; the admin key manages tenants, keys, nodes and models. The key stays in this tab only."),
  h("label", { for: "key" }, "API key"), key,
  h("button", { type: "submit" }, "Sign in"), error);
  replace(main, form);
  key.focus();
}

async function renderSession() {
  const role = session.role;
  document.body.dataset.role = role;
  who.textContent = role === "admin" ? "Admin" : "Tenant";
  signOutButton.hidden = false;
  if (role === "admin") await adminView(main, fail);
  else await tenantView(main, fail);
}

signOutButton.addEventListener("click", () => signOut());
if (session.key) renderSession();
else renderSignIn();
