"""The likelihood decoder: exact tail, calibration on null text of every kind, power against counting."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from tests.core.synthetic import LM_VOCAB, OTHER_SECRET, SECRET, Generation, generate
from xmark_core import (
    CandidateSet,
    DecodeInputError,
    Message,
    MessageAllocator,
    ModelScores,
    WatermarkKey,
    WatermarkParams,
    attribute,
    attribute_likelihood,
    decode,
    score_text,
)
from xmark_core.attribution import rival_shares
from xmark_core.likelihood import (
    WEIGHT_STEPS_PER_NAT,
    boosted_share,
    identity_test,
    naming_test,
    weighted_bernoulli_tail,
)

TOP_K = 20


def scores_of(generation: Generation, row: int) -> ModelScores:
    """The model scores of row ``row`` (the two random context tokens have none)."""
    assert generation.top_ids is not None and generation.top_logprobs is not None
    assert generation.token_logprobs is not None
    k = generation.top_ids.shape[2]
    return ModelScores(
        token_logprobs=np.concatenate([[np.nan, np.nan], generation.token_logprobs[row]]),
        top_ids=np.concatenate([np.zeros((2, k), np.int64), generation.top_ids[row]]),
        top_logprobs=np.concatenate([np.full((2, k), -np.inf), generation.top_logprobs[row]]),
        vocab_size=LM_VOCAB,
    )


def test_weighted_bernoulli_tail_matches_enumeration() -> None:
    rng = np.random.default_rng(3)
    for _ in range(20):
        weights = rng.integers(0, 6, size=rng.integers(1, 11))
        p = float(rng.uniform(0.1, 0.9))
        sums: dict[int, float] = {}
        for outcome in itertools.product((0, 1), repeat=weights.size):
            ones = sum(outcome)
            prob = p**ones * (1 - p) ** (weights.size - ones)
            total = int(np.dot(outcome, weights))
            sums[total] = sums.get(total, 0.0) + prob
        for observed in range(-1, int(weights.sum()) + 2):
            expected = sum(v for s, v in sums.items() if s >= observed)
            assert weighted_bernoulli_tail(weights, observed, p) == pytest.approx(min(1.0, expected), abs=1e-12)


@pytest.mark.parametrize("edit_rate", [0.0, 0.01, 0.3])
def test_the_evidence_of_a_position_has_expectation_one_under_the_null(edit_rate: float) -> None:
    """E[exp(llr)] = 1 when B ~ Bernoulli(gamma), whatever the position's weight: the LLR is a
    likelihood ratio against the keyed-hash null."""
    params = WatermarkParams(bits=16)
    key = WatermarkKey.from_secret(SECRET, params)
    generation = generate(key, [Message.from_bits("0110" * 4, params)], 60, seed=5, top_k=TOP_K)
    result = score_text(generation.tokens[0], scores_of(generation, 0), key, edit_rate=edit_rate)
    assert result.edit_rate == edit_rate
    gamma = boosted_share(params)
    expectation = gamma * np.exp(result.weights - result.offsets) + (1 - gamma) * np.exp(-result.offsets)
    np.testing.assert_allclose(expectation, 1.0, rtol=1e-12)
    assert (result.weights >= 0).all() and (result.weights <= params.delta / result.temperature + 1e-12).all()


def test_edits_weigh_nothing_where_the_model_would_not_have_written_the_token() -> None:
    """With an edit rate, a token the model gives far less probability than an edit would (a
    substitution) carries almost no weight; a token the model finds likely keeps the weight it has
    without edits; without edits the weight is the closed form of the module's docstring."""
    params = WatermarkParams(bits=16)
    key = WatermarkKey.from_secret(SECRET, params)
    generation = generate(key, [Message.from_bits("0110" * 4, params)], 80, seed=7, top_k=TOP_K)
    tokens, scores = generation.tokens[0].copy(), scores_of(generation, 0)
    rng = np.random.default_rng(2)
    swapped = np.arange(2, tokens.size, 3)  # every third token replaced, told the model never wrote it
    tokens[swapped] = rng.integers(0, LM_VOCAB, size=swapped.size)
    own = scores.token_logprobs.copy()
    own[swapped] = math.log(1e-6 / LM_VOCAB)
    scores = ModelScores(own, scores.top_ids, scores.top_logprobs, LM_VOCAB)
    plain = score_text(tokens, scores, key, edit_rate=0.0, dedup=False)
    edited = score_text(tokens, scores, key, edit_rate=0.01, dedup=False)
    a = params.delta / plain.temperature
    is_swapped = np.isin(plain.positions, swapped)
    assert plain.weights[is_swapped].min() > a - 1e-3  # read as full evidence without edits
    assert edited.weights[is_swapped].max() < 1e-3
    likely = ~is_swapped & (np.exp(own[plain.positions]) > 0.05)
    assert likely.sum() > 10
    np.testing.assert_allclose(edited.weights[likely], plain.weights[likely], atol=0.05)
    assert (edited.weights <= plain.weights + 1e-9).all()
    with pytest.raises(ValueError, match="edit_rate"):
        score_text(tokens, scores, key, edit_rate=1.0)


