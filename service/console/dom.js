// DOM helpers: every piece of text goes into the page as a text node, never as markup.

import { ApiError } from "./api.js";

/** Rows per page in every list of the console. */
export const PAGE = 20;

/**
 * Numbers a view's loads so that an answer that arrives late never replaces a newer one (a search
 * sent while the first page is still loading, a pager clicked twice): ``const loads = latest();``
 * once per view; in each load ``const current = loads();`` before the request, then
 * ``if (!current()) return;`` once it is answered, and its error shown only ``if (current())``.
 */
export function latest() {
  let newest = 0;
  return () => {
    const mine = ++newest;
    return () => mine === newest;
  };
}

/** An element with class names, attributes and children (strings become text nodes). */
export function el(tag, options = {}, ...children) {
  const node = document.createElement(tag);
  if (options.class) node.className = options.class;
  if (options.text !== undefined && options.text !== null) node.textContent = String(options.text);
  for (const [name, value] of Object.entries(options.attrs || {})) {
    if (value === false || value === null || value === undefined) continue;
    node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const [name, handler] of Object.entries(options.on || {})) node.addEventListener(name, handler);
  append(node, ...children);
  return node;
}

/** Append children: nodes as they are, anything else as text. */
export function append(node, ...children) {
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export function clear(node) {
  node.replaceChildren();
  return node;
}

/** A table from column headers and rows of cells (strings or nodes). */
export function table(headers, rows, options = {}) {
  const head = el("thead", {}, el("tr", {}, headers.map((h) => el("th", { text: h, attrs: { scope: "col" } }))));
  const body = el("tbody");
  for (const row of rows) body.append(el("tr", {}, row.map((cell) => el("td", {}, cell))));
  if (rows.length === 0) {
    body.append(el("tr", {}, el("td", { class: "empty", text: options.empty || "Nothing here.", attrs: { colspan: headers.length } })));
  }
  return el("table", { class: options.class || "grid" }, head, body);
}

/** A message box: kind is "error", "notice" or "ok". */
export function message(kind, text) {
  return el("p", { class: `message message-${kind}`, text, attrs: { role: kind === "error" ? "alert" : "status" } });
}

/** An error message for ``what``: the API's own message for an ApiError. */
export function problem(error, what) {
  return message("error", `${what}: ${error instanceof ApiError ? error.message : String(error)}`);
}

/** A button that asks before it acts, then runs ``act`` and reports its error in ``status``. */
export function actionButton(label, question, act, status, name) {
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

export function formatP(p) {
  if (p === null || p === undefined) return "–";
  if (p === 0) return "0";
  return p < 1e-3 ? p.toExponential(2) : p.toFixed(4);
}

export function formatNumber(x, digits = 3) {
  if (x === null || x === undefined) return "–";
  return Number(x).toFixed(digits);
}

export function formatDate(value) {
  if (!value) return "–";
  const date = new Date(value);
  return Number.isNaN(date.getTime()) ? String(value) : date.toISOString().replace("T", " ").slice(0, 19) + "Z";
}

/** A labelled form control. */
export function field(label, control) {
  return el("label", { class: "field" }, el("span", { class: "field-label", text: label }), control);
}

/** A <select> with [value, label] options; an entry {label, options} is a group of them. */
export function select(name, options, selected = "") {
  const node = el("select", { attrs: { name } });
  function add(parent, [value, label]) {
    const option = el("option", { text: label, attrs: { value } });
    if (value === selected) option.selected = true;
    parent.append(option);
  }
  for (const entry of options) {
    if (Array.isArray(entry)) {
      add(node, entry);
      continue;
    }
    const group = el("optgroup", { attrs: { label: entry.label } });
    for (const option of entry.options) add(group, option);
    node.append(group);
  }
  return node;
}

/** Previous / next buttons for a page {total, limit, offset, has_more}. */
export function pager(page, go) {
  const from = page.total === 0 ? 0 : page.offset + 1;
  const to = page.offset + page.data.length;
  return el(
    "div",
    { class: "pager" },
    el("button", {
      text: "Previous",
      attrs: { type: "button", disabled: page.offset === 0, "data-action": "previous" },
      on: { click: () => go(Math.max(0, page.offset - page.limit)) },
    }),
    el("span", { class: "pager-range", text: `${from}–${to} of ${page.total}` }),
    el("button", {
      text: "Next",
      attrs: { type: "button", disabled: !page.has_more, "data-action": "next" },
      on: { click: () => go(page.offset + page.limit) },
    }),
  );
}
