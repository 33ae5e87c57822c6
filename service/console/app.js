// The console's shell: sign-in with an API key, the views the signed-in role may use, and
// hash navigation (#/trace, #/users, ...), which keeps every view bookmarkable without the key.

import { ApiError, call, forgetKey, storedKey, storeKey } from "./api.js";
import { renderAudit, renderKeys, renderKeyVersions, renderRegistryAudit, renderUsage, renderUsers } from "./admin.js";
import { append, clear, el, message } from "./dom.js";
import { renderTrace } from "./trace.js";

const FORENSIC = ["auditor", "admin"];
const VIEWS = [
  { id: "trace", label: "Trace", roles: FORENSIC, render: renderTrace },
  { id: "audit", label: "Audit log", roles: FORENSIC, render: renderAudit },
  { id: "registry", label: "Registry log", roles: FORENSIC, render: renderRegistryAudit },
  { id: "users", label: "Users", roles: ["admin"], render: renderUsers },
  { id: "keys", label: "API keys", roles: ["admin"], render: renderKeys },
  { id: "key-versions", label: "Key versions", roles: ["admin"], render: renderKeyVersions },
  { id: "usage", label: "Usage", roles: ["admin"], render: renderUsage },
];

const main = document.getElementById("main");
const nav = document.getElementById("nav");
const who = document.getElementById("who");
let me = null;

function currentView() {
  const id = location.hash.replace(/^#\/?/, "") || "trace";
  return VIEWS.find((view) => view.id === id) || null;
}

function renderNav() {
  clear(nav);
  clear(who);
  if (!me) return;
  for (const view of VIEWS.filter((v) => v.roles.includes(me.role))) {
    nav.append(el("a", { text: view.label, attrs: { href: `#/${view.id}`, "data-view": view.id } }));
  }
  who.append(
    el("span", { class: "who-name", text: `${me.name} · ${me.role}` }),
    el("button", { text: "Sign out", attrs: { type: "button", "data-action": "sign-out" }, on: { click: signOut } }),
  );
}

function route() {
  if (!me) return;
  const view = currentView();
  for (const link of nav.querySelectorAll("a")) link.classList.toggle("active", view !== null && link.dataset.view === view.id);
  if (!FORENSIC.includes(me.role)) {
    append(clear(main), message("notice", "The console is for auditors and admins. Your key works for the API; ask an admin for an auditor key to trace texts."));
    return;
  }
  if (view === null) {
    append(clear(main), message("error", "No such view."));
    return;
  }
  if (!view.roles.includes(me.role)) {
    append(clear(main), el("div", { class: "forbidden", attrs: { "data-forbidden": view.id } }, message("error", `${view.label}: this view is for admins; your role is ${me.role}.`)));
    return;
  }
  main.dataset.view = view.id;
  view.render(main);
}

function renderSignIn(problem = null) {
  me = null;
  renderNav();
  const key = el("input", { attrs: { type: "password", name: "api-key", autocomplete: "off", required: true, placeholder: "sk-…", "aria-label": "API key" } });
  const form = el(
    "form",
    { class: "sign-in" },
    el("h2", { text: "Sign in" }),
    el("p", { text: "Paste an auditor or admin API key. It is kept in this tab only (session storage) and cleared when you sign out or close the tab." }),
    el("div", { class: "row" }, key, el("button", { text: "Sign in", attrs: { type: "submit", class: "primary" } })),
  );
  if (problem) form.append(problem);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    storeKey(key.value.trim());
    key.value = "";
    await signIn();
  });
  append(clear(main), form);
  key.focus();
}

async function signIn() {
  try {
    me = await call("GET", "/me");
  } catch (error) {
    forgetKey();
    renderSignIn(message("error", error instanceof ApiError ? error.message : String(error)));
    return;
  }
  document.body.dataset.role = me.role;
  renderNav();
  route();
}

function signOut() {
  forgetKey();
  me = null;
  delete document.body.dataset.role;
  delete main.dataset.view;
  history.replaceState(null, "", location.pathname);
  renderSignIn(message("ok", "Signed out: the key is gone from this tab."));
}

window.addEventListener("hashchange", route);
if (storedKey()) signIn();
else renderSignIn();
