"""The markdown report: tables laid out like the paper's Table 1 and ablation table, then the rest."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .metrics import rate_cell

Row = dict[str, Any]

MAIN_METHODS = ("MPAC", "LoSo", "XMark- (k=2)", "XMark (k=2)")

# The paper's own numbers (LLaMA-2-7B, text completion on C4; PPL by LLaMA-2-13B), shown for reference
# beside ours: {method: {T: (BA %, PPL or None)}}.
PAPER_TABLE1 = {
    "MPAC": {150: (94.00, 5.19), 200: (94.00, 5.00), 250: (96.25, 5.03), 300: (98.25, 5.10)},
    "XMark (k=2)": {150: (98.75, 4.68), 200: (99.00, 4.61), 250: (99.75, 4.60), 300: (100.00, 4.56)},
}
PAPER_ABLATION = {
    "LoSo": {150: (74.06, 4.45), 250: (81.38, 4.46)},
    "XMark (k=2)": {150: (82.62, 4.84), 250: (88.00, 4.60)},
    "XMark (k=3)": {150: (82.94, 5.01), 250: (89.38, 4.97)},
    "XMark (k=4)": {150: (84.25, 5.07), 250: (92.06, 5.14)},
    "XMark- (k=2)": {150: (81.31, None), 250: (88.06, None)},
    "XMark- (k=3)": {150: (80.69, None), 250: (87.75, None)},
    "XMark- (k=4)": {150: (80.31, None), 250: (89.56, None)},
}


def paper_rows(reference: dict[str, dict[int, tuple[float, float | None]]], t_grid: list[int]) -> list[str]:
    """Reference rows in the t_table layout, only where the paper reports every T of the grid."""
    out = []
    for method, cells in reference.items():
        if not all(t in cells for t in t_grid):
            continue
        values = [cells[t] for t in t_grid]
        row = [f"*paper: {method}*"]
        for ba, ppl in values:
            row += [f"*{ba:.2f}*", "—" if ppl is None else f"*{ppl:.2f}*"]
        avg_ppl = (
            None if any(p is None for _, p in values) else sum(p for _, p in values if p is not None) / len(values)
        )
        row += [f"*{sum(b for b, _ in values) / len(values):.2f}*", "—" if avg_ppl is None else f"*{avg_ppl:.2f}*"]
        out.append("| " + " | ".join(row) + " |")
    return out


def _pct(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{100 * value:.{digits}f}"


def _num(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _find(rows: Iterable[Row], **match: Any) -> Row | None:
    for row in rows:
        if all(row.get(k) == v for k, v in match.items()):
            return row
    return None


def _avg(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present and len(present) == len(values) else None


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in body]
    return out


def t_table(
    quality: list[Row],
    methods: Iterable[str],
    t_grid: list[int],
    *,
    bits: int,
    delta: float,
    temperature: float,
    field: str = "ba",
    ppl: bool = True,
    num_keys: int | None = None,
) -> list[str]:
    """Paper Table 1 layout: per T a BA and a PPL column, then Avg. BA and Avg. PPL."""
    header = ["Method"]
    for t in t_grid:
        header += [f"T={t} BA↑"] + ([f"T={t} PPL↓"] if ppl else [])
    header += ["Avg. BA↑"] + (["Avg. PPL↓"] if ppl else [])
    body = []
    for method in methods:
        bas: list[float | None] = []
        ppls: list[float | None] = []
        cells = []
        for t in t_grid:
            if method == "Unwatermarked":
                row = _find(quality, method=method, temperature=temperature, T=t)
            else:
                match: dict[str, Any] = {
                    "method": method,
                    "bits": bits,
                    "delta": delta,
                    "temperature": temperature,
                    "T": t,
                }
                if num_keys is not None:
                    match["num_keys"] = num_keys
                row = _find(quality, **match)
            ba = row.get(field) if row else None
            pp = row.get("ppl") if row else None
            if method.startswith("XMark-"):
                pp = None  # same generations as XMark: the paper leaves this cell empty
            bas.append(ba)
            ppls.append(pp)
            cells += [_pct(ba)] + ([_num(pp)] if ppl else [])
        label = f"{method} (BA: chance)" if method == "Unwatermarked" else method
        body.append([label] + cells + [_pct(_avg(bas))] + ([_num(_avg(ppls))] if ppl else []))
    return _table(header, body)


def _n_users(quality: list[Row], **match: Any) -> str:
    row = _find(quality, **match)
    return str(row["n_users"]) if row else "0"


def render(results: dict[str, Any]) -> str:
    cfg = results["config"]
    q: list[Row] = results["quality"]
    t_grid = list(cfg["t_grid"])
    b0, d0, temp0 = cfg["main_bits"], cfg["main_delta"], cfg["main_temperature"]
    timing = results["timing"]
    lines: list[str] = []
    add = lines.append
    add(f"# XMark evaluation on {results['model']['name']}")
    add("")
    add(f"Run **{cfg['name']}**: {results['run_description']}")
    add("")
    add("## Protocol")
    for item in results["protocol_notes"]:
        add(f"- {item}")
    add("")
    add(f"## Table 1 — bit accuracy (%) and perplexity against T (b={b0}, δ={d0:g}, temperature {temp0:g})")
    add("")
    add(
        f"Users per cell: {_n_users(q, method='XMark (k=2)', bits=b0, delta=d0, temperature=temp0, T=t_grid[0])}. "
        "BA decoded from the generated token ids. The unwatermarked row's BA is the XMark decoder read on "
        "unwatermarked text (chance level, ≈ 50 %); its PPL is the reference the increase is measured against."
    )
    ses = [r["ba_se"] for r in q if r.get("ba_se") is not None and r["method"] != "Unwatermarked"]
    if ses:
        add("")
        add(
            f"Sampling noise: the standard error of a BA cell across users is at most {100 * max(ses):.1f} points "
            f"(median {100 * sorted(ses)[len(ses) // 2]:.1f}) over all tables of this run; differences smaller than "
            "that are not resolved."
        )
    add("")
    lines += t_table(q, ("Unwatermarked", *MAIN_METHODS), t_grid, bits=b0, delta=d0, temperature=temp0)
    if b0 == 8 and d0 == 2.0:
        lines += paper_rows(PAPER_TABLE1, t_grid)
        add("")
        add(
            "Rows in italics are the paper's (LLaMA-2-7B, text completion on C4, PPL by LLaMA-2-13B; its unwatermarked "
            "PPL is 3.97), for reference only: a different model, task mix and judge."
        )
    add("")
    add("Perplexity increase against unwatermarked text (same T, same temperature):")
    add("")
    body = []
    for method in ("MPAC", "LoSo", "XMark (k=2)"):
        body.append(
            [method]
            + [
                _num((_find(q, method=method, bits=b0, delta=d0, temperature=temp0, T=t) or {}).get("ppl_increase"))
                for t in t_grid
            ]
        )
    lines += _table(["Method"] + [f"T={t} ΔPPL" for t in t_grid], body)
    add("")
    add("### The same texts read back from their re-tokenized text (what `/trace` sees)")
    add("")
    lines += t_table(q, MAIN_METHODS, t_grid, bits=b0, delta=d0, temperature=temp0, field="ba_retok", ppl=False)
    add("")
    add("Exact-message rate (%), generated ids / re-tokenized text:")
    add("")
    body = []
    for method in MAIN_METHODS:
        cells = []
        for t in t_grid:
            row = _find(q, method=method, bits=b0, delta=d0, temperature=temp0, T=t)
            cells.append(
                f"{_pct(row.get('exact') if row else None, 1)} / {_pct(row.get('exact_retok') if row else None, 1)}"
            )
        body.append([method, *cells])
    lines += _table(["Method"] + [f"T={t}" for t in t_grid], body)
    add("")
    for temp in cfg["temperatures"]:
        if temp == temp0:
            continue
        add(f"### Table 1 at temperature {temp:g}")
        add("")
        lines += t_table(q, ("Unwatermarked", *MAIN_METHODS), t_grid, bits=b0, delta=d0, temperature=temp)
        add("")
    bits_grid = list(cfg["bits_grid"])
    if len(bits_grid) > 1:
        add(f"## Bit accuracy (%) against message length b (δ={d0:g}, temperature {temp0:g})")
        add("")
        header = ["Method"] + [f"b={b} T={t}" for b in bits_grid for t in (t_grid[0], t_grid[-1])]
        body = []
        for method in MAIN_METHODS:
            body.append(
                [method]
                + [
                    _pct((_find(q, method=method, bits=b, delta=d0, temperature=temp0, T=t) or {}).get("ba"))
                    for b in bits_grid
                    for t in (t_grid[0], t_grid[-1])
                ]
            )
        lines += _table(header, body)
        add("")
        add("Re-tokenized text, same cells:")
        add("")
        body = []
        for method in MAIN_METHODS:
            body.append(
                [method]
                + [
                    _pct((_find(q, method=method, bits=b, delta=d0, temperature=temp0, T=t) or {}).get("ba_retok"))
                    for b in bits_grid
                    for t in (t_grid[0], t_grid[-1])
                ]
            )
        lines += _table(header, body)
        add("")
    lines += _ablation(q, cfg)
    lines += _delta(q, cfg)
    lines += _attribution(results.get("attribution", []), cfg)
    lines += _detection(results.get("detection", []), cfg)
    lines += _robustness(results.get("robustness", []), cfg)
    add("## Plots")
    add("")
    for name, caption in results.get("plots", {}).items():
        add(f"![{caption}]({name})")
        add("")
    add("## Run time")
    add("")
    gen = timing["generation"]
    add(
        f"- Generation: {gen['rows']} completions of {cfg['t_grid'][-1] // 2} tokens in {gen['seconds']:.0f} s "
        f"({gen['generated_tokens_per_s']} generated tokens/s, {gen['seconds_per_row']} s per completion) on "
        f"{timing['hardware']}, with the {gen.get('engine') or 'engine not recorded'}; "
        f"{gen.get('invocations', 1)} invocation(s) filled the completion cache."
    )
    add(f"- Analysis (decoding, tests, attribution, attacks): {timing['analysis_s']:.0f} s.")
    for name, estimate in timing.get("estimates", {}).items():
        add(
            f"- Estimated generation time of the `{name}` preset at this rate: {estimate['completions']} completions, "
            f"≈ {estimate['hours']:.1f} h."
        )
    add("")
    return "\n".join(lines) + "\n"


def _ablation(q: list[Row], cfg: dict[str, Any]) -> list[str]:
    b, d0, temp0 = cfg["ablation_bits"], cfg["main_delta"], cfg["main_temperature"]
    keys = list(cfg["keys_grid"])
    ts = [t for t in cfg["t_grid"] if t in (150, 250)] or list(cfg["t_grid"])[:2]
    methods = ["LoSo"] + [f"XMark (k={k})" for k in keys if k > 1] + [f"XMark- (k={k})" for k in keys if k > 1]
    out = [f"## Ablation — number of keys k and cTMM vs TMM (b={b}, δ={d0:g}, temperature {temp0:g})", ""]
    out += t_table(q, methods, ts, bits=b, delta=d0, temperature=temp0)
    if b == 32 and d0 == 2.0:
        out += paper_rows(PAPER_ABLATION, ts)
        out += ["", "Rows in italics are the paper's (LLaMA-2-7B, text completion, b = 32), for reference only."]
    out.append("")
    out.append("XMark⁻ decodes the XMark generations with the TMM, so its PPL is XMark's (left empty as in the paper).")
    out.append("")
    return out


def _delta(q: list[Row], cfg: dict[str, Any]) -> list[str]:
    deltas = list(cfg["delta_grid"])
    if len(deltas) < 2:
        return []
    b0, temp0 = cfg["main_bits"], cfg["main_temperature"]
    ts = (cfg["t_grid"][0], cfg["t_grid"][-1])
    out = [f"## Bias δ (b={b0}, temperature {temp0:g})", ""]
    header = ["Method", "δ"] + [f"T={t} BA↑" for t in ts] + [f"T={t} PPL↓" for t in ts]
    body = []
    for method in ("MPAC", "LoSo", "XMark- (k=2)", "XMark (k=2)"):
        for d in deltas:
            rows = [_find(q, method=method, bits=b0, delta=d, temperature=temp0, T=t) for t in ts]
            body.append(
                [method, f"{d:g}"]
                + [_pct(r.get("ba") if r else None) for r in rows]
                + [("—" if method.startswith("XMark-") else _num(r.get("ppl") if r else None)) for r in rows]
            )
    out += _table(header, body)
    out.append("")
    return out


def _attribution(rows: list[Row], cfg: dict[str, Any]) -> list[str]:
    if not rows:
        return []
    out = [
        f"## Attribution among {rows[0]['registry_size']:,} registered users (α = {cfg['alpha']:g})",
        "",
        "Right user ranked first / named (`attribute` names the best candidate only when p < α and its "
        "posterior confidence is at least 0.99, the library defaults) / a wrong user named; the same from the "
        "re-tokenized text; false attribution = share of unwatermarked user texts (under the run's key and "
        f"{cfg['null_keys']} independent keys) for which any user is named.",
        "",
    ]
    header = [
        "b",
        "Method",
        "T",
        "Top-1 %",
        "Named %",
        "Wrong named %",
        "Top-1 retok %",
        "Named retok %",
        "False attribution %",
    ]
    body = []
    for r in rows:
        body.append(
            [
                str(r["bits"]),
                r["method"],
                str(r["T"]),
                _pct(r["top1"], 1),
                _pct(r["named"], 1),
                _pct(r["named_wrong"], 1),
                _pct(r["top1_retok"], 1),
                _pct(r["named_retok"], 1),
                f"{_pct(r['false_attribution'], 2)} (n={r['n_null']})",
            ]
        )
    out += _table(header, body)
    out.append("")
    return out


def _detection(rows: list[Row], cfg: dict[str, Any]) -> list[str]:
    if not rows:
        return []
    a = cfg["alphas"]
    out = [
        "## Is it watermarked? False-positive test",
        "",
        "Positives: each user's T tokens under the run's key. Negatives: unwatermarked users' texts under the "
        f"run's key and {cfg['null_keys']} independent keys (keys that never touched the text). Score = −log10 p of "
        "`xmark_core.detect` (calibrated to the observed token count and block profile). The paper's rule "
        f"(mean row standard deviation σ > {cfg['sigma_threshold']:.2f}) is evaluated on the same texts.",
        "",
    ]
    header = ["b", "Method", "T", "AUC", "TPR@1%FPR", "TPR@0.1%FPR"]
    for alpha in a:
        header += [f"FPR @α={alpha:g}", f"TPR @α={alpha:g}"]
    header += ["σ>3.30 FPR", "σ>3.30 TPR", "AUC(σ)", "negatives"]
    body = []
    for r in rows:
        cells = [
            str(r["bits"]),
            r["method"],
            str(r["T"]),
            _num(r["auc"], 4),
            _pct(r["tpr_at_1pct"], 1),
            _pct(r["tpr_at_01pct"], 1),
        ]
        for alpha in a:
            cells += [_pct(r[f"fpr_at_alpha_{alpha:g}"], 2), _pct(r[f"tpr_at_alpha_{alpha:g}"], 1)]
        cells += [
            _pct(r["sigma_rule_fpr"], 1),
            _pct(r["sigma_rule_tpr"], 1),
            _num(r["auc_sigma"], 4),
            str(r["n_negatives"]),
        ]
        body.append(cells)
    out += _table(header, body)
    out.append("")
    return out


def _robustness(rows: list[Row], cfg: dict[str, Any]) -> list[str]:
    if not rows:
        return []
    out = [
        "## Robustness",
        "",
        "Copy-paste: one contiguous span of a fraction Δ of each completion replaced by the same span of the "
        "model's unwatermarked completion of the same prompt (token level). Word deletion: that share of "
        "whitespace-separated words deleted, then re-tokenized. Token substitution: that share of tokens "
        f"replaced by uniformly random vocabulary tokens. BA % / detected % (p < α = {cfg['alpha']:g}).",
        "",
    ]
    methods = sorted({r["method"] for r in rows}, key=lambda m: (not m.startswith("MPAC"), not m.startswith("LoSo"), m))
    ts = sorted({r["T"] for r in rows})
    columns = sorted(
        {(r["attack"], r["level"]) for r in rows},
        key=lambda c: (("copy_paste", "word_deletion", "token_substitution").index(c[0]), c[1]),
    )
    names = {"copy_paste": "CP Δ=", "word_deletion": "del ", "token_substitution": "sub "}
    header = ["Method", "T"] + [f"{names[a]}{lvl:g}" for a, lvl in columns]
    body = []
    for method in methods:
        for t in ts:
            cells = []
            for attack, level in columns:
                r = _find(rows, method=method, T=t, attack=attack, level=level)
                cells.append(f"{_pct(r['ba'] if r else None, 1)} / {_pct(r['detected'] if r else None, 0)}")
            body.append([method, str(t), *cells])
    out += _table(header, body)
    out.append("")
    return out


def _rate_cell(rate: Row) -> str:
    """'count/of = pct % (lo–hi)' of a rate with its Wilson interval."""
    lo, hi = rate["ci95"]
    return f"{rate['count']}/{rate['of']} = {100 * rate['rate']:.1f} % ({100 * lo:.1f}–{100 * hi:.1f})"


def _key_label(row: Row) -> str:
    delta = row.get("delta") or 2.0  # the gateway's δ (rows written before δ was recorded)
    strength = "" if delta == 2.0 else f" δ={delta:g}"
    rule = f" h={row['min_entropy']:g}" if row.get("min_entropy") else ""  # the entropy rule, where on
    if row.get("scheme") == "gumbel":  # distortion-free: no bias, one key
        blocks = f" d={row['block_bits']}" if row.get("block_bits", 2) != 2 else ""
        salts = f" S={row['salts']}" if (row.get("salts") or 1) != 1 else ""
        return f"gumbel b={row['bits']}{blocks}{salts}"
    return f"b={row['bits']} k={row['num_keys']}{strength}{rule}"


def _setting_label(row: Row) -> str:
    return f"{_key_label(row)} τ={row['temperature']:g}"


def render_forensic(results: dict[str, Any]) -> str:
    """FORENSIC.md: naming rates per setting, T and decoder; false attribution; robustness; cost."""
    cfg = results["config"]
    out = [
        "# Forensic evaluation: naming the author of a short text",
        "",
        f"`{results['command']}` on {results['machine']}. Model SmolLM2-135M-Instruct; "
        f"{cfg['registry_size']:,} message IDs per message length from the gateway's allocator; one answer of "
        f"{cfg['max_tokens']} tokens per author; δ = 2 and d = 2 unless a setting says otherwise; "
        f"α = {cfg['alpha']:g}; the likelihood decoder assumes "
        f"temperature {cfg['trace_temperature']:g} and an edit rate of {cfg.get('trace_edit_rate', 0.0):g}, and "
        f"reads the top-{cfg['top_k']} log-probabilities of a {results.get('scorer_dtype', 'float32')} forward "
        "pass"
        + (
            f"; it names only when its identity test against every other registered ID is at most "
            f"{cfg['trace_identity_level']:g}"
            if cfg.get("trace_identity_level")
            else ""
        )
        + ". Texts are "
        "read as `/trace` reads them (decoded, re-tokenized, no prompt) by the gateway's own analysis. "
        "Protocol: `benchmarks/evaluation/forensic.py`. Rates: count / trials = rate (Wilson 95 % interval).",
        "",
        "*Named*: the right user named. *Wrong*: another user named. `auto` is `/trace`'s default "
        "(counting, then the likelihood decoder when counting names nobody, each at α / 2)."
        + (
            " `gumbel` settings use the distortion-free scheme (`xmark_core.gumbel`: no bias, keyed sampling), "
            "read by its own decoders (counting: exact Gamma p-values; likelihood: `xmark_core.gumbel_likelihood`, "
            "each token's keyed uniform weighed by the model's probability of the token, exact grid-rounded null "
            "laws), each naming only when its identity test against every other registered ID is at most α)."
            if any(row.get("scheme") == "gumbel" for row in results["attribution"])
            else ""
        ),
        "",
        "## Attribution",
        "",
    ]
    rows = results["attribution"]
    body = []
    for row in rows:
        body.append(
            [
                _setting_label(row),
                str(row["T"]),
                row["decoder"],
                _rate_cell(row["named"]),
                _rate_cell(row["wrong"]),
                _rate_cell(row["top1"]),
                _num(row["median_confidence"], 4),
            ]
        )
    out += _table(["setting", "T", "decoder", "named", "wrong", "ranked first", "median posterior"], body)
    out += ["", "## False attribution on unwatermarked text", ""]
    out += [
        "Unwatermarked answers (same prompts, same temperature) traced under the evaluation key and under "
        "independent keys; each (text, key) pair is one trace with one key version. A name here is a false "
        "attribution.",
        "",
    ]
    body = [
        [
            _key_label(row),
            f"{row['texts_temperature']:g}",
            str(row["T"]),
            row["decoder"],
            _rate_cell(row["named"]),
        ]
        for row in results["null"]
    ]
    out += _table(["key parameters", "text temperature", "T", "decoder", "named (false)"], body)
    if results.get("scaling"):
        out += ["", "## Registry size", ""]
        out += [
            "The same texts traced (`auto`) against larger registries: the allocator's IDs, then distinct "
            "random IDs (at b = 16, 65,536 is every ID). *False* is the unwatermarked texts named at T = 150 "
            "against the same registry.",
            "",
        ]
        body = [
            [
                _setting_label(row),
                f"{row['registry']:,}",
                str(row["T"]),
                _rate_cell(row["named"]),
                _rate_cell(row["wrong"]),
                _rate_cell(row["null_named"]) if "null_named" in row else "",
            ]
            for row in results["scaling"]
        ]
        out += _table(["setting", "registry", "T", "named", "wrong", "false (unwatermarked)"], body)
    out += ["", f"## Robustness (T = {max(cfg['t_grid'])})", ""]
    body = [
        [
            _setting_label(row),
            f"{row['attack'].replace('_', ' ')} {100 * row['level']:.0f} %",
            row["decoder"],
            _rate_cell(row["named"]),
            _rate_cell(row["wrong"]),
        ]
        for row in results["robustness"]
    ]
    out += _table(["setting", "edit", "decoder", "named", "wrong"], body)
    out += ["", "## Text quality", "", "Perplexity of the answers under the same model (raw log-probs):", ""]
    body = [
        [
            "unwatermarked" if row["bits"] is None else _key_label(row),
            f"{row['temperature']:g}",
            str(row["texts"]),
            _num(row["ppl_mean"]),
            _num(row["ppl_median"]),
        ]
        for row in results["quality"]
    ]
    out += _table(["setting", "temperature", "texts", "PPL mean", "PPL median"], body)
    cost = results.get("trace_cost")
    timing = results["timing"]
    out += ["", "## Cost", ""]
    if cost:
        out.append(
            f"A likelihood trace of a {cost['T']}-token text, one at a time ({cost['texts']} texts, "
            f"{cost['threads']} torch threads): forward pass {cost['forward_s_p50']:.3f} s, analysis "
            f"{cost['analysis_s_p50']:.3f} s, {cost['trace_s_p50']:.3f} s in all (medians)."
        )
    out.append(
        f"Generation {timing['generation_s']} s (this invocation; None = cached), scoring "
        f"{timing['scoring_s']} s for {timing['scored_tokens']:,} tokens, analysis {timing['analysis_s']} s."
    )
    return "\n".join(out) + "\n"


# ---- the temperature sweep (TEMPERATURE.md) -------------------------------------------------


def _options_label(options: Row) -> str:
    """A cell's sampling options as a reader names them ("–" for none)."""
    parts = []
    for name, value in sorted(options.items()):
        if name == "logit_bias":
            parts.append(f"logit_bias ({len(value)} tokens)")
        else:
            parts.append(f"{name} {value:g}")
    return ", ".join(parts) or "–"


