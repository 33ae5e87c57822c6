"""Weighted Bonferroni shares of a candidate set: every decoder divides a candidate's tail by its
share, and a null text names a wrong candidate no more often than the level allows."""

from __future__ import annotations

import numpy as np
import pytest

from xmark_core import (
    CandidateSet,
    ModelScores,
    Multiplicity,
    WatermarkKey,
    WatermarkParams,
    attribute,
    attribute_gumbel_likelihood,
    attribute_likelihood,
    decode,
    score_gumbel_text,
    score_text,
)

from .synthetic import LM_VOCAB, SECRET, Generation, generate, random_messages

LEADS = 20
TOP = 20
SHARES = [0.5] + [0.5 / (LEADS - 1)] * (LEADS - 1)


def _scores(g: Generation, row: int) -> ModelScores:
    assert g.token_logprobs is not None and g.top_ids is not None and g.top_logprobs is not None
    k = g.top_ids.shape[2]
    return ModelScores(
        np.concatenate([[np.nan, np.nan], g.token_logprobs[row]]),
        np.concatenate([np.zeros((2, k), np.int64), g.top_ids[row]]),
        np.concatenate([np.full((2, k), -np.inf), g.top_logprobs[row]]),
        LM_VOCAB,
    )


def _leads(params: WatermarkParams, seed: int) -> CandidateSet:
    messages = random_messages(params, LEADS, seed)
    return CandidateSet([m.bits for m in messages], list(range(LEADS)), params)


def test_shares_are_checked_and_dropped_by_a_subset() -> None:
    params = WatermarkParams(bits=16)
    leads = _leads(params, 1)
    with pytest.raises(ValueError, match="shares"):
        leads.with_shares([0.5] * 3)
    with pytest.raises(ValueError, match="positive"):
        leads.with_shares([0.0] + [1.0 / (LEADS - 1)] * (LEADS - 1))
    with pytest.raises(ValueError, match="at most 1"):
        leads.with_shares([0.1] * LEADS)
    shared = leads.with_shares(SHARES)
    assert leads.shares is None and shared.ids == leads.ids and np.array_equal(shared.blocks, leads.blocks)
    assert shared.multiplicity([0, 1]).tolist() == pytest.approx([2.0, 38.0])
    assert leads.multiplicity([0, 1]).tolist() == [float(LEADS)] * 2
    assert shared.subset([0, 1]).shares is None


@pytest.mark.parametrize("decoder", ["counting", "likelihood", "gumbel-counting", "gumbel-likelihood"])
def test_every_decoder_divides_a_candidates_tail_by_its_share(decoder: str) -> None:
    """The same text and candidates with and without shares: every reported candidate's p-value
    is its uncorrected tail times ``tries`` over its share, rather than times the set's size; the
    ranking, scores and posterior are the same."""
    scheme = "gumbel" if decoder.startswith("gumbel") else "xmark"
    params = (
        WatermarkParams(bits=32, block_bits=2, num_keys=1, scheme=scheme)
        if scheme == "gumbel"
        else WatermarkParams(bits=16)
    )
    key = WatermarkKey.from_secret(SECRET, params)
    leads = _leads(params, 2)
    shared = leads.with_shares(SHARES)
    # the third lead wrote the text
    g = generate(key, [random_messages(params, LEADS, 2)[2]], 120, seed=5, temperature=0.7, top_k=TOP, scale=8.0)
    tries = 3
    if decoder in ("counting", "gumbel-counting"):
        result = decode(g.tokens[0], key)
        plain, weighted = (
            attribute(result, leads, multiplicity=Multiplicity.of_tries(tries), top=LEADS),
            attribute(result, shared, multiplicity=Multiplicity.of_tries(tries), top=LEADS),
        )
    elif decoder == "likelihood":
        scored = score_text(g.tokens[0], _scores(g, 0), key)
        plain = attribute_likelihood(scored, leads, multiplicity=Multiplicity.of_tries(tries), top=LEADS)
        weighted = attribute_likelihood(scored, shared, multiplicity=Multiplicity.of_tries(tries), top=LEADS)
    else:
        gscored = score_gumbel_text(g.tokens[0], _scores(g, 0), key)
        plain = attribute_gumbel_likelihood(gscored, leads, multiplicity=Multiplicity.of_tries(tries), top=LEADS)
        weighted = attribute_gumbel_likelihood(gscored, shared, multiplicity=Multiplicity.of_tries(tries), top=LEADS)
    assert [c.id for c in weighted.candidates] == [c.id for c in plain.candidates]
    assert weighted.confidence == plain.confidence and weighted.margin == plain.margin
    compared = 0
    for before, after in zip(plain.candidates, weighted.candidates, strict=True):
        assert after.score == before.score
        if before.p_value < 1.0:  # below the cap, the tail is recoverable
            tail = before.p_value / (LEADS * tries)
            assert after.p_value == pytest.approx(min(1.0, tail * tries / SHARES[int(before.id)]), rel=1e-9)
            compared += 1
    assert compared >= 1
    assert plain.candidates[0].id == 2  # the writer ranks first; its share is 0.5 / 19: a larger factor
    assert weighted.candidates[0].p_value > plain.candidates[0].p_value


def test_a_null_text_names_a_wrong_lead_at_most_at_the_level() -> None:
    """400 texts no lead wrote, 20 leads with the shares a content search gives (half of the level
    to the first), alpha = 0.05 and no posterior rule: a wrong lead is named in at most about 5 %
    (a calibrated test exceeds 32 of 400 with probability 0.004; a share used as a factor, or a
    first lead's p-value left uncorrected, names far more)."""
    params = WatermarkParams(bits=16)
    key = WatermarkKey.from_secret(SECRET, params)
    shared = _leads(params, 3).with_shares(SHARES)
    rng = np.random.default_rng(7)
    alpha, texts = 0.05, 400
    named = first = 0
    for _ in range(texts):
        result = decode(rng.integers(0, 49_152, 82), key)
        best = attribute(result, shared, alpha=alpha, min_confidence=0.0).best
        named += best is not None
        first += best is not None and best.id == 0
    assert named <= 32, named
    assert first <= 20, first  # the first lead's own level is alpha / 2: 10 expected
