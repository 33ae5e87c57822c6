// The API client: the key lives in sessionStorage only (gone with the tab, never in a URL,
// cookie, localStorage or log) and travels as a bearer token to this gateway only.

const KEY = "xmark.console.apiKey";

export function storedKey() {
  return sessionStorage.getItem(KEY);
}

export function storeKey(key) {
  sessionStorage.setItem(KEY, key);
}

export function forgetKey() {
  sessionStorage.removeItem(KEY);
}

/** An error from the API: its HTTP status and the envelope's message. */
export class ApiError extends Error {
  constructor(status, message, code = null) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  let code = null;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) {
      message = body.error.message;
      code = body.error.code || null;
    }
  } catch {
    // not JSON: keep the status line
  }
  return new ApiError(response.status, message, code);
}

async function request(method, path, body) {
  const headers = { Accept: "application/json" };
  const key = storedKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let response;
  try {
    response = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      credentials: "omit",
      cache: "no-store",
      referrerPolicy: "no-referrer",
    });
  } catch (error) {
    throw new ApiError(0, `The gateway cannot be reached (${error.message}).`);
  }
  if (!response.ok) throw await errorOf(response);
  return response;
}

/** Call the API: JSON in, JSON out; throws ApiError with the envelope's message. */
export async function call(method, path, body = undefined) {
  const response = await request(method, path, body);
  return response.status === 204 ? null : response.json();
}

/** GET a document as the gateway sent it, byte for byte (a signed report is saved unchanged). */
export async function fetchText(path) {
  return (await request("GET", path)).text();
}

/** A query string from the non-empty values of ``params``. */
export function query(params) {
  const search = new URLSearchParams();
  for (const [name, value] of Object.entries(params)) {
    if (value !== "" && value !== null && value !== undefined) search.set(name, String(value));
  }
  const text = search.toString();
  return text ? `?${text}` : "";
}

/** Save ``text`` as a JSON file through a temporary link (nothing leaves the browser). */
export function saveJson(text, filename) {
  const blob = new Blob([text], { type: "application/json" });
  const url = URL.createObjectURL(blob);
  const link = document.createElement("a");
  link.href = url;
  link.download = filename;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}
