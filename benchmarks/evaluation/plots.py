"""PNG plots (matplotlib, Agg): BA vs T per method, BA vs b, ROC curves, BA vs copy-paste fraction."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

METHODS = ("MPAC", "LoSo", "XMark- (k=2)", "XMark (k=2)")
STYLE = {"MPAC": "tab:blue", "LoSo": "tab:orange", "XMark- (k=2)": "tab:gray", "XMark (k=2)": "tab:red"}


def _rows(rows: list[dict[str, Any]], **match: Any) -> list[dict[str, Any]]:
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ba_vs_t(results: dict[str, Any], path: Path) -> bool:
    cfg, q = results["config"], results["quality"]
    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = False
    for method in METHODS:
        rows = sorted(
            _rows(
                q, method=method, bits=cfg["main_bits"], delta=cfg["main_delta"], temperature=cfg["main_temperature"]
            ),
            key=lambda r: r["T"],
        )
        rows = [r for r in rows if r.get("ba") is not None]
        if not rows:
            continue
        drawn = True
        ax.plot([r["T"] for r in rows], [100 * r["ba"] for r in rows], "o-", color=STYLE[method], label=method)
        ax.plot([r["T"] for r in rows], [100 * r["ba_retok"] for r in rows], "x--", color=STYLE[method], alpha=0.6)
    ax.set_xlabel("T (tokens per user)")
    ax.set_ylabel("bit accuracy (%)")
    ax.set_title(f"BA vs T (b={cfg['main_bits']}, δ={cfg['main_delta']:g}); dashed: re-tokenized text")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend()
    _save(fig, path)
    return drawn


def ba_vs_b(results: dict[str, Any], path: Path) -> bool:
    cfg, q = results["config"], results["quality"]
    t_grid = cfg["t_grid"]
    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = False
    for method in METHODS:
        for t, style in ((t_grid[0], "o--"), (t_grid[-1], "o-")):
            rows = sorted(
                _rows(q, method=method, delta=cfg["main_delta"], temperature=cfg["main_temperature"], T=t),
                key=lambda r: r["bits"],
            )
            rows = [r for r in rows if r["bits"] in cfg["bits_grid"] and r.get("ba") is not None]
            if not rows:
                continue
            drawn = True
            ax.plot(
                [r["bits"] for r in rows],
                [100 * r["ba"] for r in rows],
                style,
                color=STYLE[method],
                label=f"{method}, T={t}",
            )
    ax.set_xscale("log", base=2)
    ax.set_xticks(cfg["bits_grid"], [str(b) for b in cfg["bits_grid"]])
    ax.set_xlabel("message length b (bits)")
    ax.set_ylabel("bit accuracy (%)")
    ax.set_title(f"BA vs b (δ={cfg['main_delta']:g})")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=7)
    _save(fig, path)
    return drawn


def roc(results: dict[str, Any], path: Path) -> bool:
    curves = results.get("roc_curves", [])
    if not curves:
        return False
    panels = sorted({(c["bits"], c["T"]) for c in curves})
    ts = sorted({t for _, t in panels})
    bits = sorted({b for b, _ in panels})
    fig, axes = plt.subplots(len(bits), len(ts), figsize=(5 * len(ts), 3.6 * len(bits)), squeeze=False)
    for i, b in enumerate(bits):
        for j, t in enumerate(ts):
            ax = axes[i][j]
            for c in curves:
                if (c["bits"], c["T"]) != (b, t):
                    continue
                fpr = [max(x, 1e-4) for x in c["fpr"]]
                ax.step(fpr, c["tpr"], where="post", color=STYLE.get(c["method"], "black"), label=c["method"])
            ax.set_xscale("log")
            ax.set_xlim(1e-4, 1)
            ax.set_ylim(0, 1.02)
            ax.set_xlabel("false-positive rate")
            ax.set_ylabel("true-positive rate")
            ax.set_title(f"ROC, b={b}, T={t}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="lower right")
    _save(fig, path)
    return True


def ba_vs_copy_paste(results: dict[str, Any], path: Path) -> bool:
    rows = results.get("robustness", [])
    if not rows:
        return False
    t = max(r["T"] for r in rows)
    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = False
    for method in METHODS:
        attacked = sorted(_rows(rows, method=method, attack="copy_paste", T=t), key=lambda r: r["level"])
        clean = _rows(
            results["quality"],
            method=method,
            bits=results["config"]["main_bits"],
            delta=results["config"]["main_delta"],
            temperature=results["config"]["main_temperature"],
            T=t,
        )
        points = ([(0.0, clean[0]["ba"])] if clean and clean[0].get("ba") is not None else []) + [
            (r["level"], r["ba"]) for r in attacked if r.get("ba") is not None
        ]
        if len(points) < 2:
            continue
        drawn = True
        ax.plot([p[0] for p in points], [100 * p[1] for p in points], "o-", color=STYLE[method], label=method)
    ax.set_xlabel("copy-paste fraction Δ (replaced by unwatermarked text)")
    ax.set_ylabel("bit accuracy (%)")
    ax.set_title(f"BA vs copy-paste Δ (b={results['config']['main_bits']}, T={t})")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend()
    _save(fig, path)
    return drawn


def draw_all(results: dict[str, Any], out_dir: Path) -> dict[str, str]:
    """Write the plots that have data; return {file name: caption}."""
    made: dict[str, str] = {}
    for name, caption, draw in (
        ("ba_vs_T.png", "Bit accuracy against T per method", ba_vs_t),
        ("ba_vs_b.png", "Bit accuracy against message length b", ba_vs_b),
        ("roc.png", "ROC curves of the false-positive test", roc),
        ("ba_vs_copy_paste.png", "Bit accuracy against copy-paste fraction", ba_vs_copy_paste),
    ):
        if draw(results, out_dir / name):
            made[name] = caption
        else:
            (out_dir / name).unlink(missing_ok=True)
    return made


ENCODER_STYLE = {"gumbel": "tab:blue", "xmark": "tab:red"}


def temperature_frontier(results: dict[str, Any], path: Path) -> bool:
    """The temperature sweep (TEMPERATURE.md): left, authors named against the paired perplexity
    ratio, one line per encoder through its temperatures; right, both against the temperature with
    the rule's switch. Filled: the rule's cells; hollow: the other encoder; triangles: option cells."""
    cells = [c for c in results.get("cells", []) if c.get("ppl_ratio") and c["named"]["rate"] is not None]
    if not cells:
        return False
    switch = results["rule"]["min_temperature"]
    fig, (frontier, sweep) = plt.subplots(1, 2, figsize=(11, 4.4))
    ratio_axis = sweep.twinx()
    for encoder, colour in ENCODER_STYLE.items():
        line = sorted(
            (c for c in cells if c["encoder"] == encoder and not c["options"]), key=lambda c: c["temperature"]
        )
        if not line:
            continue
        frontier.plot(
            [c["ppl_ratio"]["ratio"] for c in line],
            [100 * c["named"]["rate"] for c in line],
            "-",
            color=colour,
            alpha=0.5,
        )
        temperatures = [c["temperature"] for c in line]
        sweep.plot(temperatures, [100 * c["named"]["rate"] for c in line], "-", color=colour, label=f"{encoder}: named")
        ratio_axis.plot(
            temperatures, [c["ppl_ratio"]["ratio"] for c in line], ":", color=colour, label=f"{encoder}: PPL ratio"
        )
        for c in line:
            rate, (lo, hi) = c["named"]["rate"], c["named"]["ci95"]
            face = colour if c["by_rule"] else "white"
            frontier.errorbar(
                c["ppl_ratio"]["ratio"],
                100 * rate,
                yerr=[[100 * (rate - lo)], [100 * (hi - rate)]],
                fmt="o",
                color=colour,
                markerfacecolor=face,
            )
            frontier.annotate(
                f"τ={c['temperature']:g}",
                (c["ppl_ratio"]["ratio"], 100 * rate),
                fontsize=7,
                xytext=(4, -10),
                textcoords="offset points",
            )
            sweep.plot(c["temperature"], 100 * rate, "o", color=colour, markerfacecolor=face)
    for c in (c for c in cells if c["options"]):
        colour = ENCODER_STYLE.get(c["encoder"], "tab:gray")
        label = ", ".join(name.split("_")[0] if name != "logit_bias" else "logit_bias" for name in c["options"])
        frontier.plot(c["ppl_ratio"]["ratio"], 100 * c["named"]["rate"], "^", color=colour)
        frontier.annotate(
            label,
            (c["ppl_ratio"]["ratio"], 100 * c["named"]["rate"]),
            fontsize=7,
            xytext=(4, 4),
            textcoords="offset points",
        )
    frontier.axhline(95, color="gray", linestyle=":", linewidth=1)
    frontier.set_xlabel("perplexity, watermarked / unwatermarked (paired)")
    frontier.set_ylabel(f"authors named at T = {cells[0]['T']} (%)")
    frontier.set_title("Naming against quality, per encoder")
    frontier.grid(alpha=0.3)
    sweep.axvline(switch, color="black", linestyle="--", linewidth=1)
    sweep.text(switch, 50, f" companion below τ = {switch:g} ", rotation=90, fontsize=8, ha="right", va="center")
    sweep.set_xlabel("sampling temperature τ")
    sweep.set_ylabel("authors named (%)")
    ratio_axis.set_ylabel("PPL ratio (dotted)")
    sweep.set_ylim(0, 102)
    sweep.set_title("Both encoders across temperatures")
    sweep.grid(alpha=0.3)
    handles, labels = sweep.get_legend_handles_labels()
    more, more_labels = ratio_axis.get_legend_handles_labels()
    sweep.legend(handles + more, labels + more_labels, loc="lower right", fontsize=7)
    _save(fig, path)
    return True
