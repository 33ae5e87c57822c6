// The administration views: users, API keys, key versions, the trace audit log and usage.
// Each view loads its page from the API and shows the API's own error message when it fails.

import { ApiError, call, query } from "./api.js";
import { append, clear, el, field, formatDate, formatP, message, pager, select, table } from "./dom.js";

const PAGE = 20;
const ROLES = [["user", "user"], ["auditor", "auditor"], ["admin", "admin"]];

function problem(error, what) {
  return message("error", `${what}: ${error instanceof ApiError ? error.message : String(error)}`);
}

/** A button that asks before it acts, then runs ``act`` and reports its error in ``status``. */
function actionButton(label, question, act, status, name) {
  return el("button", {
    text: label,
    attrs: { type: "button", "data-action": name },
    on: {
      click: async () => {
        if (question && !window.confirm(question)) return;
        clear(status);
        try {
          await act();
        } catch (error) {
          status.append(problem(error, label));
        }
      },
    },
  });
}

/** The one-time display of a new API key, with a copy button. */
function secretBox(title, key) {
  const value = el("input", { class: "secret", attrs: { type: "text", readonly: true, value: key, "aria-label": "New API key", "data-secret": "api-key" } });
  const copied = el("span", { class: "copied" });
  const copy = el("button", {
    text: "Copy",
    attrs: { type: "button", "data-action": "copy-key" },
    on: {
      click: async () => {
        value.select();
        try {
          await navigator.clipboard.writeText(key);
          copied.textContent = "Copied.";
        } catch {
          copied.textContent = "Selected: press Ctrl+C to copy.";
        }
      },
    },
  });
  return el("div", { class: "secret-box" }, el("p", { text: `${title} It is shown only once: copy it now.` }), el("div", { class: "row" }, value, copy, copied));
}

function searchForm(controls, onSubmit) {
  const form = el("form", { class: "filters row" }, ...controls, el("button", { text: "Search", attrs: { type: "submit" } }));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    onSubmit();
  });
  return form;
}

// --- users ---------------------------------------------------------------------------------

export function renderUsers(root) {
  const state = { q: "", role: "", status: "", offset: 0 };
  const status = el("div", { class: "status-line" });
  const created = el("div");
  const list = el("div");

  const q = el("input", { attrs: { type: "search", name: "q", placeholder: "name contains…" } });
  const role = select("role", [["", "any role"], ...ROLES]);
  const userStatus = select("status", [["", "any status"], ["active", "active"], ["disabled", "disabled"], ["deleted", "deleted"]]);
  const filters = searchForm([field("Name", q), field("Role", role), field("Status", userStatus)], () => {
    Object.assign(state, { q: q.value.trim(), role: role.value, status: userStatus.value, offset: 0 });
    load();
  });

  const newName = el("input", { attrs: { type: "text", name: "name", required: true, maxlength: 200 } });
  const newRole = select("new-role", ROLES, "user");
  const create = el(
    "form",
    { class: "create row" },
    field("New user", newName),
    field("Role", newRole),
    el("button", { text: "Create user", attrs: { type: "submit", class: "primary" } }),
  );
  create.addEventListener("submit", async (event) => {
    event.preventDefault();
    clear(status);
    clear(created);
    try {
      const user = await call("POST", "/admin/users", { name: newName.value.trim(), role: newRole.value });
      newName.value = "";
      created.append(secretBox(`User ${user.name} (#${user.id}) was created with this API key.`, user.api_key));
      created.dataset.userId = String(user.id);
      await load();
    } catch (error) {
      status.append(problem(error, "Creating users"));
    }
  });

  async function load() {
    try {
      const page = await call("GET", `/admin/users${query({ q: state.q, role: state.role, status: state.status, limit: PAGE, offset: state.offset })}`);
      const rows = page.data.map((user) => {
        const actions = el("div", { class: "row-actions" });
        if (user.status === "active") {
          actions.append(actionButton("Disable", `Disable ${user.name}? Their keys stop working.`, async () => { await call("POST", `/admin/users/${user.id}/disable`); await load(); }, status, "disable"));
        } else if (user.status === "disabled") {
          actions.append(actionButton("Enable", null, async () => { await call("POST", `/admin/users/${user.id}/enable`); await load(); }, status, "enable"));
        }
        if (user.status !== "deleted") {
          actions.append(actionButton("Delete", `Delete ${user.name}? This cannot be undone.`, async () => { await call("DELETE", `/admin/users/${user.id}`); await load(); }, status, "delete"));
        }
        return [String(user.id), user.name, user.role, user.status, formatDate(user.created_at), actions];
      });
      clear(list).append(table(["ID", "Name", "Role", "Status", "Created", ""], rows, { class: "grid users", empty: "No user matches." }), pager(page, (offset) => { state.offset = offset; load(); }));
    } catch (error) {
      clear(list).append(problem(error, "The user list"));
    }
  }

  append(clear(root), el("h2", { text: "Users" }), create, created, filters, status, list);
  load();
}

