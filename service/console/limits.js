// Limits as the console shows and edits them: an account's admission and end-user limits (Users
// view) and an end user's own rate limits (its account's End users panel). The API's convention
// is the same for every limit: null takes the next level's value (the gateway's default, or for an
// end user its account's end-user limit), 0 is unlimited, any other number is the limit.

import { call } from "./api.js";
import { clear, el, field, message, problem } from "./dom.js";

// [field, label] of what PATCH /admin/users/{id} changes; null there: the gateway's default
export const ACCOUNT_LIMITS = [
  ["max_parallel_requests", "Parallel requests"],
  ["requests_per_minute", "Requests per minute"],
  ["tokens_per_minute", "Tokens per minute"],
  ["end_users_max", "End users in all"],
  ["end_users_new_per_minute", "New end users per minute"],
  ["end_user_requests_per_minute", "Requests per minute of each end user"],
  ["end_user_tokens_per_minute", "Tokens per minute of each end user"],
];

// what PATCH /admin/users/{id}/end-users/{eid} changes; null there: the account's end-user limit
export const END_USER_LIMITS = [
  ["requests_per_minute", "Requests per minute"],
  ["tokens_per_minute", "Tokens per minute"],
];

const MAX_LIMIT = 2 ** 31 - 1;

/** A limit as text: 0 is "unlimited", null (unset) is ``unset``. */
export function limitText(value, unset = "default") {
  if (value === null || value === undefined) return unset;
  return value === 0 ? "unlimited" : Number(value).toLocaleString("en-US");
}

/** The value an input holds: null when empty, else a whole number in the API's range. */
function parsed(input, label) {
  const text = input.value.trim();
  if (text === "") return null;
  if (!/^\d+$/.test(text) || Number(text) > MAX_LIMIT) {
    throw new Error(`${label}: a whole number from 0 (unlimited) to ${MAX_LIMIT}, or empty for the ${input.dataset.unset}`);
  }
  return Number(text);
}

/**
 * A form that edits ``limits`` ([field, label] pairs) of ``current`` (an object of the API) and
 * sends only the fields that changed with ``method path``. ``unset`` names what an empty field
 * takes; ``inForce`` (optional) gives the value each field is held to now, shown beside it.
 * ``onSaved(updated)`` runs after a save. ``name`` tells the form apart (data-limits).
 */
export function limitsForm({ name, title, limits, current: initial, path, unset, inForce = {}, onSaved, onClose }) {
  let current = initial;
  const status = el("div", { class: "status-line" });
  const inputs = new Map();
  const rows = limits.map(([key, label]) => {
    const value = current[key];
    const input = el("input", {
      attrs: {
        type: "text",
        inputmode: "numeric",
        name: key,
        value: value === null || value === undefined ? "" : String(value),
        placeholder: unset,
        autocomplete: "off",
        "aria-label": label,
        "data-unset": unset,
      },
    });
    inputs.set(key, input);
    const shown = el("span", { class: "limit-shown", attrs: { "data-limit": key } });
    const show = () => {
      let text;
      try {
        const entered = parsed(input, label);
        text = entered === null ? `${unset}${key in inForce ? `: ${limitText(inForce[key])}` : ""}` : limitText(entered);
      } catch {
        text = "not a limit";
      }
      shown.textContent = text;
    };
    input.addEventListener("input", show);
    show();
    return el("div", { class: "limit-row" }, field(label, input), shown);
  });
  const save = el("button", { text: "Save limits", attrs: { type: "submit", class: "primary" } });
  const close = el("button", { text: "Close", attrs: { type: "button", "data-action": "close-limits" }, on: { click: onClose } });
  const form = el(
    "form",
    { class: "limits-form", attrs: { "data-limits": name, autocomplete: "off", "aria-label": title } },
    el("div", { class: "panel-head" }, el("h4", { text: title }), close),
    el("p", { class: "note", text: `Empty: the ${unset}. 0: unlimited. A change applies from the next request.` }),
    ...rows,
    el("div", { class: "row" }, save),
    status,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    clear(status);
    const changes = {};
    try {
      for (const [key, label] of limits) {
        const value = parsed(inputs.get(key), label);
        if (value !== (current[key] ?? null)) changes[key] = value;
      }
    } catch (error) {
      status.append(message("error", error.message));
      return;
    }
    if (Object.keys(changes).length === 0) {
      status.append(message("notice", "Nothing changed."));
      return;
    }
    try {
      const updated = await call("PATCH", path, changes);
      current = updated;
      const count = Object.keys(changes).length;
      status.append(message("ok", `Saved: ${count} ${count === 1 ? "limit" : "limits"} changed.`));
      if (onSaved) await onSaved(updated);
    } catch (error) {
      status.append(problem(error, "Saving limits"));
    }
  });
  return form;
}
