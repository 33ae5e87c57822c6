// The trace page: a suspect text in, the verdict, the named user (or why no one), the
// candidates, the blocks and the text with each token coloured by its evidence.

import { ApiError, call, fetchText, saveJson } from "./api.js";
import { append, clear, el, field, formatNumber, formatP, message, select, table } from "./dom.js";

const EVIDENCE_CLASS = { supports: "tok tok-supports", contradicts: "tok tok-contradicts" };
const DECODERS = [
  ["auto", "auto (counting, then likelihood)"],
  ["counting", "counting"],
  ["likelihood", "likelihood"],
];
// the identity test: name a user only if every other registered user is rejected at this level
const IDENTITY_LEVELS = [
  ["", "off (the gateway's setting)"],
  ["0.01", "0.01"],
  ["0.001", "0.001"],
];

export function renderTrace(root) {
  const text = el("textarea", {
    attrs: { name: "text", rows: 10, spellcheck: "false", placeholder: "Paste the suspect text here…", "aria-label": "Text to trace" },
  });
  const file = el("input", { attrs: { type: "file", name: "file", accept: ".txt,text/plain" } });
  const decoder = select("decoder", DECODERS, "auto");
  const identity = select("identity_level", IDENTITY_LEVELS, "");
  const submit = el("button", { text: "Trace", attrs: { type: "submit", class: "primary" } });
  const status = el("div", { class: "status-line" });
  const result = el("section", { class: "trace-result", attrs: { "aria-live": "polite" } });

  file.addEventListener("change", async () => {
    const chosen = file.files && file.files[0];
    if (!chosen) return;
    text.value = await chosen.text();
  });

  const form = el(
    "form",
    { class: "trace-form no-print" },
    field("Text", text),
    el("div", { class: "row" }, field("Or a .txt file", file), field("Decoder", decoder), field("Identity test", identity), submit),
    status,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    if (!text.value.trim()) {
      clear(status).append(message("error", "Paste a text or choose a file first."));
      return;
    }
    submit.disabled = true;
    clear(status).append(message("notice", "Tracing…"));
    try {
      const body = { text: text.value, include_tokens: true, decoder: decoder.value };
      if (identity.value) body.identity_level = Number(identity.value);
      const report = await call("POST", "/trace", body);
      clear(status);
      showReport(result, report);
    } catch (error) {
      clear(status).append(message("error", error instanceof ApiError ? error.message : String(error)));
    } finally {
      submit.disabled = false;
    }
  });

  append(clear(root), el("h2", { text: "Trace a text" }), form, result);
}

/** Who the evidence is shown for: the named user, else the best candidate. */
function subjectOf(report) {
  if (report.attribution) return { user_id: report.attribution.user_id, name: report.attribution.name, named: true };
  const best = report.candidates[0];
  return best ? { user_id: best.user_id, name: best.name, named: false } : null;
}

function userLabel(who) {
  return who.name ? `${who.name} (user #${who.user_id})` : `user #${who.user_id}`;
}

