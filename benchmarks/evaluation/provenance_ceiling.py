"""The most /trace's watermark test can name of the model's rewrites: each text against its author alone.

    python -m benchmarks.evaluation.provenance_ceiling [--corpus var/eval/provenance-seed0] [--json]

For every rewrite in a provenance corpus (``provenance_corpus``: the unwatermarked model's paraphrase
and summary of a watermarked answer of 300 tokens) and, for scale, the 20 % token substitution of
the provenance evaluation, the trace's own fan-out (``trace.fanout``, decoder ``auto``, the corpus's
key version, α = 0.001) runs with a registry that holds the author alone and no content search: one
candidate, the smallest multiplicity any plan has. Every naming rule /trace applies, among the
registry or among the content search's leads, tests the author's message ID with the same decoders
at a share of the level of at most this one. One rule is stricter with one candidate: the
likelihood decoders' margin over the runner-up is, without a runner-up, the candidate's own
log-likelihood ratio, which must be positive (rule 2 of ``service.trace.policy``). So the test
runs twice: under the product's policy (``alone``), and under the policy with that rule off
(``TracePolicy(lone_candidate_margin=False)``: the p-value alone decides), the bound on every
naming rule. The
unwatermarked answers to the same prompts are traced against their corpus author the same way (the
test's level, as a check that it is one).

Rates: count and Wilson 95 % interval, per temperature and attack, and for the rewrites that kept at
least 30 % of the answer's word 3-grams. Model scores are shared with the provenance evaluation's
cache (``provenance-scores.pkl`` in the corpus folder).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from service.keyring import KeyVersionHandle
from service.provenance.retrieval import Retrieved
from service.services.registry_cache import RegistrySnapshot
from service.trace.analysis import LengthGroup, TraceOutcome
from service.trace.fanout import TextReading
from service.trace.plan import decoders_for
from service.trace.policy import TracePolicy
from service.trace.service import run_trace
from service.vocabulary import KeyVersionStatus, TraceDecoder
from xmark_core import ModelScores

from .metrics import rate_cell
from .population import evaluation_key
from .provenance import POLICY, REWRITES, Evaluation, describe, kept_trigrams

ATTACKS = (*REWRITES, "substitution")
STRONG = 0.3  # a rewrite that kept at least this share of the answer's word 3-grams


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


async def alone(
    tokenizer: Any,
    handle: KeyVersionHandle,
    registry: RegistrySnapshot,
    user_id: int,
    ids: list[int],
    scores: ModelScores,
    *,
    policy: TracePolicy = POLICY,
) -> bool:
    """Whether the trace (decoder ``auto``, ``policy``) names ``user_id`` when the registry holds
    that user alone and no content search adds a candidate set."""

    async def read_scores() -> ModelScores:
        return scores

    async def inline(work: Any) -> TraceOutcome:
        return work()  # type: ignore[no-any-return]

    fanout = await run_trace(
        [LengthGroup((handle,), registry.restricted([user_id]))],
        Retrieved(),
        TextReading(ids, tokenizer),
        read_scores,
        policy,
        decoders=decoders_for(TraceDecoder.AUTO, scorer_available=True),
        run_counting=inline,
        run_likelihood=inline,
    )
    return fanout.outcome.attributed_user_id == user_id


# the bound: the lone candidate's margin (rule 2) not asked for, its p-value alone deciding
P_VALUE_ONLY = replace(POLICY, lone_candidate_margin=False)


async def measure(evaluation: Evaluation, policy: TracePolicy = POLICY) -> dict[str, Any]:
    key = evaluation_key(evaluation.params, evaluation.args.seed)
    handle = KeyVersionHandle(1, "v1", key, KeyVersionStatus.ACTIVE)
    registry = evaluation.snapshot(len(evaluation.registry_bits))
    tokenizer = evaluation.tokenizer
    counts: dict[str, list[int]] = {}  # cell -> [named, trials]

    def add(cell: str, named: bool) -> None:
        entry = counts.setdefault(cell, [0, 0])
        entry[0] += named
        entry[1] += 1

    for n, author in enumerate(evaluation.authors):
        t = f"{author.temperature:g}"
        for attack in ATTACKS:
            scored = evaluation.scored(author, attack)
            named = await alone(tokenizer, handle, registry, author.user_id, scored.ids, scored.scores, policy=policy)
            add(f"{t}/{attack}", named)
            if attack in REWRITES:  # a rewrite's text is the corpus's own (no edit drawn again)
                add("rewrites", named)
                if kept_trigrams(author.answer_text, evaluation.attacked(author, attack)) >= STRONG:
                    add("rewrites kept >= 30 %", named)
        null = evaluation.scorer.cache[f"{author.author}/null"]
        unmarked = await alone(tokenizer, handle, registry, author.user_id, null.ids, null.scores, policy=policy)
        add("unwatermarked", unmarked)
        if n % 50 == 49:
            _log(f"{n + 1}/{len(evaluation.authors)} authors")
    return {cell: rate_cell(named, trials) for cell, (named, trials) in counts.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=Path("var/eval/provenance-seed0"))
    parser.add_argument("--model-path", type=Path, default=Path("var/models/smollm2-135m-instruct"))
    parser.add_argument("--authors", type=int, default=0, help="authors per temperature (0: the whole corpus)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="write the figures here (JSON)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    import torch

    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(max(1, cores))
    started = time.monotonic()
    evaluation = Evaluation(args)
    texts = {f"{a.author}/{attack}": evaluation.attacked(a, attack) for a in evaluation.authors for attack in ATTACKS}
    texts.update({f"{a.author}/null": a.null_text for a in evaluation.authors})
    _log(f"scoring {len(texts)} texts (cached ones are skipped)")
    evaluation.scorer.score_all(texts)
    cells = asyncio.run(measure(evaluation))
    bound = asyncio.run(measure(evaluation, P_VALUE_ONLY))
    document = {
        "meta": {
            "command": "python -m benchmarks.evaluation.provenance_ceiling "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": f"{platform.processor() or platform.machine()}, {cores} cores",
            "corpus": str(args.corpus),
            "authors": len(evaluation.authors),
            "watermark": describe(evaluation.params),
            "alpha": POLICY.alpha,
            "seconds": round(time.monotonic() - started),
        },
        "named_alone": cells,
        "named_alone_p_value_only": bound,
    }
    if args.output is not None:
        args.output.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    if args.json:
        print(json.dumps(document))
    else:
        print(f"{document['meta']['watermark']}, {len(evaluation.authors)} authors, α = {POLICY.alpha:g}: named alone")
        for cell, rate in cells.items():
            low, high = rate["ci95"]
            other = bound[cell]
            print(
                f"  {cell:24s} {rate['count']:4d}/{rate['of']:<4d} {rate['rate']:6.1%} ({low:.1%}–{high:.1%})"
                f"   p-value only: {other['count']:4d}/{other['of']:<4d} {other['rate']:6.1%}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
