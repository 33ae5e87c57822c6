// An account's end users (admins, from the Users view): search by identifier as you type, filter by
// status, page, and disable, enable or delete one. Identifiers are the platform's own (its
// safety_identifier, user or metadata.user_id): they reach the page as text only and live in this
// panel's DOM and memory only, never in the URL, web storage or the browser's form history.

import { call, query } from "./api.js";
import { PAGE, actionButton, clear, el, field, formatDate, latest, message, pager, problem, select, table } from "./dom.js";
import { END_USER_LIMITS, limitText, limitsForm } from "./limits.js";

// a search waits this long after the last keystroke, so typing an identifier asks the API once
const SEARCH_DELAY_MS = 300;
const STATUSES = [["", "any status"], ["active", "active"], ["disabled", "disabled"], ["deleted", "deleted"]];
// fields an end user may carry besides its own (its limits, its usage): a column each, shown when
// a row of the page has the field
const EXTRA_FIELDS = [["limits", "Limits"], ["usage", "Usage"]];

const TIMESTAMP = /^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}/;

function shownValue(value) {
  if (value === null || value === undefined) return "–";
  if (typeof value === "number") return String(value);
  if (typeof value === "string" && TIMESTAMP.test(value)) return formatDate(value);
  return typeof value === "object" ? JSON.stringify(value) : String(value);
}

// how a column's numbers read: a limit of 0 is "unlimited"
const LEAF_TEXT = { limits: (value) => (typeof value === "number" ? limitText(value) : shownValue(value)) };

/** An object as "name: value" lines (nested objects by dotted names, each leaf through ``text``);
 * anything else as text. */
function valueLines(value, text = shownValue) {
  if (value === null || value === undefined || typeof value !== "object" || Array.isArray(value)) return text(value);
  const lines = [];
  (function walk(object, prefix) {
    for (const [name, item] of Object.entries(object)) {
      const key = prefix ? `${prefix}.${name}` : name;
      if (item !== null && typeof item === "object" && !Array.isArray(item)) walk(item, key);
      else lines.push(`${key}: ${text(item)}`);
    }
  })(value, "");
  return lines.length ? el("div", { class: "values" }, lines.map((line) => el("div", { text: line }))) : "–";
}

function messageIdCount(endUser) {
  const ids = endUser.message_ids || [];
  const detail = ids.map((m) => `${m.bits} bits (blocks of ${m.block_bits}): ${m.message_id}`).join("\n");
  return el("span", { text: String(ids.length), attrs: { title: detail || null } });
}