function verdictBox(report) {
  const named = report.attribution;
  const box = el("div", { class: `verdict ${report.watermarked ? "verdict-yes" : "verdict-no"}`, attrs: { "data-verdict": report.watermarked ? "watermarked" : "not_watermarked" } });
  box.append(
    el("p", { class: "verdict-head", text: report.watermarked ? "Watermarked" : "Not watermarked" }),
    el("p", { class: "verdict-p" }, "p-value ", el("strong", { class: "p-value", text: formatP(report.p_value) }), ` (${report.decoder} decoder)`),
  );
  if (report.model) {
    // the served model whose reading of the text decided (several models: docs/models.md)
    box.append(el("p", { class: "verdict-model" }, "Model: ", el("strong", { class: "model", text: report.model })));
  }
  const who = el("p", { class: "attribution" });
  if (named) {
    who.dataset.userId = String(named.user_id);
    const by = report.named_by === "watermark+retrieval" ? " (watermark test of the users the generation log led to)" : "";
    append(who, "Named: ", el("strong", { class: "named-user", text: userLabel(named) }), `, confidence ${formatNumber(named.confidence)}, p ${formatP(named.p_value)}${by}`);
  } else if (!report.watermarked) {
    append(who, "Named: ", el("strong", { class: "named-user", text: "no one" }), " — the text shows no significant watermark.");
  } else if (identityWithheld(report)) {
    append(
      who,
      "Named: ",
      el("strong", { class: "named-user", text: "no one" }),
      ` — another registered user could explain the text too (identity test p ${formatP(report.identity_p_value)}, above the level ${report.identity_level}).`,
    );
  } else {
    append(
      who,
      "Named: ",
      el("strong", { class: "named-user", text: "no one" }),
      ` — the text is watermarked, but no registered user is confident enough (best confidence ${formatNumber(report.confidence)}` +
        (report.margin === null || report.margin === undefined ? ")." : `, margin ${formatNumber(report.margin)}).`),
    );
  }
  box.append(who);
  const witness = witnessLine(report);
  if (witness) box.append(witness);
  return box;
}

const WITNESS_TEXT = {
  corroborated: "Corroborated — the named user's generation log holds a matching completion.",
  not_found: "No matching generation in the log.",
  leads: "The generation log holds similar completions (leads, not a naming).",
  disabled: "The gateway keeps no content sketches (provenance off).",
};

/** The second witness: does the generation log hold a completion like the text? */
function witnessLine(report) {
  const c = report.corroboration;
  if (!c) return null;
  const text = c.status === "not_found" && report.attribution && c.note ? `Watermark only — ${c.note.replace(/^watermark only — /, "")}.` : WITNESS_TEXT[c.status];
  return el("p", { class: `witness witness-${c.status}`, text, attrs: { "data-corroboration": c.status } });
}

function matchesTable(report) {
  const matches = report.corroboration ? report.corroboration.matches : [];
  return table(
    ["User", "Request", "Created", "Similarity"],
    matches.map((m) => [`user #${m.user_id}`, m.request_id, m.created_at, formatNumber(m.similarity)]),
    { class: "grid matches", empty: "No logged completion resembles the text." },
  );
}

/** The identity test ran on the best candidate and kept its name back. */
function identityWithheld(report) {
  const level = report.identity_level;
  const p = report.identity_p_value;
  return level !== null && level !== undefined && p !== null && p !== undefined && p > level;
}

function facts(report) {
  const rows = [
    ["Test", report.test],
    ["Key version", report.key_version || "–"],
    ["Encoder", report.encoder || "–"],
    ["Scored tokens", report.scored_tokens],
    ["Decoded message", report.decoded_message],
    ["Confidence", formatNumber(report.confidence)],
  ];
  if (report.sigma !== null && report.sigma !== undefined) rows.push(["Std-dev statistic (σ)", formatNumber(report.sigma, 3)]);
  if (report.temperature !== null && report.temperature !== undefined) rows.push(["Assumed temperature", formatNumber(report.temperature, 2)]);
  if (report.edit_rate !== null && report.edit_rate !== undefined) rows.push(["Assumed edit rate", formatNumber(report.edit_rate, 3)]);
  if (report.identity_level !== null && report.identity_level !== undefined) {
    const p = report.identity_p_value;
    rows.push(["Identity test", p === null || p === undefined ? `level ${report.identity_level}, not run` : `p ${formatP(p)} at level ${report.identity_level}`]);
  }
  if (report.report_id) rows.push(["Report", report.report_id]);
  const list = el("dl", { class: "facts" });
  for (const [name, value] of rows) list.append(el("dt", { text: name }), el("dd", { text: value }));
  return list;
}

