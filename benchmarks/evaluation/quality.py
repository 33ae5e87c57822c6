"""What the watermark costs the answers: quality measured against unwatermarked answers to the same prompts.

    python -m benchmarks.evaluation.quality [--report-only] [--max-num-seqs 128]

Protocol (``QUALITY``):

* Prompts: the committed set (``prompts.jsonl``) and the quality set (``prompts-quality.jsonl``),
  220 prompts of five kinds. Every prompt is answered once per setting and temperature; the first
  ``repeat_prompts`` prompts are answered ``repeats`` times (for the self-similarity of answers to
  one prompt). Answers end where the model ends them (its end-of-turn token) or at ``max_tokens``;
  the other special tokens are suppressed, as the gateway serves.
* Same prompts, same seeds: answer j of prompt p is sampled with the same seed under every setting
  (the watermark is the only difference), so the unwatermarked answers are a paired baseline.
  Each watermarked answer carries a random registered message under the evaluation key.
* Measures, per setting and temperature: perplexity under the serving model (the raw log-probs of
  the answer's tokens, the end-of-turn token left out), as the ratio of geometric means against the
  paired unwatermarked answers; distinct-1/2/3 (distinct n-grams over all n-grams of one answer,
  averaged over answers); self-similarity (mean pairwise Jaccard similarity of the token 4-gram sets
  of the ``repeats`` answers to one prompt); the share of answers that end in a loop (their last
  ``LOOP_WINDOW`` tokens repeat with a period of at most ``LOOP_PERIOD``); the answer length; the
  shares that end early (end-of-turn) and that hit the cap. Means carry a 95 % bootstrap interval
  over prompts (2,000 resamples, seeded), rates a Wilson interval.
* No second scorer: the only other language model here is the random-weight test model, which
  scores nothing meaningful, so perplexity is the serving model's own; the diversity and loop
  measures do not use a model.

Writes ``docs/results/QUALITY.md`` and ``docs/results/quality.json``; answers are cached under
``var/eval/quality-seed<seed>`` so ``--report-only`` re-analyses without the model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from xmark_core import MessageAllocator
from xmark_core.params import DEFAULT_SCHEME, default_block_bits, default_salts

from .config import GenSpec
from .generation import RowJob
from .metrics import rate_cell
from .population import evaluation_key
from .prompts import PROMPTS_PATH, Prompt, load_prompts
from .store import Completion, GenerationStore

QUALITY_PROMPTS_PATH = PROMPTS_PATH.with_name("prompts-quality.jsonl")
LOOP_WINDOW = 48  # an answer ends in a loop when its last 48 tokens repeat ...
LOOP_PERIOD = 16  # ... with a period of at most 16 tokens
BOOTSTRAP = 2000


@dataclass(frozen=True)
class QualityConfig:
    specs: tuple[GenSpec, ...]
    temperatures: tuple[float, ...] = (0.7, 1.0)
    max_tokens: int = 200
    repeats: int = 4
    repeat_prompts: int = 20
    prompts: int | None = None  # None: every prompt
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["specs"] = [asdict(s) for s in self.specs]
        return out


# The settings compared (temperature is set per run): unwatermarked, the gateway's default, and the
# entropy rule (h = 0.69) at δ = 2.5 (the forensic preset `entropy` also measures it at δ = 2).
QUALITY = QualityConfig(
    specs=(
        GenSpec("none"),
        GenSpec("xmark", 32, 4, 2.0),
        GenSpec("xmark", 32, 4, 2.5, min_entropy=0.69),
    )
)
SMALL = QualityConfig(
    specs=(GenSpec("none"), GenSpec("xmark", 32, 4, 2.0)),
    temperatures=(0.7,),
    max_tokens=48,
    repeats=2,
    repeat_prompts=3,
    prompts=6,
)
# The distortion-free scheme (xmark_core.gumbel) against the same unwatermarked answers (same prompts,
# same seeds as QUALITY: its unwatermarked rows are QUALITY's). Each prompt's answers carry one user's
# message, so the repeats are that user asking the same prompt again.
GUMBEL = QualityConfig(specs=(GenSpec("none"), GenSpec("gumbel", 32, 1, 2.0)))
# The scheme in blocks of 8 bits with 16 salts (WatermarkParams.salts): a user's consecutive answers
# under consecutive salts from a random first one (as the gateway's rotation, service.salts), so the
# repeats of one prompt are sampled independently; the same prompts and seeds as QUALITY.
GUMBEL8_SALTED = QualityConfig(specs=(GenSpec("none"), GenSpec("gumbel", 32, 1, 2.0, block_bits=8, salts=16)))
PRESETS = {"quality": QUALITY, "gumbel": GUMBEL, "gumbel8s16": GUMBEL8_SALTED, "small": SMALL}


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def quality_prompts() -> list[Prompt]:
    return load_prompts() + load_prompts(QUALITY_PROMPTS_PATH)


def with_temperature(spec: GenSpec, temperature: float) -> GenSpec:
    return replace(spec, temperature=temperature)


def answer_seed(run_seed: int, prompt_index: int, answer: int, temperature: float) -> int:
    """The sampling seed of answer ``answer`` to prompt ``prompt_index``: the same under every setting."""
    ident = repr(("quality", run_seed, prompt_index, answer, temperature)).encode()
    return int.from_bytes(hashlib.sha256(ident).digest()[:4], "little")


def jobs(config: QualityConfig, prompts: Sequence[Prompt]) -> list[RowJob]:
    """user = prompt index, slot = answer number; watermarked rows carry a random registered message."""
    out = []
    for temperature in config.temperatures:
        for base in config.specs:
            spec = with_temperature(base, temperature)
            key = message_of = None
            if spec.watermarked:
                params = spec.params()
                key = evaluation_key(params, config.seed)
                allocator = MessageAllocator([], params, rng=random.Random(f"quality/{config.seed}/{params.bits}"))
                message_of = [allocator.allocate() for _ in prompts]
            for index, prompt in enumerate(prompts):
                answers = config.repeats if index < config.repeat_prompts else 1
                # a salted key: the user's answers take consecutive salts from a random first one
                first = random.Random(f"quality-salt/{config.seed}/{spec.name}/{index}").randrange(spec.salts)
                for answer in range(answers):
                    message = message_of[index] if message_of is not None else None
                    salt = (first + answer) % spec.salts
                    out.append(
                        RowJob(spec.name, index, answer, prompt.id, prompt.text, temperature, key, message, salt)
                    )
    return out


# ---- measures -------------------------------------------------------------------------------


def content(row: Completion, eos: int) -> list[int]:
    """The answer's tokens without its end-of-turn token."""
    ids = list(row.token_ids)
    return ids[:-1] if ids and ids[-1] == eos else ids


