"""The provenance ceiling: the trace's test against the author alone names every text the trace
names the author of, and no text carrying another user's watermark (synthetic LM, no database);
the provenance corpus's scheme option reaches the evaluation's key."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

from benchmarks.evaluation.provenance_ceiling import P_VALUE_ONLY, alone
from benchmarks.evaluation.provenance_protocol import corpus_params, salt_of, watermark_protocol, watermark_spec
from service.keyring import KeyVersionHandle
from service.services.registry_cache import RegisteredUser, RegistrySnapshot
from service.trace.analysis import LengthGroup
from service.trace.fanout import TextReading, TraceFanout
from service.trace.plan import decoders_for, plan_for
from service.trace.policy import TracePolicy
from service.vocabulary import KeyVersionStatus, TraceDecoder
from tests.core.synthetic import generate, random_messages
from tests.core.test_likelihood import scores_of
from xmark_core import CandidateSet, ModelScores, WatermarkKey, WatermarkParams

# the product's policy, read at the synthetic model's temperature
POLICY = TracePolicy(temperature=1.0)


class _Tokenizer:
    all_special_ids: ClassVar[list[int]] = []


def test_the_author_alone_is_named_whenever_the_trace_names_them_and_never_for_another_s_text() -> None:
    """Short texts among 20,000 registered users: the full trace (registry and the search's leads)
    names the author of some; the author-alone test names each of those and more; a text carrying
    another user's watermark is never named for the author."""
    params = WatermarkParams(bits=32, block_bits=2, num_keys=2)
    key = WatermarkKey.from_secret("ceiling-test-secret-0123456789", params)
    messages = random_messages(params, 20_000, seed=5)
    ids = list(range(1, len(messages) + 1))
    registry = RegistrySnapshot(
        CandidateSet([m.bits for m in messages], ids, params), {i: RegisteredUser(i, f"u{i}", "active") for i in ids}
    )
    handle = KeyVersionHandle(1, "v1", key, KeyVersionStatus.ACTIVE)
    author, other, rows = 1234, 17, 24
    both = decoders_for(TraceDecoder.AUTO, scorer_available=True)

    async def full(tokens: list[int], scores: ModelScores) -> int | None:
        plan = plan_for([LengthGroup((handle,), registry)], [author, other, 99, 4000], both)
        reading = TextReading(tokens, _Tokenizer())  # type: ignore[arg-type]

        async def read() -> ModelScores:
            return scores

        async def inline(work):  # type: ignore[no-untyped-def]
            return work()

        result = await TraceFanout(plan, reading, POLICY).run(read, run_counting=inline, run_likelihood=inline)
        return result.outcome.attributed_user_id

    async def run() -> tuple[int, int, int]:
        by_trace = by_alone = foreign = 0
        own = generate(key, [messages[author - 1]] * rows, 60, top_k=20, seed=3, temperature=1.0)
        theirs = generate(key, [messages[other - 1]] * rows, 60, top_k=20, seed=4, temperature=1.0)
        for row in range(rows):
            tokens = [int(t) for t in own.tokens[row]]
            scores = scores_of(own, row)
            traced = await full(tokens, scores) == author
            named = await alone(_Tokenizer(), handle, registry, author, tokens, scores, policy=POLICY)
            assert named or not traced, row  # the trace never names what the ceiling does not
            # without the lone candidate's margin rule: never fewer namings
            bound = replace(P_VALUE_ONLY, temperature=1.0)
            assert await alone(_Tokenizer(), handle, registry, author, tokens, scores, policy=bound) >= named
            by_trace += traced
            by_alone += named
            tokens = [int(t) for t in theirs.tokens[row]]
            foreign += await alone(
                _Tokenizer(), handle, registry, author, tokens, scores_of(theirs, row), policy=POLICY
            )
        return by_trace, by_alone, foreign

    by_trace, by_alone, foreign = asyncio.run(run())
    # seeded: the trace names the author of 2 of these 24 texts of 60 tokens, the author alone 23
    assert by_alone > by_trace >= 1, (by_trace, by_alone)
    assert foreign == 0


def test_the_corpus_scheme_reaches_the_evaluation_key(tmp_path: Path) -> None:
    """The xmark corpus's record is the one earlier caches hold; a gumbel corpus's record gives the
    evaluation the very parameters (so the key) its answers were written under."""
    assert watermark_protocol("xmark") == {"bits": 32, "block_bits": 2, "num_keys": 4, "delta": 2.0}
    assert corpus_params(tmp_path) == watermark_spec(0.7).params()
    (tmp_path / "protocol.json").write_text(json.dumps({"watermark": watermark_protocol("gumbel")}))
    params = corpus_params(tmp_path)
    assert params == watermark_spec(1.0, "gumbel").params()
    assert (params.scheme, params.block_bits, params.salts, params.num_keys) == ("gumbel", 8, 16, 1)
    salts = {salt_of(author, 0, 16) for author in range(200)}
    assert salts == set(range(16)) and salt_of(3, 0, 1) == 0
