"""Weigh rules for the retrieved set's naming on one evaluation run's traces.

    python -m benchmarks.evaluation.provenance_rules TRACES.jsonl

``make eval-provenance`` with ``--traces`` records, for every rewrite, forged text and
unwatermarked text, what the retrieved set's test sees (``Evaluation.probe``): per decoder, the
leads' best, its p-value with equal shares and with the fan-out's shares, its posterior among the
leads, the registry-wide ranking's first user and confidence, and the best's identity test
against the registry's first five others. A trace the registry-wide test named (or whose copy
holder decided) keeps its outcome; for the others each rule below decides whether the retrieved
set names its best lead (counting first, then likelihood, as the fan-out runs them). The rule
``equal+ranked`` is what the fan-out applied before the shares, ``shared+ranked`` what it applies
now (the run's own outcomes check it).
Counts with Wilson 95 % intervals; wrong namings are counted over every probed trace, the null
texts under every key.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from service.trace.policy import TracePolicy

from .metrics import rate_cell

# the product's naming policy; the rules below are variants of its rules 6 and 8, weighed offline
POLICY = TracePolicy()
REWRITES = ("paraphrase", "summary")

Guard = Callable[[dict[str, Any]], bool]


def _ranked(probe: dict[str, Any]) -> bool:
    return POLICY.registry_backs(probe["registry_first"] == probe["best"], probe["registry_conf"])


def _first(probe: dict[str, Any]) -> bool:
    return bool(probe["best_registry_rank"] == 0)


def _identity(probe: dict[str, Any]) -> bool:
    p = probe["identity_top5"]
    return p is not None and POLICY.lead_identity_stands(p)


RULES: dict[str, tuple[str, Guard]] = {
    "equal+ranked": ("p_plain", _ranked),
    "shared+ranked": ("p_shared", _ranked),
    "shared+first+identity": ("p_shared", lambda p: _first(p) and _identity(p)),
    "shared+ranked|identity": ("p_shared", lambda p: _ranked(p) or (_first(p) and _identity(p))),
}


def retrieved_naming(probe: dict[str, Any] | None, p_field: str, guard: Guard) -> int | None:
    """The lead the retrieved set's test names under a rule (None: nobody)."""
    for decoder in ("counting", "likelihood"):
        seen = (probe or {}).get(decoder)
        if seen is None:
            continue
        passes = POLICY.naming_rule().evidence_names(seen[p_field], seen["margin_leads"], seen["conf_leads"])
        if passes and guard(seen):
            return int(seen["best"])
    return None


def _decided(row: dict[str, Any]) -> bool:
    """Whether the trace's outcome did not come from the retrieved set's test under the rules weighed
    (a registry-wide naming, or a copy holder's test)."""
    named_by_registry = row.get("named") is not None and row.get("named_by") == "watermark"
    return named_by_registry or row.get("copy_holder") is not None


def weigh(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for registry in sorted({row["registry"] for row in rows}):
        mine = [row for row in rows if row["registry"] == registry]
        cell: dict[str, Any] = {}
        for rule, (p_field, guard) in RULES.items():
            right = wrong = texts = forged_wrong = forged = null_named = null_pairs = 0
            for row in mine:
                if row["attack"] == "null":
                    for probe in row.get("probes", []):
                        null_pairs += 1
                        null_named += retrieved_naming(probe, p_field, guard) is not None
                    continue
                if "probe" not in row:
                    continue
                named = row["named"] if _decided(row) else retrieved_naming(row["probe"], p_field, guard)
                if row["attack"] == "forged":
                    forged += 1
                    forged_wrong += named not in (None, row["author"])
                    continue
                texts += 1
                right += named == row["author"]
                wrong += named not in (None, row["author"])
            cell[rule] = {
                "rewrites_named": rate_cell(right, texts),
                "rewrites_wrong": rate_cell(wrong, texts),
                "forged_named_other": rate_cell(forged_wrong, forged),
                "null_named": rate_cell(null_named, null_pairs),
            }
        actual = [row for row in mine if row["attack"] in REWRITES]
        cell["run"] = {"rewrites_named": rate_cell(sum(row["named"] == row["author"] for row in actual), len(actual))}
        out[str(registry)] = cell
    return out


def unnamed_rewrites(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per registry, why each rewrite the run did not name its author went unnamed: the author is
    not the leads' best fit under either decoder (in the top-5 leads or not), or is, with the
    smaller p-value of the two (the fan-out's shares) in a range, or below alpha but not backed by
    the registry-wide ranking (or, below alpha, without the posterior among the leads)."""
    out: dict[str, dict[str, int]] = {}
    for row in rows:
        if row["attack"] not in REWRITES or row["named"] == row["author"]:
            continue
        counts = out.setdefault(str(row["registry"]), {})
        probe = row.get("probe") or {}  # none: no lead holds a registered ID
        seen = [s for s in probe.values() if s and s["best"] == row["author"]]
        if not probe:
            why = "no leads"
        elif not seen:
            in_top5 = row["author"] in [lead[0] for lead in row["leads"]]
            why = "another lead fits better (author in the top 5)" if in_top5 else "another lead fits better"
        else:
            best = min(seen, key=lambda s: s["p_shared"])
            p = best["p_shared"]
            if p < POLICY.alpha:
                why = (
                    "p < alpha, no posterior among the leads"
                    if best["conf_leads"] < POLICY.min_confidence
                    else "p < alpha, refused by the registry's ranking"
                )
            else:
                bins = ((0.01, "p in [alpha, 0.01)"), (0.05, "p in [0.01, 0.05)"), (0.5, "p in [0.05, 0.5)"))
                why = next((label for high, label in bins if p < high), "p >= 0.5")
        counts[why] = counts.get(why, 0) + 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", type=Path)
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in args.traces.read_text(encoding="utf-8").splitlines() if line.strip()]
    print(json.dumps({"rules": weigh(rows), "unnamed_rewrites": unnamed_rewrites(rows)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
