// The one place that talks to the gateway. The key lives in sessionStorage (this tab only, gone
// when it closes) and travels only in the Authorization header of same-origin requests.

const KEY = "sluice.console.key";
const ROLE = "sluice.console.role";

export const session = {
  get key() { return sessionStorage.getItem(KEY); },
  get role() { return sessionStorage.getItem(ROLE); },
  start(key, role) { sessionStorage.setItem(KEY, key); sessionStorage.setItem(ROLE, role); },
  end() { sessionStorage.removeItem(KEY); sessionStorage.removeItem(ROLE); },
};

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status; // 0: the gateway could not be reached
  }
}

export async function api(path, { method = "GET", body, key = session.key } = {}) {
  if (!key) throw new ApiError(401, "Signed out"); // never send "Bearer null"
  const headers = { authorization: `Bearer ${key}` };
  if (body !== undefined) headers["content-type"] = "application/json";
  let response;
  try {
    response = await fetch(path, {
      method, headers, body: body === undefined ? undefined : JSON.stringify(body),
      cache: "no-store", credentials: "omit", referrerPolicy: "no-referrer",
    });
  } catch {
    throw new ApiError(0, "Cannot reach the gateway");
  }
  const text = await response.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = null; }
  if (!response.ok) {
    const message = data?.error?.message ?? data?.detail ?? `HTTP ${response.status}`;
    throw new ApiError(response.status, message);
  }
  return data;
}

/** Which kind of key this is: "admin" (the admin API answers), "tenant" (it refuses with 403). */
export async function roleOf(key) {
  try {
    await api("/admin/tenants", { key });
    return "admin";
  } catch (e) {
    if (e.status === 403) return "tenant";
    if (e.status === 404) throw new ApiError(404, "This gateway runs without auth (--no-auth): no keys to sign in with");
    throw e;
  }
}

/** ISO start of the day `days - 1` days before today (UTC): a window of `days` whole days. */
export function windowStart(days) {
  const d = new Date();
  d.setUTCHours(0, 0, 0, 0);
  d.setUTCDate(d.getUTCDate() - (days - 1));
  return d.toISOString();
}

/** Every day (YYYY-MM-DD, UTC) of that window, oldest first, so quiet days show as zero. */
export function windowDays(days) {
  const first = new Date(windowStart(days));
  return Array.from({ length: days }, (_, i) => {
    const d = new Date(first);
    d.setUTCDate(first.getUTCDate() + i);
    return d.toISOString().slice(0, 10);
  });
}