function candidatesTable(report) {
  return table(
    ["User", "Score", "Hamming", "p-value"],
    report.candidates.map((c) => [userLabel(c), formatNumber(c.score), String(c.hamming), formatP(c.p_value)]),
    { class: "grid candidates", empty: "No registered user to compare with." },
  );
}

function blocksTable(report) {
  const shards = report.blocks.length ? report.blocks[0].counts.length : 0;
  const headers = ["Block", ...Array.from({ length: shards }, (_, i) => `shard ${i}`), "Value", "Erased", "Margin", "Confidence"];
  return table(
    headers,
    report.blocks.map((b) => [
      String(b.index),
      ...b.counts.map(String),
      b.value === null ? "–" : String(b.value),
      b.erased ? "yes" : "no",
      String(b.margin),
      formatNumber(b.confidence),
    ]),
    { class: "grid blocks" },
  );
}

/** The text, one span per token: built off-document in a fragment, titles instead of listeners. */
export function tokenView(tokens) {
  const counts = { supports: 0, contradicts: 0, none: 0 };
  const fragment = document.createDocumentFragment();
  for (const token of tokens) {
    const span = document.createElement("span");
    const kind = token.evidence || null;
    span.className = EVIDENCE_CLASS[kind] || "tok tok-none";
    counts[kind || "none"] += 1;
    span.textContent = token.text;
    if (token.block !== null && token.block !== undefined) {
      let title = `block ${token.block}, shards ${token.shards.join("/")}`;
      if (token.llr !== null && token.llr !== undefined) title += `, LLR ${token.llr.toFixed(3)}`;
      span.title = kind ? `${title}: ${kind}` : title;
    } else {
      span.title = "not scored";
    }
    fragment.append(span);
  }
  const text = el("div", { class: "token-text", attrs: { "data-tokens": tokens.length } });
  text.append(fragment);
  return { text, counts };
}

function showReport(root, report) {
  const subject = subjectOf(report);
  const actions = el("div", { class: "actions no-print" });
  const actionStatus = el("span", { class: "action-status" });
  const download = el("button", { text: "Download signed report", attrs: { type: "button", "data-action": "download-report" } });
  download.addEventListener("click", async () => {
    clear(actionStatus);
    try {
      const signed = await fetchText(`/trace/${encodeURIComponent(report.report_id)}`);
      saveJson(signed, `${report.report_id}.json`);
      actionStatus.append(message("ok", "Report saved."));
    } catch (error) {
      actionStatus.append(message("error", error instanceof ApiError ? error.message : String(error)));
    }
  });
  const print = el("button", { text: "Print", attrs: { type: "button", "data-action": "print" }, on: { click: () => window.print() } });
  actions.append(download, print, actionStatus);

  const sections = [verdictBox(report), actions, facts(report), el("h3", { text: "Top candidates" }), candidatesTable(report)];
  if (report.corroboration && report.corroboration.status !== "disabled") sections.push(el("h3", { text: "Generation log" }), matchesTable(report));
  sections.push(el("h3", { text: "Blocks" }), blocksTable(report));
  if (report.tokens) {
    const { text, counts } = tokenView(report.tokens);
    const whom = subject ? `${subject.named ? "the named user" : "the best candidate"}, ${userLabel(subject)}` : "no candidate";
    const legend = el(
      "p",
      { class: "legend" },
      `Evidence for ${whom}: `,
      el("span", { class: "tok tok-supports", text: `supports (${counts.supports})` }),
      " ",
      el("span", { class: "tok tok-contradicts", text: `contradicts (${counts.contradicts})` }),
      " ",
      el("span", { class: "tok tok-none", text: `not scored (${counts.none})` }),
      ". Hover a token for its block and LLR.",
    );
    legend.dataset.supports = String(counts.supports);
    legend.dataset.contradicts = String(counts.contradicts);
    sections.push(el("h3", { text: "Text" }), legend, text);
  }
  append(clear(root), ...sections);
}