def _encoder_label(cell: Row) -> str:
    return f"{cell['encoder']} ({'companion' if cell['companion'] else 'primary'})"


def _rule_label(cell: Row) -> str:
    reason = cell["rule"]["reason"]
    return f"{cell['rule']['encoder']} ({reason})" if reason else cell["rule"]["encoder"]


def _ratio_cell(ratio: Row | None) -> str:
    if ratio is None:
        return "–"
    lo, hi = ratio["ci95"]
    return f"{ratio['ratio']:.3f} ({lo:.3f}–{hi:.3f})"


def _params_label(params: Row) -> str:
    if params["scheme"] == "gumbel":
        return f"gumbel, b = {params['bits']}, d = {params['block_bits']}, {params['salts']} salts"
    blocks = f"b = {params['bits']}, d = {params['block_bits']}"
    return f"{params['scheme']}, {blocks}, k = {params['num_keys']}, δ = {params['delta']:g}"


def render_temperature(results: dict[str, Any]) -> str:
    """TEMPERATURE.md: every cell of the sweep in one table (naming, wrong names, false names of the
    unwatermarked answers, paired perplexity ratio), the rule's switch, the unwatermarked cells."""
    cfg, rule, cells = results["config"], results["rule"], results["cells"]
    t = cells[0]["T"] if cells else 150
    by_rule = [c for c in cells if c["by_rule"]]
    bias = next((c["options"]["logit_bias"] for c in cells if "logit_bias" in c["options"]), None)
    command = f"`{results['command']}`"
    if results["command"].endswith("--preset temperature"):
        command = f"`make eval-temperature` (`{results['command']} --max-num-seqs 128`)"
    title = "Temperature: where the per-request rule switches encoders, and why"
    version_label = 'The key version is the gateway\'s default (`xmark_core.encoders.spec_for("auto")`): the primary '
    bits = rule["companion"]["bits"]
    if cfg.get("report", "temperature").startswith("temperature-b"):  # a study of the message length
        title = f"The per-request rule's cells at message length {bits}"
        version_label = (
            f'The key version is the gateway\'s default at b = {bits} (`spec_for("auto", bits={bits})`): the primary '
        )
    elif cfg.get("report", "temperature") != "temperature":  # a study of the companion's bias
        title = (
            f"The biasing companion at δ = {rule['companion']['delta']:g}: the cells the per-request rule sends to it, "
            "where it named least at the default bias"
        )
        delta = rule["companion"]["delta"]
        version_label = (
            f"The key version is the gateway's default with the companion's bias set to {delta:g} "
            f'(`spec_for("auto", delta={delta:g})`): the primary '
        )
    out = [
        f"# {title}",
        "",
        f"{command} on {results['machine']}; answers "
        f"generated by the vLLM engine's CPU build. Model SmolLM2-135M-Instruct; {cfg['registry_size']:,} message IDs "
        f"from the gateway's allocator; one answer of {cfg['max_tokens']} tokens per author (EOS suppressed), read "
        f"at T = {t} tokens as `/trace` reads a pasted text (decoded, re-tokenized, no prompt) by the gateway's own "
        f"fan-out (`auto`: counting, then likelihood; α = {cfg['alpha']:g}). Protocol: "
        "`benchmarks/evaluation/forensic.py` (`temperature_config`). Rates: count / trials = rate (Wilson 95 % "
        "interval).",
        "",
        version_label
        + f"({_params_label(rule['primary'])}) and the biasing companion ({_params_label(rule['companion'])}), their "
        "keys derived from one evaluation secret as the gateway derives them (`encoder_keys`). Each cell's answers "
        "are written by one encoder; every text, watermarked or not, is traced under both (two readings of the "
        "fan-out, each one more test of its count), against one registry of IDs per message length read in each "
        "encoder's blocks.",
        "",
        "*Rule*: the encoder `service.services.encoder_choice.companion_reason` chooses for the cell's request, "
        f"at the default thresholds (`XMARK_WATERMARK_SAMPLING_MIN_TEMPERATURE` = {rule['min_temperature']:g}, "
        f"`XMARK_WATERMARK_SAMPLING_MIN_TOP_P` = {rule['min_top_p']:g}; requests sample the full vocabulary, n = 1), "
        "with the field that sent it to the companion. *Cell* `rule`: the rule's encoder; `other`: the version's "
        "other encoder at the same temperature, measured to show what the rule's choice buys. The keyed sampler "
        "cannot run greedy (temperature 0) and is not measured there.",
        "",
        "*Unwatermarked*: answers to the same prompts at the cell's temperature and options (the cells of one "
        "temperature and options share them), each traced under the evaluation's key version and independent "
        "ones, each (text, version) pair one trace: a name is a false attribution. *PPL ratio*: "
        "exp(mean per-answer NLL, watermarked − unwatermarked) under the unmodified model over the authors whose "
        "prompts both cells answered (paired by prompt), with a 95 % bootstrap interval over them.",
    ]
    if bias is not None:
        entries = ", ".join(f"{token}: {value:+g}" for token, value in bias.items())
        out += [
            "",
            f"The `logit_bias` list (SmolLM2 token ids): {entries} (`LOGIT_BIAS` in forensic.py: -100 bans "
            '" the", " a", " and", " very"; +5 favours " indeed", " truly", " remarkable", which then fill a '
            "large share of every answer, watermarked or not: a request that leaves the model little choice).",
        ]
    out += ["", f"## Every cell (T = {t})", ""]
    body = [
        [
            f"{c['temperature']:g}",
            _options_label(c["options"]),
            _encoder_label(c),
            _rule_label(c),
            "rule" if c["by_rule"] else "other",
            str(c["authors"]),
            _rate_cell(c["named"]),
            str(c["wrong"]["count"]),
            "–" if c["null_named"] is None else f"{c['null_named']['count']} / {c['null_named']['of']:,}",
            _ratio_cell(c["ppl_ratio"]),
        ]
        for c in sorted(cells, key=lambda c: (bool(c["options"]), c["temperature"], not c["by_rule"]))
    ]
    out += _table(
        [
            "temperature",
            "options",
            "encoder",
            "rule",
            "cell",
            "authors",
            "named",
            "wrong",
            "unwatermarked named / traces",
            "PPL ratio (95 % CI)",
        ],
        body,
    )
    short = [c for c in by_rule if c["named"]["rate"] is not None and c["named"]["rate"] < 0.95]
    wrong = sum(c["wrong"]["count"] for c in cells)
    nulls = {c["null_setting"]: c["null_named"] for c in cells if c["null_named"] is not None}
    false = sum(n["count"] for n in nulls.values())
    traces = sum(n["of"] for n in nulls.values())
    worst = max(nulls.values(), key=lambda n: n["count"] / n["of"], default=None)
    over = [n for n in nulls.values() if n["count"] * 1000 > n["of"]]
    total = rate_cell(false, traces)

    def where(cell: Row) -> str:
        options = f" with {_options_label(cell['options'])}" if cell["options"] else ""
        return f"τ = {cell['temperature']:g}{options} ({_rate_cell(cell['named'])})"

    wrong_cells = [c for c in cells if c["wrong"]["count"]]
    out += [
        "",
        "Goals:",
        "",
        "- named ≥ 95 % in the rule's cells, at every temperature and with every option set: "
        + ("met in every cell." if not short else "missed at " + ", ".join(where(c) for c in short) + "."),
        f"- no wrong name: {'met' if not wrong else 'missed'}, {wrong} wrong names in "
        f"{sum(c['authors'] for c in cells):,} traces of watermarked answers"
        + (
            ""
            if not wrong_cells
            else " ("
            + ", ".join(f"{c['wrong']['count']} at τ = {c['temperature']:g}, {c['encoder']}" for c in wrong_cells)
            + ")"
        )
        + ".",
        "- unwatermarked answers named at most 1 in 1,000 traces per cell: "
        + ("met in every cell" if not over else f"missed in {len(over)} of {len(nulls)} cells")
        + (
            ""
            if worst is None
            else f" (the most in one cell: {worst['count']} of {worst['of']:,}); {_rate_cell(total)} in all, "
            f"against /trace's level α = {cfg['alpha']:g} per trace"
        )
        + ".",
    ]
    out += ["", "## Where the rule switches, and why", ""]
    both = sorted({c["temperature"] for c in cells if not c["by_rule"]})
    lines = []
    for temperature in both:
        pair = [c for c in cells if c["temperature"] == temperature and not c["options"]]
        parts = [
            f"{c['encoder']}{' (the rule)' if c['by_rule'] else ''} names {_rate_cell(c['named'])} at a PPL ratio "
            f"of {_ratio_cell(c['ppl_ratio'])}"
            for c in sorted(pair, key=lambda c: c["encoder"])
        ]
        lines.append(f"- τ = {temperature:g}: " + "; ".join(parts) + ".")
    floors = []
    for encoder in sorted({c["encoder"] for c in cells}):
        line = sorted(
            (c for c in cells if c["encoder"] == encoder and not c["options"]), key=lambda c: c["temperature"]
        )
        from_here = [c["temperature"] for i, c in enumerate(line) if all(d["named"]["rate"] >= 0.95 for d in line[i:])]
        measured = ", ".join(f"{c['temperature']:g}" for c in line)
        floors.append(
            f"{encoder} names ≥ 95 % from τ = {from_here[0]:g} up of τ = {measured}"
            if from_here
            else f"{encoder} names < 95 % at the highest temperature"
        )
    out += [
        f"The rule sends a request below temperature {rule['min_temperature']:g} to the biasing companion and "
        "keeps the distortion-free primary from it up. Both encoders at every temperature where both were "
        f"measured ({'; '.join(floors)}):",
        "",
        *lines,
    ]
    if results.get("frontier_plot"):
        out += [
            "",
            f"![naming against perplexity, per encoder and temperature]({results['frontier_plot']})",
            "",
            "Left: authors named against the PPL ratio, one line per encoder through its temperatures (filled: the "
            "rule's cells; hollow: the other encoder; triangles: the option cells at "
            f"{next((c['temperature'] for c in cells if c['options']), 0.7):g}). Right: both against the "
            "temperature, the rule's switch dashed.",
        ]
    out += ["", "## Unwatermarked cells", ""]
    null_rows = [r for r in results["null"] if r.get("texts_setting") and r["decoder"] == "auto"]
    quality = {q["setting"]: q for q in results["quality"]}
    body = [
        [
            r["texts_setting"],
            f"{r['texts_temperature']:g}",
            _options_label(r.get("options") or {}),
            str(r["T"]),
            str(quality[r["texts_setting"]]["texts"]),
            _rate_cell(r["named"]),
            ", ".join(f"{k} {v}" for k, v in sorted(r.get("named_by_encoder", {}).items())) or "–",
            _num(quality[r["texts_setting"]]["ppl_median"]),
        ]
        for r in null_rows
    ]
    out += _table(
        ["cell", "temperature", "options", "T", "texts", "named (false) / traces", "by encoder", "PPL median"], body
    )
    timing = results["timing"]
    out += [
        "",
        "## Cost",
        "",
        f"Generation {timing['generation_s']} s (this invocation; None = cached"
        + (
            f" or copied from the `{', '.join(cfg['reuse'])}` cache, whose answers of the same cells are the same"
            if cfg.get("reuse")
            else ""
        )
        + f"), scoring {timing['scoring_s']} s for {timing['scored_tokens']:,} tokens, analysis "
        f"{timing['analysis_s']} s.",
    ]
    return "\n".join(out) + "\n"
