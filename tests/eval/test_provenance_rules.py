"""The weighing of retrieved-set rules on evaluation traces: each rule's naming, and why a rewrite
went unnamed."""

from __future__ import annotations

from typing import Any

from benchmarks.evaluation.provenance_rules import retrieved_naming, unnamed_rewrites, weigh

AUTHOR = 7


def _seen(best: int, *, p_plain: float, p_shared: float, first: int, conf: float, identity: float) -> dict[str, Any]:
    return {
        "best": best,
        "lead_rank": 0,
        "p_plain": p_plain,
        "p_shared": p_shared,
        "conf_leads": 0.999,
        "margin_leads": 3.0,
        "registry_first": first,
        "registry_conf": conf,
        "best_registry_rank": 0 if first == best else None,
        "identity_top5": identity,
    }


def _row(attack: str, probe: Any, *, named: int | None = None, named_by: str | None = None) -> dict[str, Any]:
    return {
        "registry": 10_000,
        "attack": attack,
        "author": AUTHOR,
        "named": named,
        "named_by": named_by,
        "copy_holder": None,
        "leads": [[AUTHOR, 0.5, 0.1]],
        "probe": probe,
    }


def test_a_rule_names_only_what_passes_its_p_value_and_its_guard() -> None:
    # the shares bring the author under alpha; the registry ranks the author first but without confidence
    weak = {"counting": _seen(AUTHOR, p_plain=5e-3, p_shared=5e-4, first=AUTHOR, conf=0.5, identity=0.005)}
    assert retrieved_naming(weak, "p_plain", lambda s: True) is None
    assert retrieved_naming(weak, "p_shared", lambda s: s["registry_conf"] >= 0.99) is None
    assert retrieved_naming(weak, "p_shared", lambda s: s["identity_top5"] <= 0.01) == AUTHOR
    # the likelihood decoder is weighed when counting does not name
    both = {
        "counting": _seen(3, p_plain=0.2, p_shared=0.3, first=3, conf=1.0, identity=0.0),
        "likelihood": _seen(AUTHOR, p_plain=1e-5, p_shared=1e-6, first=AUTHOR, conf=1.0, identity=0.0),
    }
    assert retrieved_naming(both, "p_plain", lambda s: True) == AUTHOR
    assert retrieved_naming(None, "p_plain", lambda s: True) is None


def test_weigh_keeps_registry_namings_and_counts_wrong_and_null_namings() -> None:
    strong_other = {"counting": _seen(3, p_plain=1e-6, p_shared=1e-6, first=3, conf=1.0, identity=0.0)}
    weak = {"counting": _seen(AUTHOR, p_plain=5e-3, p_shared=5e-4, first=AUTHOR, conf=0.995, identity=0.5)}
    rows = [
        _row("paraphrase", strong_other, named=AUTHOR, named_by="watermark"),  # the registry named: kept
        _row("summary", weak),
        _row("forged", strong_other),
        {**_row("null", None), "probes": [strong_other, None, weak]},
    ]
    cell = weigh(rows)["10000"]
    assert cell["equal+ranked"]["rewrites_named"]["count"] == 1  # only the registry's naming
    assert cell["shared+ranked"]["rewrites_named"]["count"] == 2
    assert cell["shared+ranked"]["forged_named_other"]["count"] == 1
    null = cell["shared+ranked"]["null_named"]
    assert (null["count"], null["of"]) == (2, 3)
    assert cell["shared+first+identity"]["rewrites_named"]["count"] == 1  # the identity test holds it back
    assert cell["run"]["rewrites_named"]["count"] == 1


def test_unnamed_rewrites_are_sorted_by_what_stopped_them() -> None:
    other_fits = {"counting": _seen(3, p_plain=0.2, p_shared=0.3, first=3, conf=1.0, identity=0.0)}
    refused = {"likelihood": _seen(AUTHOR, p_plain=5e-3, p_shared=5e-4, first=9, conf=0.9, identity=0.5)}
    faint = {"counting": _seen(AUTHOR, p_plain=0.2, p_shared=0.02, first=9, conf=0.1, identity=0.9)}
    rows = [
        _row("paraphrase", other_fits),
        {**_row("summary", other_fits), "leads": [[3, 0.4, 0.1]]},
        _row("paraphrase", refused),
        _row("summary", faint),
        _row("paraphrase", None),
        _row("summary", faint, named=AUTHOR, named_by="watermark+retrieval"),  # named: not counted
        _row("original", faint),  # not a rewrite
    ]
    assert unnamed_rewrites(rows) == {
        "10000": {
            "another lead fits better (author in the top 5)": 1,
            "another lead fits better": 1,
            "p < alpha, refused by the registry's ranking": 1,
            "p in [0.01, 0.05)": 1,
            "no leads": 1,
        }
    }
