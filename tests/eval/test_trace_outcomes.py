"""The before/after comparison of traces (benchmarks.evaluation.trace_outcomes): what a change to the
trace's code must leave equal, and the differences it must report."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.evaluation.trace_outcomes import differences, main, trace_differences

TRACE = {
    "named": 6150,
    "named_by": "watermark",
    "p_value": 4.703166154977721e-26,
    "corroboration": "corroborated",
    "leads": [[6150, 1.0, 0.5781], [5108, 0.0656, 0.0]],
    "probe": {"counting": {"best": 6150, "p_plain": 0.15634172923297823}},
}


def _with(**changes: object) -> dict[str, object]:
    return {**TRACE, **changes}


def test_provenance_traces_equal_to_1e9_are_the_same() -> None:
    close = _with(p_value=4.703166154977721e-26 * (1 + 1e-12), leads=[[6150, 1.0, 0.5781], [5108, 0.0656, 0.0]])
    assert trace_differences([TRACE, TRACE], [TRACE, close]) == []


def test_every_field_of_a_provenance_trace_is_compared() -> None:
    changed = [
        _with(named=5108),
        _with(named_by="watermark+retrieval"),
        _with(p_value=4.8e-26),
        _with(corroboration="leads"),
        _with(leads=[[6150, 1.0, 0.5781]]),
        _with(probe={"counting": {"best": 6150, "p_plain": 0.1564}}),
        {key: value for key, value in TRACE.items() if key != "named_by"},
    ]
    found = trace_differences([TRACE] * len(changed), changed)
    assert [index for index, _ in found] == list(range(len(changed)))
    assert trace_differences([TRACE], [TRACE, TRACE]) == [(-1, "1 traces against 2")]


def test_the_command_exits_1_on_a_difference(tmp_path: Path) -> None:
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text(json.dumps(TRACE) + "\n", encoding="utf-8")
    second.write_text(json.dumps(TRACE) + "\n", encoding="utf-8")
    assert main(["--compare-traces", str(first), str(second)]) == 0
    second.write_text(json.dumps(_with(named=None)) + "\n", encoding="utf-8")
    assert main(["--compare-traces", str(first), str(second)]) == 1


def test_forensic_outcomes_differ_on_the_named_user_or_a_p_value() -> None:
    outcome = {"decoder": "counting", "text": "ab", "registry": [10], "named": 3, "watermarked": True}
    ours = [{**outcome, "p_value": 1e-8, "confidence": 0.999}]
    assert differences(ours, [{**outcome, "p_value": 1e-8 * (1 + 1e-12), "confidence": 0.999}]) == []
    assert [what.split(":")[0] for _, what in differences(ours, [{**ours[0], "named": 4}])] == ["named"]
    assert [what.split(":")[0] for _, what in differences(ours, [{**ours[0], "p_value": 2e-8}])] == ["p_value"]