/** The panel of ``account``'s end users ({id, name}); ``onClose`` removes it. */
export function endUsersPanel(account, onClose) {
  const state = { q: "", status: "", offset: 0 };
  // an older answer that arrives late (typing goes on while a search is answered) never replaces a newer one
  const loads = latest();
  const base = `/admin/users/${encodeURIComponent(account.id)}/end-users`;
  const status = el("div", { class: "status-line" });
  const list = el("div");
  const editor = el("div");
  let timer = null;

  const q = el("input", { attrs: { type: "search", name: "q", placeholder: "identifier contains…", autocomplete: "off", spellcheck: "false" } });
  const statusFilter = select("status", STATUSES);
  const filters = el("form", { class: "end-user-filters row", attrs: { autocomplete: "off", role: "search" } }, field("Identifier", q), field("Status", statusFilter));

  function search() {
    clearTimeout(timer);
    timer = null;
    Object.assign(state, { q: q.value, status: statusFilter.value, offset: 0 });
    clear(status);
    load();
  }
  q.addEventListener("input", () => {
    clearTimeout(timer);
    timer = setTimeout(search, SEARCH_DELAY_MS);
  });
  statusFilter.addEventListener("change", search);
  filters.addEventListener("submit", (event) => {
    event.preventDefault();
    search();
  });

  /** A button that calls ``method path`` for the end user, says what happened and reloads the page. */
  function change(endUser, label, name, method, path, question, done) {
    return actionButton(
      label,
      question,
      async () => {
        try {
          await call(method, `${base}/${encodeURIComponent(endUser.id)}${path}`);
          status.append(message("ok", done));
        } finally {
          await load();
        }
      },
      status,
      name,
    );
  }

  /** The form of the end user's own rate limits, above the list (a reload of the list keeps it). */
  function editLimits(endUser) {
    // the value an empty field takes is the account's (or the gateway's): known where no own one is set
    const inherited = Object.fromEntries(
      END_USER_LIMITS.filter(([key]) => endUser[key] === null || endUser[key] === undefined).map(([key]) => [key, endUser.limits[key]]),
    );
    const form = limitsForm({
      name: "end-user",
      title: `Own limits of end user ${endUser.identifier} (#${endUser.id})`,
      limits: END_USER_LIMITS,
      current: endUser,
      inForce: inherited,
      path: `${base}/${encodeURIComponent(endUser.id)}`,
      unset: "account's end-user limit",
      onSaved: load,
      onClose: () => clear(editor),
    });
    clear(editor).append(form);
    form.querySelector("input").focus();
  }

  function actions(endUser) {
    const who = `End user ${endUser.identifier} (#${endUser.id})`;
    const node = el("div", { class: "row-actions" });
    if (endUser.status !== "deleted") {
      node.append(el("button", { text: "Limits", attrs: { type: "button", "data-action": "limits" }, on: { click: () => editLimits(endUser) } }));
    }
    if (endUser.status === "active") {
      node.append(change(endUser, "Disable", "disable", "POST", "/disable", null, `${who} is disabled: its requests get 403.`));
    } else if (endUser.status === "disabled") {
      node.append(change(endUser, "Enable", "enable", "POST", "/enable", null, `${who} is active again.`));
    }
    if (endUser.status !== "deleted") {
      const question =
        `Delete end user ${endUser.identifier} (#${endUser.id}) of ${account.name}? Its requests get 403 from now on, ` +
        "and this cannot be undone. Its message IDs stay reserved (never given to anyone else) and its texts keep " +
        "tracing to it; the account cannot use this identifier for a new end user.";
      node.append(change(endUser, "Delete", "delete", "DELETE", "", question, `${who} is deleted; its message IDs stay reserved.`));
    }
    return node;
  }

  async function load() {
    const current = loads();
    try {
      const page = await call("GET", `${base}${query({ q: state.q, status: state.status, limit: PAGE, offset: state.offset })}`);
      if (!current()) return;
      const extras = EXTRA_FIELDS.filter(([name]) => page.data.some((e) => e[name] !== undefined && e[name] !== null));
      const rows = page.data.map((e) => [
        String(e.id),
        el("span", { class: "identifier", text: e.identifier }),
        e.status,
        formatDate(e.created_at),
        formatDate(e.last_seen_at),
        messageIdCount(e),
        ...extras.map(([name]) => valueLines(e[name], LEAF_TEXT[name])),
        actions(e),
      ]);
      const headers = ["ID", "Identifier", "Status", "First seen", "Last seen", "Message IDs", ...extras.map(([, label]) => label), ""];
      const empty = state.q || state.status ? "No end user matches." : "This account has no end users yet.";
      clear(list).append(
        table(headers, rows, { class: "grid end-users", empty }),
        pager(page, (offset) => {
          state.offset = offset;
          load();
        }),
      );
    } catch (error) {
      if (current()) clear(list).append(problem(error, "The end-user list"));
    }
  }

  const close = el("button", { text: "Close", attrs: { type: "button", "data-action": "close-end-users" }, on: { click: onClose } });
  const panel = el(
    "section",
    { class: "end-users-panel", attrs: { "data-user-id": account.id, "aria-label": `End users of ${account.name}` } },
    el("div", { class: "panel-head" }, el("h3", { text: `End users of ${account.name} (#${account.id})` }), close),
    el("p", {
      class: "note",
      text:
        "The users of this account's platform, by the identifier its requests send (safety_identifier, user or metadata.user_id). " +
        "Each has message IDs of its own, so a trace names it; a disabled or deleted end user's requests get 403.",
    }),
    filters,
    status,
    editor,
    list,
  );
  load();
  return panel;
}
