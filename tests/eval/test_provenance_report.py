"""The provenance evaluation's report: goals pooled over the right cells, written to both files."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.evaluation.metrics import rate_cell as _rate
from benchmarks.evaluation.provenance import ATTACKS, goals, write_report


def _cell(named: int, wrong: int, trials: int, top5: int, strong: tuple[int, int], not_found: int) -> dict:
    return {
        "texts": trials,
        "named_right": _rate(named, trials),
        "named_wrong": _rate(wrong, trials),
        "named_by_retrieval": _rate(0, trials),
        "author_top_lead": _rate(top5, trials),
        "author_in_top5_leads": _rate(top5, trials),
        "corroborated_of_named": _rate(0, named + wrong),
        "not_found_of_named": _rate(not_found, named + wrong),
        "kept_3grams_median": 0.1,
        "named_when_kept_30pct": _rate(*strong),
    }


def _results() -> dict:
    cells = {}
    for size in (10_000, 1_000_000):
        for temperature in ("0.7", "1.0"):
            for attack in ATTACKS:
                cells[f"{size}/{temperature}/{attack}"] = _cell(1, 0, 10, 9, (0, 0), 0)
    cells["10000/0.7/paraphrase"] = _cell(3, 1, 10, 10, (2, 3), 0)
    cells["10000/1.0/summary"] = _cell(5, 0, 20, 18, (1, 1), 0)
    cells["10000/0.7/substitution"] = _cell(9, 0, 10, 10, (0, 0), 0)
    cells["10000/0.7/forged"] = _cell(10, 0, 10, 0, (0, 0), 10)
    null = {"pairs": 3200, "texts": 400, "keys": 8, "named": _rate(0, 3200), "named_by_retrieval": _rate(0, 3200)}
    return {
        "cells": cells,
        "null": {
            "10000": {**null, "with_leads": _rate(3200, 3200)},
            "1000000": {**null, "with_leads": _rate(3200, 3200)},
        },
    }


def test_goals_pool_the_rewrites_of_both_temperatures_and_one_registry() -> None:
    measured = {what: rate for what, _, rate in goals(_results(), 10_000)}
    rewrites = measured["rewrites (paraphrase + summary, both temperatures): right user named"]
    # paraphrase 0.7 (3/10) + paraphrase 1.0 (1/10) + summary 0.7 (1/10) + summary 1.0 (5/20)
    assert (rewrites["count"], rewrites["of"]) == (10, 50)
    strong = measured["rewrites keeping ≥ 30 % of the 3-grams: right user named"]
    assert (strong["count"], strong["of"]) == (3, 4)
    assert measured["rewrites: wrong user named"]["count"] == 1
    substitution = measured["20 % token substitution, T = 0.7: right user named"]
    assert (substitution["count"], substitution["of"]) == (9, 10)
    forged = measured["forged (never logged), of those named: not_found"]
    assert (forged["count"], forged["of"]) == (10 + 0, 10 + 1)
    assert measured["unwatermarked texts on the same prompts: named"]["of"] == 3200


def test_the_report_carries_the_goals(tmp_path: Path) -> None:
    meta = {
        "command": "python -m benchmarks.evaluation.provenance",
        "machine": "x86_64, 2 CPUs",
        "corpus": "c",
        "log_size": 100_000,
        "registries": [10_000, 1_000_000],
        "watermark": "scheme gumbel, b = 32, d = 8, S = 16 salts",
    }
    write_report(_results(), meta, tmp_path)
    text = (tmp_path / "PROVENANCE.md").read_text(encoding="utf-8")
    assert "one key version (scheme gumbel, b = 32, d = 8, S = 16 salts)" in text
    assert "| rewrites (paraphrase + summary, both temperatures): right user named | ≥ 60 % | 20.0 % (10/50;" in text
    document = json.loads((tmp_path / "provenance.json").read_text(encoding="utf-8"))
    assert document["goals"]["1000000"][0]["of"] == 40