// --- API keys ------------------------------------------------------------------------------

export function renderKeys(root) {
  const status = el("div", { class: "status-line" });
  const issued = el("div");
  const list = el("div");
  const state = { prefix: "", userId: "", offset: 0 };

  const issueUser = el("input", { attrs: { type: "number", name: "user_id", min: 1, required: true } });
  const issue = el("form", { class: "create row" }, field("Issue a key for user #", issueUser), el("button", { text: "Issue key", attrs: { type: "submit", class: "primary" } }));
  issue.addEventListener("submit", async (event) => {
    event.preventDefault();
    clear(status);
    clear(issued);
    try {
      const key = await call("POST", `/admin/users/${encodeURIComponent(issueUser.value)}/keys`);
      issued.append(secretBox(`Key ${key.prefix}… was issued to user #${issueUser.value}.`, key.api_key));
      Object.assign(state, { userId: issueUser.value, prefix: "", offset: 0 });
      await load();
    } catch (error) {
      status.append(problem(error, "Issuing keys"));
    }
  });

  const prefix = el("input", { attrs: { type: "search", name: "prefix", placeholder: "key prefix…" } });
  const ofUser = el("input", { attrs: { type: "number", name: "of_user", min: 1, placeholder: "any" } });
  const filters = searchForm([field("Prefix", prefix), field("User #", ofUser)], () => {
    Object.assign(state, { prefix: prefix.value.trim(), userId: ofUser.value, offset: 0 });
    load();
  });

  async function load() {
    try {
      const page = await call("GET", `/admin/api-keys${query({ prefix: state.prefix, user_id: state.userId, limit: PAGE, offset: state.offset })}`);
      const rows = page.data.map((key) => [
        String(key.id),
        `#${key.user_id}`,
        `${key.prefix}…`,
        formatDate(key.created_at),
        formatDate(key.last_used_at),
        key.revoked_at
          ? `revoked ${formatDate(key.revoked_at)}`
          : actionButton("Revoke", `Revoke key ${key.prefix}…? Requests with it fail at once.`, async () => { await call("POST", `/admin/users/${key.user_id}/keys/${key.id}/revoke`); await load(); }, status, "revoke"),
      ]);
      clear(list).append(table(["ID", "User", "Prefix", "Created", "Last used", ""], rows, { class: "grid keys", empty: "No key matches." }), pager(page, (offset) => { state.offset = offset; load(); }));
    } catch (error) {
      clear(list).append(problem(error, "The key list"));
    }
  }

  append(clear(root), el("h2", { text: "API keys" }), issue, issued, filters, status, list);
  load();
}

// --- key versions --------------------------------------------------------------------------

export function renderKeyVersions(root) {
  const status = el("div", { class: "status-line" });
  const list = el("div");
  const name = el("input", { attrs: { type: "text", name: "name", required: true, maxlength: 64 } });
  const activate = el(
    "form",
    { class: "create row" },
    field("Activate key version", name),
    el("button", { text: "Activate", attrs: { type: "submit", class: "primary" } }),
  );
  activate.addEventListener("submit", async (event) => {
    event.preventDefault();
    clear(status);
    if (!window.confirm(`Activate key version ${name.value.trim()}? New completions carry it from now on.`)) return;
    try {
      const version = await call("POST", "/admin/key-versions", { name: name.value.trim() });
      status.append(message("ok", `Key version ${version.name} is ${version.status}.`));
      await load();
    } catch (error) {
      status.append(problem(error, "Activating key versions"));
    }
  });

  async function load() {
    try {
      const versions = await call("GET", "/admin/key-versions");
      const rows = versions.data.map((v) => [
        v.name,
        v.status,
        `b=${v.bits} d=${v.block_bits} k=${v.num_keys} δ=${v.delta} ${v.scheme}` + (v.min_entropy ? ` h=${v.min_entropy}` : ""),
        v.fingerprint,
        v.configured ? "yes" : "no",
        formatDate(v.activated_at),
        formatDate(v.retired_at),
        v.status === "retired"
          ? ""
          : actionButton("Retire", `Retire key version ${v.name}? Its texts can still be traced.`, async () => { await call("POST", `/admin/key-versions/${v.id}/retire`); await load(); }, status, "retire"),
      ]);
      clear(list).append(table(["Name", "Status", "Parameters", "Fingerprint", "Secret here", "Activated", "Retired", ""], rows, { class: "grid versions" }));
    } catch (error) {
      clear(list).append(problem(error, "The key-version list"));
    }
  }

  append(clear(root), el("h2", { text: "Key versions" }), activate, status, list);
  load();
}