def _null_p_values(generation: Generation, key: WatermarkKey, blocks: np.ndarray, *, shuffle: bool) -> list[float]:
    rng = np.random.default_rng(11)
    out = []
    for row in range(generation.tokens.shape[0]):
        tokens = generation.tokens[row].copy()
        scores = scores_of(generation, row)
        if shuffle:  # a text the model did not write: every token replaced by a random one
            tokens[2:] = rng.integers(0, LM_VOCAB, size=tokens.size - 2)
            scores = ModelScores(
                token_logprobs=np.concatenate([[np.nan, np.nan], np.full(tokens.size - 2, math.log(0.5 / LM_VOCAB))]),
                top_ids=scores.top_ids,
                top_logprobs=scores.top_logprobs,
                vocab_size=LM_VOCAB,
            )
        result = score_text(tokens, scores, key)
        out.append(naming_test(result, blocks)[0])
    return out


@pytest.mark.slow  # a statistical simulation: seconds on two cores
@pytest.mark.parametrize("min_entropy", [0.0, 1.2], ids=["every-position", "entropy-rule"])
@pytest.mark.parametrize("shuffle", [False, True], ids=["model-text", "foreign-text"])
def test_naming_p_values_are_super_uniform_on_null_text(shuffle: bool, min_entropy: float) -> None:
    """400 texts of 100 tokens that do not carry the key (watermarked with another secret, or not
    written by the scoring model at all): P(p <= x) <= x at x = 0.01, 0.05, 0.2, up to sampling
    error (a binomial 99.9 % upper bound), for a fixed message; with the entropy rule on too (about
    half the positions skipped by the encoder and weighed 0 by the decoder)."""
    params = WatermarkParams(bits=16, min_entropy=min_entropy)
    key = WatermarkKey.from_secret(SECRET, params)
    other = WatermarkKey.from_secret(OTHER_SECRET, params)
    message = Message.from_bits("1001110001011010", params)
    count = 400
    generation = generate(other, [message] * count, 100, seed=21, top_k=TOP_K)
    p_values = np.array(_null_p_values(generation, key, message.blocks, shuffle=shuffle))
    for level in (0.01, 0.05, 0.2):
        observed = float((p_values <= level).mean())
        bound = level + 3.1 * math.sqrt(level * (1 - level) / count)
        assert observed <= bound, f"P(p <= {level}) = {observed:.3f} on {count} null texts"
    assert float(np.median(p_values)) > 0.3  # and not degenerate towards 1 either
    assert float(np.median(p_values)) < 0.95 or shuffle


def test_the_carried_message_scores_highest_and_decodes() -> None:
    params = WatermarkParams(bits=16)
    key = WatermarkKey.from_secret(SECRET, params)
    message = Message.from_bits("1100101001110001", params)
    generation = generate(key, [message], 200, seed=8, top_k=TOP_K, temperature=0.7)
    result = score_text(generation.tokens[0], scores_of(generation, 0), key)
    assert result.bits == message.bits
    p_value, _ = naming_test(result, message.blocks)
    assert p_value < 1e-6
    llr = result.token_llr(message.blocks)
    assert np.isnan(llr[:2]).all() and np.isfinite(llr[result.positions]).all()
    assert float(np.nansum(llr)) == pytest.approx(float(result.scores[np.arange(8), message.blocks].sum()))


