"""Every trace of a forensic evaluation run, one outcome each: what a change to the trace's code must
leave equal.

    python -m benchmarks.evaluation.trace_outcomes OUT.json [--compare OTHER.json] -- FORENSIC ARGS

runs ``python -m benchmarks.evaluation.forensic FORENSIC ARGS`` (``--report-only`` on a cache of
answers and scores, so two checkouts read the same texts) and writes, per trace in the order the
evaluation runs them: the decoder, a hash of the text's tokens, the registry sizes read, the named
user, the p-value, the confidence and the verdict. ``--compare`` then lists the traces whose
outcome differs from ``OTHER.json`` (named user or verdict; p-value or confidence beyond a relative
1e-9) and exits 1 if any does. Run it in each checkout (a ``git worktree`` of the other commit, with
``PYTHONPATH`` set to it and this file copied in where it is absent) on one ``--cache-dir``.

    python -m benchmarks.evaluation.trace_outcomes --compare-traces A.jsonl B.jsonl

compares two ``--traces`` files of the provenance evaluation (``benchmarks.evaluation.provenance``,
each checkout run on one ``--corpus``, whose model scores it caches): every field of every trace
(the named user, ``named_by``, the corroboration, the copy holder, withdrawn and refused users, the
leads, the probes' p-values) equal, numbers to a relative 1e-9; exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from . import forensic


def _close(a: float, b: float) -> bool:
    return a == b or abs(a - b) <= 1e-9 * max(abs(a), abs(b))


def _same(a: Any, b: Any) -> bool:
    """Equal, floats to a relative 1e-9, through dicts and lists."""
    if isinstance(a, float) and isinstance(b, float):
        return _close(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def trace_differences(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """The provenance traces (index, field) that differ in any field."""
    if len(ours) != len(theirs):
        return [(-1, f"{len(ours)} traces against {len(theirs)}")]
    return [
        (i, f"{field}: {a.get(field)!r} != {b.get(field)!r}")
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True))
        for field in sorted(a.keys() | b.keys())
        if not _same(a.get(field), b.get(field))
    ]


def _compare_traces(first: Path, second: Path) -> int:
    rows = [
        [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line] for path in (first, second)
    ]
    found = trace_differences(rows[0], rows[1])
    for index, what in found[:20]:
        print(f"trace {index}: {what}")
    named = sum(row.get("named") is not None for row in rows[0])
    print(f"{len(rows[0])} traces ({named} named): {len(found)} differences")
    return 1 if found else 0


def differences(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """The traces (index, what) whose outcome differs."""
    if len(ours) != len(theirs):
        return [(-1, f"{len(ours)} traces against {len(theirs)}")]
    out = []
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for field in ("decoder", "text", "registry", "named", "watermarked"):
            if a[field] != b[field]:
                out.append((i, f"{field}: {a[field]!r} != {b[field]!r}"))
        for field in ("p_value", "confidence"):
            if not _close(a[field], b[field]):
                out.append((i, f"{field}: {a[field]!r} != {b[field]!r}"))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--compare-traces"]:
        if len(argv) != 3:
            raise SystemExit("usage: --compare-traces A.jsonl B.jsonl")
        return _compare_traces(Path(argv[1]), Path(argv[2]))
    ours, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m benchmarks.evaluation.trace_outcomes", description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--compare", type=Path, help="a file this command wrote in another checkout")
    args = parser.parse_args(ours)
    outcomes: list[dict[str, Any]] = []
    trace = forensic.trace

    def recorded(decoder: str, scored: Any, tokenizer: Any, groups: Any, config: Any) -> Any:
        outcome = trace(decoder, scored, tokenizer, groups, config)
        report = outcome.report
        outcomes.append(
            {
                "decoder": decoder,
                "text": hashlib.sha256(repr(list(scored.ids)).encode()).hexdigest()[:16],
                "registry": [len(group.snapshot) for group in groups],
                "named": outcome.attributed_user_id,
                "p_value": report.p_value,
                "confidence": report.confidence,
                "watermarked": report.watermarked,
            }
        )
        return outcome

    forensic.trace = recorded  # type: ignore[assignment]  # the evaluation's own calls, recorded
    try:
        status = forensic.main(rest)
    finally:
        forensic.trace = trace  # type: ignore[assignment]
    args.out.write_text(json.dumps(outcomes) + "\n", encoding="utf-8")
    print(f"{len(outcomes)} traces, {sum(o['named'] is not None for o in outcomes)} named -> {args.out}")
    if args.compare is None:
        return status
    found = differences(outcomes, json.loads(args.compare.read_text(encoding="utf-8")))
    for index, what in found[:20]:
        print(f"trace {index}: {what}")
    print(f"{len(found)} differences against {args.compare}")
    return 1 if found else status


if __name__ == "__main__":
    raise SystemExit(main())
