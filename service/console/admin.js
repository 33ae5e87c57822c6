// The administration views: users (with each account's end users, end_users.js), API keys, key
// versions, the trace audit log, the registry's audit trail and usage.
// Each view loads its page from the API (the newest request only: dom.js latest) and shows the API's
// own error message when it fails.

import { call, query } from "./api.js";
import { PAGE, actionButton, append, clear, el, field, formatDate, formatP, latest, message, pager, problem, select, table } from "./dom.js";
import { endUsersPanel } from "./end_users.js";
import { ACCOUNT_LIMITS, limitsForm } from "./limits.js";

const ROLES = [["user", "user"], ["auditor", "auditor"], ["admin", "admin"]];

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
  const limits = el("div");
  const endUsers = el("div");

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

  const loads = latest();
  async function load() {
    const current = loads();
    try {
      const page = await call("GET", `/admin/users${query({ q: state.q, role: state.role, status: state.status, limit: PAGE, offset: state.offset })}`);
      if (!current()) return;
      const rows = page.data.map((user) => {
        const actions = el("div", { class: "row-actions" });
        if (user.status !== "deleted") {
          actions.append(el("button", {
            text: "Limits",
            attrs: { type: "button", "data-action": "limits" },
            on: {
              click: () => {
                const form = limitsForm({
                  name: "account",
                  title: `Limits of ${user.name} (#${user.id})`,
                  limits: ACCOUNT_LIMITS,
                  current: user,
                  path: `/admin/users/${encodeURIComponent(user.id)}`,
                  unset: "gateway's default",
                  onSaved: load,
                  onClose: () => clear(limits),
                });
                clear(limits).append(form);
                form.querySelector("input").focus();
              },
            },
          }));
        }
        actions.append(el("button", {
          text: "End users",
          attrs: { type: "button", "data-action": "end-users" },
          on: {
            click: () => {
              clear(endUsers).append(endUsersPanel(user, () => clear(endUsers)));
              endUsers.scrollIntoView({ block: "start" });
            },
          },
        }));
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
      if (current()) clear(list).append(problem(error, "The user list"));
    }
  }

  append(clear(root), el("h2", { text: "Users" }), create, created, filters, status, limits, list, endUsers);
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

  const loads = latest();
  async function load() {
    const current = loads();
    try {
      const page = await call("GET", `/admin/api-keys${query({ prefix: state.prefix, user_id: state.userId, limit: PAGE, offset: state.offset })}`);
      if (!current()) return;
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
      if (current()) clear(list).append(problem(error, "The key list"));
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

  const loads = latest();
  async function load() {
    const current = loads();
    try {
      const versions = await call("GET", "/admin/key-versions");
      if (!current()) return;
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
      if (current()) clear(list).append(problem(error, "The key-version list"));
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

  const loads = latest();
  async function load() {
    const current = loads();
    try {
      const page = await call("GET", `/traces${query({ ...state, limit: PAGE })}`);
      if (!current()) return;
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
      if (current()) clear(list).append(problem(error, "The audit log"));
    }
  }

  append(clear(root), el("h2", { text: "Trace audit log" }), filters, list);
  load();
}

// --- registry audit trail ------------------------------------------------------------------

// the actions of each kind of target (an action is ``<target>.<verb>``, and every entry about a
// target of that kind has one of them): "<prefix>.*" in the action filter asks for the whole group,
// through the API's target_type filter
const REGISTRY_GROUPS = [
  { label: "Users", item: "user", target: "user", actions: ["user.create", "user.update", "user.disable", "user.enable", "user.delete"] },
  { label: "API keys", item: "API-key", target: "api_key", actions: ["api_key.issue", "api_key.revoke"] },
  { label: "Key versions", item: "key-version", target: "key_version", actions: ["key_version.register", "key_version.activate", "key_version.retire"] },
  { label: "Message IDs", item: "message-ID", target: "message_length", actions: ["message_ids.allocate"] },
  { label: "End users", item: "end-user", target: "end_user", actions: ["end_user.create", "end_user.update", "end_user.disable", "end_user.enable", "end_user.delete", "end_user.merge"] },
];

function groupValue(group) {
  return `${group.actions[0].split(".")[0]}.*`;
}

/** The action filter's options: per group, the whole group (when it has several actions), then each action. */
function actionOptions() {
  return REGISTRY_GROUPS.map((group) => ({
    label: group.label,
    options: [
      ...(group.actions.length > 1 ? [[groupValue(group), `${groupValue(group)} (every ${group.item} change)`]] : []),
      ...group.actions.map((a) => [a, a]),
    ],
  }));
}

/** The API's filters for an option of the action filter: a group by its target type, an action by name. */
function actionFilter(value) {
  const group = REGISTRY_GROUPS.find((g) => groupValue(g) === value);
  return group ? { target_type: group.target } : { action: value };
}

function actorLabel(actor) {
  if (actor.kind === "api") return `${actor.name || ""} (#${actor.user_id})`;
  return actor.kind === "cli" ? "command line" : "gateway start-up";
}

function shown(value) {
  if (value === null || value === undefined) return "–";
  return typeof value === "object" ? JSON.stringify(value) : String(value);
}

/** One line per changed field: "field: before → after" (only the new value for a new row). */
function changeLines(changes) {
  const before = (changes && changes.before) || null;
  const after = (changes && changes.after) || {};
  const names = [...new Set([...Object.keys(before || {}), ...Object.keys(after)])];
  return el(
    "div",
    { class: "changes" },
    names.map((name) =>
      el("div", { text: before === null ? `${name}: ${shown(after[name])}` : `${name}: ${shown(before[name])} → ${shown(after[name])}` }),
    ),
  );
}

export function renderRegistryAudit(root) {
  // newest first; ``cursors`` holds the after_seq of each page before the current one
  const state = { action: "", after: null, cursors: [] };
  const list = el("div");
  const head = el("p", { class: "audit-head" });
  const action = select("action", [["", "any action"], ...actionOptions()]);
  const filters = searchForm([field("Action", action)], () => {
    Object.assign(state, { action: action.value, after: null, cursors: [] });
    load();
  });

  function go(after, cursors) {
    Object.assign(state, { after, cursors });
    load();
  }

  const loads = latest();
  async function load() {
    const current = loads();
    try {
      const page = await call("GET", `/admin/audit${query({ order: "desc", ...actionFilter(state.action), after_seq: state.after, limit: PAGE })}`);
      if (!current()) return;
      clear(head);
      if (page.head) {
        head.dataset.seq = String(page.head.seq);
        head.append(`Head: entry ${page.head.seq}, hash ${page.head.entry_hash}. Keep a copy elsewhere and check the trail with xmark verify-audit --anchor ${page.head.seq}:<hash>.`);
      }
      const rows = page.data.map((e) => [
        String(e.seq),
        formatDate(e.created_at),
        actorLabel(e.actor),
        e.action,
        `${e.target.type} #${e.target.id}`,
        changeLines(e.changes),
        e.request_id || "–",
      ]);
      const nav = el(
        "div",
        { class: "pager" },
        el("button", {
          text: "Newer",
          attrs: { type: "button", disabled: state.cursors.length === 0, "data-action": "previous" },
          on: { click: () => go(state.cursors[state.cursors.length - 1], state.cursors.slice(0, -1)) },
        }),
        el("span", { class: "pager-range", text: page.data.length ? `entries ${page.data[0].seq}–${page.data[page.data.length - 1].seq}` : "no entries" }),
        el("button", {
          text: "Older",
          attrs: { type: "button", disabled: !page.has_more, "data-action": "next" },
          on: { click: () => go(page.next_after_seq, [...state.cursors, state.after]) },
        }),
      );
      clear(list).append(
        table(["Seq", "When", "Actor", "Action", "Target", "Changes", "Request"], rows, { class: "grid registry", empty: "No change matches." }),
        nav,
      );
    } catch (error) {
      if (current()) clear(list).append(problem(error, "The registry audit trail"));
    }
  }

  append(
    clear(root),
    el("h2", { text: "Registry audit trail" }),
    el("p", { text: "Every change to users, API keys, key versions, message IDs and end users, newest first: hash-chained and signed by the gateway." }),
    filters,
    head,
    list,
  );
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

  const loads = latest();
  async function load() {
    const current = loads();
    try {
      const page = await call("GET", `/admin/usage${query({ ...state, limit: PAGE })}`);
      if (!current()) return;
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
      if (current()) clear(list).append(problem(error, "Usage"));
    }
  }

  append(clear(root), el("h2", { text: "Usage per user and day" }), filters, list);
  load();
}