def ended_early(row: Completion, eos: int) -> bool:
    return bool(row.token_ids) and row.token_ids[-1] == eos


def distinct(ids: Sequence[int], n: int) -> float | None:
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None


def ends_in_loop(ids: Sequence[int], window: int = LOOP_WINDOW, period: int = LOOP_PERIOD) -> bool:
    """Whether the last ``window`` tokens repeat with some period p <= ``period`` (x[i] = x[i + p] throughout)."""
    if len(ids) < window:
        return False
    tail = list(ids[-window:])
    return any(all(tail[i] == tail[i + p] for i in range(window - p)) for p in range(1, period + 1))


def jaccard4(a: Sequence[int], b: Sequence[int]) -> float | None:
    ga = {tuple(a[i : i + 4]) for i in range(len(a) - 3)}
    gb = {tuple(b[i : i + 4]) for i in range(len(b) - 3)}
    if not ga or not gb:
        return None
    return len(ga & gb) / len(ga | gb)


def bootstrap_mean(values: Sequence[float], seed: int = 0) -> dict[str, Any]:
    data = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)
    if data.size == 0:
        return {"mean": None, "ci95": None, "n": 0}
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, data.size, size=(BOOTSTRAP, data.size))].mean(axis=1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    return {
        "mean": round(float(data.mean()), 4),
        "ci95": [round(float(lo), 4), round(float(hi), 4)],
        "n": int(data.size),
    }


def paired_ppl_ratio(marked: Sequence[float], plain: Sequence[float], seed: int = 0) -> dict[str, Any]:
    """exp(mean per-answer NLL, watermarked - unwatermarked) over prompts, with a paired bootstrap interval."""
    diff = np.asarray(marked) - np.asarray(plain)
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, diff.size, size=(BOOTSTRAP, diff.size))].mean(axis=1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    return {
        "ratio": round(math.exp(float(diff.mean())), 4),
        "ci95": [round(math.exp(lo), 4), round(math.exp(hi), 4)],
        "n": int(diff.size),
    }


def measure(config: QualityConfig, prompts: Sequence[Prompt], store: GenerationStore, eos: int) -> list[dict[str, Any]]:
    rows = []
    for temperature in config.temperatures:
        baseline = with_temperature(config.specs[0], temperature)
        plain_nll = [statistics.fmean(content_nll(store.get(baseline.name, i, 0), eos)) for i in range(len(prompts))]
        default = with_temperature(config.specs[1], temperature) if len(config.specs) > 1 else None
        default_nll = (
            [statistics.fmean(content_nll(store.get(default.name, i, 0), eos)) for i in range(len(prompts))]
            if default is not None
            else None
        )
        for base in config.specs:
            spec = with_temperature(base, temperature)
            first = [store.get(spec.name, i, 0) for i in range(len(prompts))]
            assert all(r is not None for r in first), f"{spec.name}: answers missing"
            answers: list[Completion] = [r for r in first if r is not None]
            nll = [statistics.fmean(content_nll(r, eos)) for r in answers]
            ids = [content(r, eos) for r in answers]
            similarity = []
            for i in range(min(config.repeat_prompts, len(prompts))):
                group = [
                    content(r, eos) for j in range(config.repeats) if (r := store.get(spec.name, i, j)) is not None
                ]
                pairs = [jaccard4(a, b) for k, a in enumerate(group) for b in group[k + 1 :]]
                values = [p for p in pairs if p is not None]
                if values:
                    similarity.append(statistics.fmean(values))
            rows.append(
                {
                    "setting": spec.name,
                    "watermarked": spec.watermarked,
                    "bits": spec.bits if spec.watermarked else None,
                    "num_keys": spec.num_keys if spec.watermarked else None,
                    "delta": spec.delta if spec.watermarked else None,
                    "min_entropy": spec.min_entropy if spec.watermarked else None,
                    "scheme": spec.scheme if spec.watermarked else None,
                    "block_bits": spec.block_bits if spec.watermarked else None,
                    "salts": spec.salts if spec.watermarked else None,
                    "temperature": temperature,
                    "answers": len(answers),
                    "ppl_median": round(statistics.median(math.exp(v) for v in nll), 3),
                    "ppl_geomean": round(math.exp(statistics.fmean(nll)), 3),
                    "ppl_ratio": paired_ppl_ratio(nll, plain_nll),
                    # against the second setting (the gateway's default), where this is another watermark
                    "ppl_ratio_to_default": (
                        paired_ppl_ratio(nll, default_nll)
                        if default_nll is not None and spec.watermarked and default is not None and spec != default
                        else None
                    ),
                    **{f"distinct_{n}": bootstrap_mean([distinct(x, n) for x in ids]) for n in (1, 2, 3)},
                    "self_similarity": bootstrap_mean(similarity),
                    "loops": rate_cell(sum(ends_in_loop(x) for x in ids), len(ids)),
                    "length": bootstrap_mean([float(len(x)) for x in ids]),
                    "ended_early": rate_cell(sum(ended_early(r, eos) for r in answers), len(answers)),
                    "hit_cap": rate_cell(
                        sum(len(r.token_ids) >= config.max_tokens and not ended_early(r, eos) for r in answers),
                        len(answers),
                    ),
                }
            )
    return rows


def content_nll(row: Completion | None, eos: int) -> list[float]:
    assert row is not None
    nll = list(row.nll)
    if row.token_ids and row.token_ids[-1] == eos:
        nll = nll[:-1]
    return nll or [0.0]


# ---- report ---------------------------------------------------------------------------------


def _interval(cell: dict[str, Any], scale: float = 1.0, digits: int = 3) -> str:
    if cell.get("mean") is None:
        return "–"
    lo, hi = cell["ci95"]
    return f"{cell['mean'] * scale:.{digits}f} ({lo * scale:.{digits}f}–{hi * scale:.{digits}f})"


def _pct(cell: dict[str, Any]) -> str:
    lo, hi = cell["ci95"]
    return f"{100 * cell['rate']:.1f} % ({100 * lo:.1f}–{100 * hi:.1f})"


def _label(row: dict[str, Any]) -> str:
    if not row["watermarked"]:
        return "unwatermarked"
    if row.get("scheme") == "gumbel":
        blocks = f" d={row['block_bits']}" if (row.get("block_bits") or 2) != 2 else ""
        salts = f" S={row['salts']}" if (row.get("salts") or 1) != 1 else ""
        return f"gumbel b={row['bits']}{blocks}{salts} (distortion-free)"
    rule = f" h={row['min_entropy']:g}" if row["min_entropy"] else ""
    return f"b={row['bits']} k={row['num_keys']} δ={row['delta']:g}{rule}"


def render(results: dict[str, Any]) -> str:
    cfg = results["config"]
    out = [
        "# Answer quality: what the watermark costs",
        "",
        f"`{results['command']}` on {results['machine']}. Model SmolLM2-135M-Instruct on the vLLM CPU engine; "
        f"{results['prompts']} prompts (`prompts.jsonl` and `prompts-quality.jsonl`), one answer each per setting "
        f"and temperature, and {cfg['repeats']} answers to each of the first {cfg['repeat_prompts']} prompts; answers "
        f"end at the model's end-of-turn token or at {cfg['max_tokens']} tokens. Answer j to prompt p has the same "
        "sampling seed under every setting. Perplexity is the serving model's (no other language model is "
        "available here: the only other one is the random-weight test model); its ratio is the paired ratio of "
        "geometric means against the unwatermarked answers to the same prompts "
        "(another watermark also against the default). Intervals: 95 % (bootstrap over "
        "prompts for means, Wilson for rates). h: the entropy rule's threshold in nats (positions whose "
        "min-entropy is below it are not biased).",
        "",
        "| setting | τ | answers | PPL median | PPL ratio (95 % CI) | against the default | distinct-2 "
        "| self-similarity (4-gram Jaccard) | ends in a loop | length (tokens) | ended early | hit the cap |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        ratio, against = row["ppl_ratio"], row.get("ppl_ratio_to_default")
        to_default = (
            "–" if against is None else f"{against['ratio']:.3f} ({against['ci95'][0]:.3f}–{against['ci95'][1]:.3f})"
        )
        out.append(
            f"| {_label(row)} | {row['temperature']:g} | {row['answers']} | {row['ppl_median']:.2f} "
            f"| {ratio['ratio']:.3f} ({ratio['ci95'][0]:.3f}–{ratio['ci95'][1]:.3f}) | {to_default} "
            f"| {_interval(row['distinct_2'])} | {_interval(row['self_similarity'])} | {_pct(row['loops'])} "
            f"| {_interval(row['length'], digits=1)} | {_pct(row['ended_early'])} | {_pct(row['hit_cap'])} |"
        )
    out += [
        "",
        "distinct-1 / distinct-3 (means over answers, 95 % CI):",
        "",
        "| setting | τ | distinct-1 | distinct-3 |",
        "|---|---|---|---|",
    ]
    for row in results["rows"]:
        cells = (_label(row), f"{row['temperature']:g}", _interval(row["distinct_1"]), _interval(row["distinct_3"]))
        out.append("| " + " | ".join(cells) + " |")
    if results.get("frontier"):
        out += render_frontier(results["frontier"])
    timing = results.get("timing") or {}
    if timing.get("generation_s") is not None:
        out += ["", f"Generation: {timing['generation_s']:.0f} s for {timing['answers']} answers."]
    return "\n".join(out) + "\n"


# ---- the frontier: naming against quality ---------------------------------------------------

FORENSIC_FILES = (
    "forensic.json",
    "forensic-strength.json",
    "forensic-entropy.json",
    "forensic-gumbel.json",
    "forensic-gumbel8.json",
    "forensic-gumbel8s16.json",
)
# the quality runs whose paired perplexity ratios the frontier uses (besides the run being written)
QUALITY_FILES = ("quality.json", "quality-gumbel.json", "quality-gumbel8s16.json")


def _setting_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (
        row.get("scheme") or "xmark",
        row.get("bits"),
        int(row.get("block_bits") or 2),
        row.get("num_keys"),
        float(row.get("delta") or 2.0),
        float(row.get("min_entropy") or 0.0),
        int(row.get("salts") or 1),
        float(row["temperature"]),
    )


def _unruled(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """A setting's key without the entropy rule (the null rows' parameters do not record it)."""
    return key[:5] + key[6:]


def frontier(rows: list[dict[str, Any]], results_dir: Path, t: int = 150) -> list[dict[str, Any]]:
    """One row per watermarked setting the forensic evaluations named authors with: naming at
    ``t`` tokens among their registry (``auto``, as /trace), wrong names, and the perplexity ratio:
    this run's paired ratio where the setting was in it, else the forensic run's (ratio of mean
    perplexities of its answers against its unwatermarked answers at the same temperature)."""
    measured: dict[tuple[Any, ...], dict[str, Any]] = {}
    for name in QUALITY_FILES:
        path = results_dir / name
        if path.is_file():
            measured.update({_setting_key(r): r for r in json.loads(path.read_text(encoding="utf-8"))["rows"]})
    measured.update({_setting_key(r): r for r in rows})
    measured = {k: r for k, r in measured.items() if r["watermarked"]}
    out = []
    for name in FORENSIC_FILES:
        path = results_dir / name
        if not path.is_file():
            continue
        forensic = json.loads(path.read_text(encoding="utf-8"))
        plain = {float(q["temperature"]): q["ppl_mean"] for q in forensic["quality"] if not q.get("bits")}
        cost = {_setting_key(q): q["ppl_mean"] for q in forensic["quality"] if q.get("bits")}
        # /trace's default: auto (results of the distortion-free scheme from before its likelihood
        # decoder hold counting only: their counting rows stand for it)
        read_auto = {_setting_key(r) for r in forensic["attribution"] if r["decoder"] == "auto"}
        # unwatermarked texts named under the setting's parameters at T (the null section; its rows
        # do not record the entropy rule, which never changes what a null text carries)
        false = {
            (_unruled(_setting_key({**r, "temperature": r["texts_temperature"]})), r["decoder"]): r
            for r in forensic.get("null", [])
            if r["T"] == t
        }
        for row in forensic["attribution"]:
            default = "auto" if _setting_key(row) in read_auto else "counting"
            if row["T"] != t or row["decoder"] != default or row["bits"] != 32:
                continue
            key = _setting_key(row)
            here = measured.get(key)
            if here is not None:
                ratio, source = here["ppl_ratio"]["ratio"], "quality"
            elif key in cost and key[-1] in plain:
                ratio, source = round(cost[key] / plain[key[-1]], 4), name
            else:
                continue
            out.append(
                {
                    "scheme": key[0],
                    "bits": key[1],
                    "block_bits": key[2],
                    "num_keys": key[3],
                    "delta": key[4],
                    "min_entropy": key[5],
                    "salts": key[6],
                    "temperature": key[7],
                    "T": t,
                    "named": row["named"],
                    "wrong": row["wrong"],
                    "false": (false.get((_unruled(key), default)) or {}).get("named"),
                    "ppl_ratio": ratio,
                    "ppl_source": source,
                    "naming_source": name,
                }
            )
    return sorted(out, key=lambda r: (r["temperature"], r["ppl_ratio"]))


def plot_frontier(points: list[dict[str, Any]], path: Path) -> bool:
    """PNG: naming at T against the perplexity ratio, one marker per setting, per temperature."""
    if not points:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for temperature, colour in ((0.7, "tab:blue"), (1.0, "tab:red")):
        rows = [p for p in points if p["temperature"] == temperature]
        for p in rows:
            lo, hi = p["named"]["ci95"]
            rate = p["named"]["rate"]
            ax.errorbar(
                p["ppl_ratio"], 100 * rate, yerr=[[100 * (rate - lo)], [100 * (hi - rate)]], fmt="o", color=colour
            )
            ax.annotate(
                _frontier_label(p),
                (p["ppl_ratio"], 100 * rate),
                fontsize=7,
                xytext=(4, -10),
                textcoords="offset points",
            )
        if rows:
            ax.plot([], [], "o", color=colour, label=f"τ = {temperature:g}")
    ax.axvline(1.15, color="gray", linestyle=":", linewidth=1)
    ax.set_xlabel("perplexity, watermarked / unwatermarked")
    ax.set_ylabel(f"authors named at T = {points[0]['T']} (%)")
    ax.set_title("Naming against quality (10,000 registered users)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _frontier_label(p: dict[str, Any]) -> str:
    if p.get("scheme") == "gumbel":
        blocks = f" d={p['block_bits']}" if p.get("block_bits", 2) != 2 else ""
        salts = f" S={p['salts']}" if (p.get("salts") or 1) != 1 else ""
        return f"gumbel{blocks}{salts} (distortion-free)"
    rule = f" h={p['min_entropy']:g}" if p["min_entropy"] else ""
    return f"k={p['num_keys']} δ={p['delta']:g}{rule}"


def render_frontier(points: list[dict[str, Any]]) -> list[str]:
    out = [
        "",
        "## Naming against quality",
        "",
        f"Authors named at T = {points[0]['T'] if points else 150} tokens among 10,000 registered users (`auto`, the "
        "forensic protocol: one answer per author, EOS suppressed; the distortion-free scheme by its counting and "
        "model-aware decoders) against the perplexity ratio. The ratio is the paired one of a quality run (QUALITY.md, "
        "QUALITY-GUMBEL.md: same prompts, same seeds) where one measured the setting, else the forensic run's (its "
        "answers' mean perplexity over its unwatermarked answers' at the same temperature; 300-token answers in "
        "FORENSIC.md and FORENSIC-STRENGTH.md, 200-token answers in FORENSIC-ENTROPY.md and FORENSIC-GUMBEL.md). "
        "b = 32 throughout. Plot: [quality_frontier.png](quality_frontier.png).",
        "",
        "*False*: unwatermarked texts at T named under the setting's keys (the forensic run's null section; "
        "α = 0.001, so up to 1 in 1,000 is the level the test allows).",
        "",
        f"**The default of new key versions follows this table** (`xmark_core.params.DEFAULT_SCHEME` = "
        f"`{DEFAULT_SCHEME}`, {default_block_bits(DEFAULT_SCHEME)}-bit blocks, {default_salts(DEFAULT_SCHEME)} "
        "salts): the one setting that names ≥ 97 % / ≥ 99 % at τ = 0.7 / 1.0 with none wrong at a perplexity ratio "
        "≤ 1.15 and keeps one user's answers to one prompt as diverse as unwatermarked ones (without salts the "
        "scheme meets the first two but not the last: 4-gram self-similarity 0.50, QUALITY-GUMBEL.md). What it "
        "costs instead of perplexity: greedy requests, penalties and `logit_bias` are refused by "
        "name (no draw to carry the watermark, or applied after the keyed choice), and unwatermarked texts are "
        'named at the level α allows rather than below it (docs/service.md, "The distortion-free scheme").',
        "",
        "| setting | τ | named at T (95 % CI) | wrong | false (unwatermarked) | PPL ratio | ratio from | naming from |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        named, wrong, false = p["named"], p["wrong"], p.get("false")
        lo, hi = named["ci95"]
        shown = "–" if false is None else f"{false['count']}/{false['of']:,}"
        out.append(
            f"| {_frontier_label(p)} | {p['temperature']:g} | {named['count']}/{named['of']} = "
            f"{100 * named['rate']:.1f} % ({100 * lo:.1f}–{100 * hi:.1f}) | {wrong['count']} | {shown} "
            f"| {p['ppl_ratio']:.3f} | {p['ppl_source']} | {p['naming_source']} |"
        )
    return out


# ---- run ------------------------------------------------------------------------------------


def generate(config: QualityConfig, pending: list[RowJob], store: GenerationStore, args: argparse.Namespace) -> float:
    from .vllm_engine import VllmGenerator

    generator = VllmGenerator.for_jobs(args.model_path, pending, config.max_tokens, args.max_num_seqs)
    index = {p.id: i for i, p in enumerate(quality_prompts())}

    def seed_of(job: RowJob) -> int:
        return answer_seed(config.seed, index[job.prompt_id], job.slot, job.temperature)

    batch = args.max_num_seqs * 2
    started = time.monotonic()
    for first in range(0, len(pending), batch):
        rows = pending[first : first + batch]
        store.add(generator.generate(rows, config.max_tokens, config.seed, stop_at_eos=True, seed_of=seed_of))
        done = first + len(rows)
        left = (time.monotonic() - started) / done * (len(pending) - done)
        _log(f"{done}/{len(pending)} answers, ~{left / 60:.1f} min left")
    return time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.evaluation.quality", description=__doc__)
    parser.add_argument("--model-path", type=Path, default=Path("var/models/smollm2-135m-instruct"))
    parser.add_argument("--output-dir", type=Path, default=Path("docs/results"))
    parser.add_argument("--cache-dir", type=Path)
    parser.add_argument("--preset", choices=tuple(PRESETS), default="quality")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument(
        "--frontier-only",
        action="store_true",
        help="no answers: redraw the frontier (table and plot) of the written report from the forensic and "
        "quality results beside it",
    )
    args = parser.parse_args(argv)
    config = PRESETS[args.preset]
    suffix = "" if args.preset == "quality" else f"-{args.preset}"
    out = args.output_dir
    if args.frontier_only:
        written = json.loads((out / f"quality{suffix}.json").read_text(encoding="utf-8"))
        write_report(written, out, suffix)
        return 0
    cache_dir = args.cache_dir or Path("var/eval") / f"quality{suffix}-seed{config.seed}"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    prompts = quality_prompts()[: config.prompts]
    store = GenerationStore(cache_dir / "generations.jsonl")
    pending = [j for j in jobs(config, prompts) if (j.spec_name, j.user, j.slot) not in store]
    generation_s = None
    if pending and not args.report_only:
        _log(f"generating {len(pending)} answers of at most {config.max_tokens} tokens")
        generation_s = generate(config, pending, store, args)
    elif pending:
        raise SystemExit(f"--report-only: {len(pending)} answers are missing from {cache_dir}")
    tokenizer = AutoTokenizer.from_pretrained(args.model_path, local_files_only=True)
    eos = int(tokenizer.eos_token_id)
    results: dict[str, Any] = {
        "command": "python -m benchmarks.evaluation.quality"
        + ("" if args.preset == "quality" else f" --preset {args.preset}"),
        "config": config.to_dict(),
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, no GPU",
        "prompts": len(prompts),
        "rows": measure(config, prompts, store, eos),
        "timing": {"generation_s": None if generation_s is None else round(generation_s, 1), "answers": len(pending)},
    }
    out.mkdir(parents=True, exist_ok=True)
    write_report(results, out, suffix)
    return 0


def write_report(results: dict[str, Any], out: Path, suffix: str) -> None:
    """The frontier (from the forensic and quality results in ``out``), its plot, the JSON and the report."""
    results["frontier"] = frontier(results["rows"], out)
    plot_frontier(results["frontier"], out / "quality_frontier.png")  # one frontier, whichever run draws it
    (out / f"quality{suffix}.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    (out / f"QUALITY{suffix.upper()}.md").write_text(render(results), encoding="utf-8")
    _log(f"wrote {out / f'QUALITY{suffix.upper()}.md'}")


if __name__ == "__main__":
    raise SystemExit(main())