// --- audit log -----------------------------------------------------------------------------

export function renderAudit(root) {
  const state = { verdict: "", requester_id: "", attributed_user_id: "", offset: 0 };
  const list = el("div");
  const verdict = select("verdict", [["", "any verdict"], ["watermarked", "watermarked"], ["not_watermarked", "not watermarked"]]);
  const requester = el("input", { attrs: { type: "number", name: "requester_id", min: 1, placeholder: "any" } });
  const attributed = el("input", { attrs: { type: "number", name: "attributed_user_id", min: 1, placeholder: "any" } });
  const filters = searchForm([field("Verdict", verdict), field("Requester #", requester), field("Named user #", attributed)], () => {
    Object.assign(state, { verdict: verdict.value, requester_id: requester.value, attributed_user_id: attributed.value, offset: 0 });
    load();
  });

  async function load() {
    try {
      const page = await call("GET", `/traces${query({ ...state, limit: PAGE })}`);
      const rows = page.data.map((t) => [
        formatDate(t.created_at),
        t.report_id || "–",
        t.requester_name ? `${t.requester_name} (#${t.requester_id})` : `#${t.requester_id}`,
        t.verdict,
        t.decoder,
        formatP(t.p_value),
        String(t.scored_tokens),
        t.key_version || "–",
        t.attributed_user_id === null || t.attributed_user_id === undefined ? "no one" : `${t.attributed_user_name || ""} (#${t.attributed_user_id})`,
      ]);
      clear(list).append(
        table(["When", "Report", "Requester", "Verdict", "Decoder", "p-value", "Tokens", "Key version", "Named"], rows, { class: "grid audit", empty: "No trace matches." }),
        pager(page, (offset) => { state.offset = offset; load(); }),
      );
    } catch (error) {
      clear(list).append(problem(error, "The audit log"));
    }
  }

  append(clear(root), el("h2", { text: "Trace audit log" }), filters, list);
  load();
}

// --- usage ---------------------------------------------------------------------------------

export function renderUsage(root) {
  const state = { days: "30", user_id: "", offset: 0 };
  const list = el("div");
  const days = el("input", { attrs: { type: "number", name: "days", min: 1, max: 366, value: "30" } });
  const user = el("input", { attrs: { type: "number", name: "user_id", min: 1, placeholder: "any" } });
  const filters = searchForm([field("Last days", days), field("User #", user)], () => {
    Object.assign(state, { days: days.value, user_id: user.value, offset: 0 });
    load();
  });

  async function load() {
    try {
      const page = await call("GET", `/admin/usage${query({ ...state, limit: PAGE })}`);
      const rows = page.data.map((u) => [
        u.day,
        u.user_name ? `${u.user_name} (#${u.user_id})` : `#${u.user_id}`,
        String(u.requests),
        String(u.completions),
        String(u.prompt_tokens),
        String(u.completion_tokens),
        String(u.embedding_requests ?? 0),
        String(u.embedding_tokens ?? 0),
      ]);
      clear(list).append(
        table(["Day", "User", "Requests", "Completions", "Prompt tokens", "Completion tokens", "Embedding requests", "Embedding tokens"], rows, { class: "grid usage", empty: "No usage in this period." }),
        pager(page, (offset) => { state.offset = offset; load(); }),
      );
    } catch (error) {
      clear(list).append(problem(error, "Usage"));
    }
  }

  append(clear(root), el("h2", { text: "Usage per user and day" }), filters, list);
  load();
}