def test_with_the_entropy_rule_skipped_positions_weigh_nothing_and_the_message_decodes() -> None:
    """Under a key version with the rule (h = 1.2 nats, about half the synthetic model's positions
    below it), a position whose top log-probability is above -h has weight 0 (the encoder left it
    alone), every other position the weight of the same key without the rule, and the carried
    message still decodes with a small p-value."""
    h = 1.2
    rule = WatermarkKey.from_secret(SECRET, WatermarkParams(bits=16, min_entropy=h))
    plain = WatermarkKey.from_secret(SECRET, WatermarkParams(bits=16))
    message = Message.from_bits("0110100111000101", rule.params)
    generation = generate(rule, [message], 300, seed=9, top_k=TOP_K, temperature=0.7)
    scores = scores_of(generation, 0)
    with_rule = score_text(generation.tokens[0], scores, rule)
    without = score_text(generation.tokens[0], scores, plain)
    skipped = -scores.top_logprobs[with_rule.positions].max(axis=1) < h
    assert 0.25 < skipped.mean() < 0.75, skipped.mean()
    assert (with_rule.weights[skipped] == 0.0).all() and (with_rule.offsets[skipped] == 0.0).all()
    np.testing.assert_array_equal(with_rule.weights[~skipped], without.weights[~skipped])
    assert with_rule.bits == message.bits
    assert naming_test(with_rule, message.blocks)[0] < 1e-4
    # the skipped positions carried nothing: their boosted share is the hash's own
    hits = with_rule.boosted[np.flatnonzero(skipped), message.blocks[with_rule.rows[skipped]]]
    gamma = boosted_share(rule.params)
    assert abs(float(hits.mean()) - gamma) < 4 * math.sqrt(gamma * (1 - gamma) / hits.size)


def test_a_prefix_of_the_scores_reads_the_prefix_of_the_text() -> None:
    params = WatermarkParams(bits=16)
    key = WatermarkKey.from_secret(SECRET, params)
    message = Message.from_bits("1100101001110001", params)
    generation = generate(key, [message], 120, seed=5, top_k=TOP_K, temperature=0.7)
    scores = scores_of(generation, 0)
    tokens = generation.tokens[0]
    whole = score_text(tokens, scores, key)
    head = score_text(tokens[:60], scores.prefix(60), key)
    scored = whole.positions < 60
    np.testing.assert_array_equal(head.positions, whole.positions[scored])
    np.testing.assert_allclose(head.weights, whole.weights[scored])
    narrow = scores.top(5)
    assert narrow.top_ids.shape[1] == 5
    np.testing.assert_array_equal(narrow.top_ids, scores.top_ids[:, :5])
    assert score_text(tokens, narrow, key).scored_tokens == whole.scored_tokens


def test_a_weight_never_reads_the_membership_of_a_token_scored_under_the_same_context() -> None:
    """Context (5, 6) is followed once by 7 and once by 8: position 4's weight must not depend on
    whether 7 is boosted (that is position 2's B), whatever the key."""
    params = WatermarkParams(bits=16)
    tokens = np.array([5, 6, 7, 5, 6, 8, 9], dtype=np.int64)
    n, k, vocab = tokens.size, 2, 1000
    top_ids = np.zeros((n, k), np.int64)
    top_lp = np.full((n, k), -np.inf)
    own = np.full(n, np.log(0.5))
    for t in range(1, n):
        top_ids[t] = [11, 12]
        top_lp[t] = np.log([0.3, 0.2])
    top_ids[5] = [7, 8]  # after (5, 6): the other position's token 7 carries almost all the rest
    top_lp[5] = np.log([0.499, 0.5])
    own[5] = np.log(0.5)
    scores = ModelScores(own, top_ids, top_lp, vocab)
    seen = set()
    for index in range(64):
        key = WatermarkKey.from_secret(f"{SECRET}/{index}", params)
        result = score_text(tokens, scores, key, dedup=False)
        at = int(np.flatnonzero(result.positions == 5)[0])
        boosted_7 = bool(result.boosted[int(np.flatnonzero(result.positions == 2)[0]), 0])
        seen.add((boosted_7, round(float(result.weights[at, 0]), 9)))
    # both memberships of token 7 occur among the keys, and position 5's weight for value 0 takes
    # one value only (the other tokens' mass is 0.001, so nothing else could move it much)
    assert {b for b, _ in seen} == {False, True}
    weights = sorted({w for _, w in seen})
    assert weights[-1] - weights[0] < 5e-3


def test_invalid_inputs_are_refused() -> None:
    params = WatermarkParams(bits=16)
    key = WatermarkKey.from_secret(SECRET, params)
    generation = generate(key, [None], 10, seed=1, top_k=TOP_K)
    scores = scores_of(generation, 0)
    with pytest.raises(DecodeInputError):
        score_text([1, 2], scores, key)
    with pytest.raises(DecodeInputError):
        score_text(generation.tokens[0][:-1], scores, key)
    with pytest.raises(ValueError, match="temperature"):
        score_text(generation.tokens[0], scores, key, temperature=0.0)


@pytest.mark.slow  # a statistical simulation: seconds on two cores
@pytest.mark.parametrize("bits", [16, 32])
def test_likelihood_names_more_authors_than_counting_and_no_wrong_one(bits: int) -> None:
    """60 authors among 2,000 allocated IDs, 150-token texts sampled at temperature 0.7: the
    likelihood decoder names at least as many as counting does on the same texts and no wrong
    user. Of 60 texts watermarked under another secret at most one is named (at alpha = 1e-3 a
    calibrated test names two or more with probability below 2e-3)."""
    params = WatermarkParams(bits=bits)
    key = WatermarkKey.from_secret(SECRET, params)
    allocator = MessageAllocator([], params, rng=random.Random(2))
    registry = [allocator.allocate() for _ in range(2000)]
    candidates = CandidateSet([m.bits for m in registry], list(range(len(registry))), params)
    authors = list(range(0, 2000, 2000 // 60))[:60]
    generation = generate(key, [registry[i] for i in authors], 150, seed=31, top_k=TOP_K, temperature=0.7)
    named = {"likelihood": 0, "counting": 0}
    for row, author in enumerate(authors):
        tokens = generation.tokens[row]
        likely = attribute_likelihood(score_text(tokens, scores_of(generation, row), key), candidates)
        counted = attribute(decode(tokens, key), candidates)
        for name, outcome in (("likelihood", likely), ("counting", counted)):
            if outcome.best is not None:
                assert outcome.best.id == author, f"{name} named a wrong user"
                named[name] += 1
    print(f"b={bits}: named of {len(authors)}: {named}")
    assert named["likelihood"] >= named["counting"]
    assert named["likelihood"] >= 0.8 * len(authors), named
    other = WatermarkKey.from_secret(OTHER_SECRET, params)
    foreign = generate(other, [registry[i] for i in authors], 150, seed=32, top_k=TOP_K, temperature=0.7)
    foreign_named = sum(
        attribute_likelihood(score_text(foreign.tokens[row], scores_of(foreign, row), key), candidates).best is not None
        for row in range(len(authors))
    )
    assert foreign_named <= 1


@pytest.mark.parametrize(
    ("scheme", "shards_bits", "keys"),
    [("xmark", 2, 1), ("xmark", 2, 4), ("xmark", 1, 3), ("xmark", 3, 2), ("mpac", 2, 1)],
)
def test_rival_shares_count_the_shard_patterns(scheme: str, shards_bits: int, keys: int) -> None:
    """q_in / q_out by enumerating every pattern of a token's k shards (uniform under the keyed hash)."""
    params = WatermarkParams(bits=4 * shards_bits, block_bits=shards_bits, num_keys=keys, scheme=scheme)  # type: ignore[arg-type]
    shards = params.num_shards
    carried, other = 0, 1

    def boosted(pattern: tuple[int, ...], value: int) -> bool:
        return pattern[0] == value if scheme == "mpac" else all(s != value for s in pattern)

    patterns = list(itertools.product(range(shards), repeat=keys))
    inside = [p for p in patterns if boosted(p, carried)]
    outside = [p for p in patterns if not boosted(p, carried)]
    q_in, q_out = rival_shares(params)
    assert q_in == pytest.approx(sum(boosted(p, other) for p in inside) / len(inside))
    assert q_out == pytest.approx(sum(boosted(p, other) for p in outside) / len(outside))


def test_the_identity_test_is_exact_against_one_rival() -> None:
    """Against a single rival the returned p-value is the exact tail over the differing blocks."""
    params = WatermarkParams(bits=16, num_keys=4)
    key = WatermarkKey.from_secret(SECRET, params)
    carried = Message.from_bits("1100101001110001", params)
    rival = Message.from_bits("1100101001110010", params)  # differs in the last block only
    generation = generate(key, [carried], 120, seed=4, top_k=TOP_K, temperature=0.7)
    result = score_text(generation.tokens[0], scores_of(generation, 0), key)
    p_value = identity_test(result, carried.blocks, rival.blocks[None, :])
    values = carried.blocks[result.rows]
    picked = np.arange(result.rows.size)
    steps = float(WEIGHT_STEPS_PER_NAT)
    units = np.ceil(result.weights[picked, values] * steps).astype(np.int64)
    hits = result.boosted[picked, values]
    inside = result.rows == params.num_blocks - 1
    q_in, q_out = rival_shares(params)
    probs = np.where(result.boosted[picked, rival.blocks[result.rows]], q_in, q_out)
    exact = weighted_bernoulli_tail(units[inside], int(units[inside & hits].sum()), probs[inside])
    assert p_value == pytest.approx(exact, rel=1e-12)
    assert identity_test(result, carried.blocks, np.zeros((0, params.num_blocks), np.uint8)) == 0.0


def test_the_identity_test_over_many_rivals_is_the_largest_exact_p_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over 300 rivals in chunks of 7, with at most 5 tested exactly, the test returns the largest
    of their exact p-values (computed one by one here) whenever it settles them, and never less."""
    import xmark_core.likelihood as likelihood

    params = WatermarkParams(bits=16, num_keys=4)
    key = WatermarkKey.from_secret(SECRET, params)
    carried = Message.from_bits("1100101001110001", params)
    generation = generate(key, [carried], 120, seed=4, top_k=TOP_K, temperature=0.7)
    result = score_text(generation.tokens[0], scores_of(generation, 0), key)
    rng = np.random.default_rng(11)
    rivals = np.repeat(carried.blocks[None, :], 300, axis=0).astype(np.int64)
    for row in range(300):  # 1 to 3 blocks changed
        for block in rng.choice(params.num_blocks, size=1 + row % 3, replace=False):
            rivals[row, block] = (rivals[row, block] + rng.integers(1, params.num_shards)) % params.num_shards
    exact = max(identity_test(result, carried.blocks, rival[None, :]) for rival in rivals)
    assert identity_test(result, carried.blocks, rivals) == pytest.approx(exact, rel=1e-12)
    monkeypatch.setattr(likelihood, "_RIVAL_CHUNK", 7)
    assert identity_test(result, carried.blocks, rivals) == pytest.approx(exact, rel=1e-12)
    monkeypatch.setattr(likelihood, "MAX_EXACT_RIVALS", 5)
    assert identity_test(result, carried.blocks, rivals) >= exact * (1 - 1e-12)


@pytest.mark.slow  # a statistical simulation: seconds on two cores
def test_identity_p_values_are_super_uniform_when_the_text_carries_the_rival() -> None:
    """400 texts of 100 tokens watermarked with m (the true author); the identity test of another
    message m* against the rival m: P(p <= x) <= x at x = 0.01, 0.05, 0.2 up to sampling error,
    whichever messages are near or far (1, 4 or 8 blocks apart). This is what bounds the chance of
    naming a wrong registered user without trusting the model."""
    params = WatermarkParams(bits=16, num_keys=4)
    key = WatermarkKey.from_secret(SECRET, params)
    truth = Message.from_bits("1001110001011010", params)
    count = 400
    generation = generate(key, [truth] * count, 100, seed=23, top_k=TOP_K, temperature=0.7)
    results = [score_text(generation.tokens[row], scores_of(generation, row), key) for row in range(count)]
    rng = np.random.default_rng(5)
    for distance in (1, 4, 8):
        named = truth.blocks.copy()
        for block in rng.choice(params.num_blocks, size=distance, replace=False):
            named[block] = (named[block] + rng.integers(1, params.num_shards)) % params.num_shards
        p_values = np.array([identity_test(result, named, truth.blocks[None, :]) for result in results])
        for level in (0.01, 0.05, 0.2):
            observed = float((p_values <= level).mean())
            bound = level + 3.1 * math.sqrt(level * (1 - level) / count)
            assert observed <= bound, f"{distance} blocks apart: P(p <= {level}) = {observed:.3f}"
        # and the test has power: the carried message is told from the same rivals
        own = np.array([identity_test(result, truth.blocks, named[None, :]) for result in results])
        assert float(np.median(own)) < 0.05, (distance, float(np.median(own)))


def test_an_identity_level_names_only_whom_no_other_registered_user_explains() -> None:
    params = WatermarkParams(bits=16, num_keys=4)
    key = WatermarkKey.from_secret(SECRET, params)
    author = Message.from_bits("1100101001110001", params)
    near = Message.from_bits("1100101001110010", params)
    candidates = CandidateSet([author.bits, near.bits], ["author", "near"], params)
    generation = generate(key, [author], 300, seed=8, top_k=TOP_K, temperature=0.7)
    result = score_text(generation.tokens[0], scores_of(generation, 0), key)
    plain = attribute_likelihood(result, candidates)
    assert plain.best is not None and plain.best.id == "author" and plain.identity_p_value is None
    guarded = attribute_likelihood(result, candidates, identity_level=1e-3)
    assert guarded.identity_p_value is not None
    assert guarded.identity_p_value == pytest.approx(identity_test(result, author.blocks, near.blocks[None, :]))
    assert (guarded.best is not None) == (guarded.identity_p_value <= 1e-3)
    with pytest.raises(ValueError, match="identity_level"):
        attribute_likelihood(result, candidates, identity_level=0.0)
