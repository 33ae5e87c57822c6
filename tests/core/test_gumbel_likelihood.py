"""The model-aware decoder of the distortion-free scheme (xmark_core.gumbel_likelihood): exact null
laws, calibrated p-values on text the key did not write, the identity test, and its power where the
counting decoder has little (a low-entropy synthetic LM at temperature 0.7)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from xmark_core import (
    CandidateSet,
    Message,
    ModelScores,
    ParamsError,
    WatermarkKey,
    WatermarkParams,
    attribute,
    attribute_gumbel_likelihood,
    decode,
    score_gumbel_text,
)
from xmark_core.gumbel_likelihood import (
    LLR_FLOOR,
    _convolve_laws,
    _tails,
    _token_laws,
    gumbel_likelihood_identity_p,
)

from .synthetic import OTHER_SECRET, SECRET, Generation, generate, random_messages

PARAMS = WatermarkParams(bits=32, block_bits=2, num_keys=1, scheme="gumbel")
VOCAB = 4096
TOP = 20


@pytest.fixture(scope="module")
def gkey() -> WatermarkKey:
    return WatermarkKey.from_secret(SECRET, PARAMS)


@pytest.fixture(scope="module")
def registry() -> tuple[list[Message], CandidateSet]:
    messages = random_messages(PARAMS, 10_000, 1)
    return messages, CandidateSet([m.bits for m in messages], list(range(len(messages))), PARAMS)


def _scores(g: Generation, row: int) -> ModelScores:
    """The synthetic LM's distribution at every position of row ``row`` (the first two are context)."""
    assert g.token_logprobs is not None and g.top_ids is not None and g.top_logprobs is not None
    return ModelScores(
        np.concatenate([[0.0, 0.0], g.token_logprobs[row]]),
        np.concatenate([np.zeros((2, TOP), np.int64), g.top_ids[row]]),
        np.concatenate([np.zeros((2, TOP)), g.top_logprobs[row]]),
        VOCAB,
    )


# ---- the null laws ---------------------------------------------------------------------------------


def test_a_tokens_law_is_the_law_of_its_rounded_llr() -> None:
    """The per-token law against 200,000 simulated uniforms (chi-square), for a sure, a likely and an
    unlikely token, with and without edits."""
    rng = np.random.default_rng(0)
    from scipy import stats  # type: ignore[import-untyped]

    for p, eps in [(0.999, 0.01), (0.6, 0.01), (0.02, 0.01), (0.3, 0.0)]:
        excess = np.array([1.0 / p - 1.0])
        log_norm = np.log(np.array([(1 - eps) * p + eps / VOCAB]))
        step = 0.05
        (k_lo,), (pmf,) = _token_laws(excess, log_norm, eps, VOCAB, step)
        assert pmf.min() >= 0.0 and abs(pmf.sum() - 1.0) < 1e-12
        u = (rng.integers(0, 1 << 32, 200_000) + 0.5) / float(1 << 32)
        generated = np.log1p(-eps) + excess[0] * np.log(u)
        if eps > 0:
            generated = np.logaddexp(generated, np.log(eps / VOCAB))
        g = np.maximum(generated - log_norm[0], LLR_FLOOR)
        units = np.ceil(g / step).astype(np.int64) - k_lo
        assert units.min() >= 0 and units.max() < pmf.size
        counts = np.bincount(units, minlength=pmf.size)
        expected = pmf * u.size
        big = expected >= 5
        observed, wanted = counts[big], expected[big]
        if (~big).any():  # the sparse cells pooled into one
            observed, wanted = np.append(observed, counts[~big].sum()), np.append(wanted, expected[~big].sum())
        assert counts[~big].sum() <= max(25.0, 3 * expected[~big].sum())
        if observed.size > 1 and wanted[-1] >= 5:
            assert stats.chisquare(observed, wanted * observed.sum() / wanted.sum()).pvalue > 1e-3
        elif observed.size > 2:
            assert stats.chisquare(observed[:-1], wanted[:-1] * observed[:-1].sum() / wanted[:-1].sum()).pvalue > 1e-3


def test_convolution_keeps_tiny_tails() -> None:
    """Sums of Bernoulli(1/2) laws: the convolution's tail is exact far below float64's epsilon."""
    laws = [(0, np.array([0.5, 0.5]))] * 60
    offset, pmf = _convolve_laws(laws)
    assert offset == 0 and pmf.size == 61
    assert pmf[-1] == pytest.approx(2.0**-60, rel=1e-9)
    assert pmf.sum() == pytest.approx(1.0)


def test_tails_from_two_halves_equal_the_full_laws_tails() -> None:
    rng = np.random.default_rng(4)
    laws = []
    for _ in range(7):
        pmf = rng.random(int(rng.integers(1, 40)))
        laws.append((int(rng.integers(-30, 5)), pmf / pmf.sum()))
    offset, pmf = _convolve_laws(laws)
    observed = np.arange(offset - 3, offset + pmf.size + 3)
    full = np.array([pmf[max(0, o - offset) :].sum() if o - offset < pmf.size else 0.0 for o in observed])
    assert np.allclose(_tails(laws, observed), np.minimum(1.0, full), rtol=1e-12, atol=0.0)
    assert np.allclose(
        _tails(laws[:1], observed), [min(1.0, laws[0][1][max(0, o - laws[0][0]) :].sum()) for o in observed]
    )


# ---- calibration ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("temperature", "scale", "block_bits"), [(0.7, 8.0, 2), (1.0, 4.0, 2), (0.7, 8.0, 8)])
def test_p_values_are_calibrated_on_text_the_key_did_not_write(
    temperature: float, scale: float, block_bits: int
) -> None:
    """300 texts written under another key: a registered message's raw p-value is uniform or larger
    (P(p <= x) <= x within three standard errors, at x = 0.01, 0.05, 0.2, 0.5); blocks of 2 and 8 bits."""
    params = replace(PARAMS, block_bits=block_bits)
    gkey = WatermarkKey.from_secret(SECRET, params)
    other = WatermarkKey.from_secret(OTHER_SECRET, params)
    messages = random_messages(params, 300, 2)
    g = generate(other, messages, 80, seed=5, temperature=temperature, top_k=TOP, scale=scale)
    ps = []
    for row, message in enumerate(messages):
        result = score_gumbel_text(g.tokens[row], _scores(g, row), gkey, temperature=temperature)
        observed = int(result.units[np.arange(params.num_blocks), message.blocks].sum())
        ps.append(result.tail(observed))
    p = np.array(ps)
    for x in (0.01, 0.05, 0.2, 0.5):
        assert (p <= x).mean() <= x + 3 * np.sqrt(x * (1 - x) / p.size) + 1 / p.size
    assert 0.35 < p.mean() < 0.65  # and not degenerate (all p = 1 would pass the line above)


def test_unwatermarked_text_names_nobody(gkey: WatermarkKey, registry: tuple[list[Message], CandidateSet]) -> None:
    _, candidates = registry
    g = generate(gkey, [None] * 60, 120, seed=9, temperature=0.7, top_k=TOP, scale=8.0)
    for row in range(60):
        result = score_gumbel_text(g.tokens[row], _scores(g, row), gkey)
        assert attribute_gumbel_likelihood(result, candidates).best is None


# ---- power ------------------------------------------------------------------------------------------


def test_names_authors_the_counting_decoder_cannot(
    gkey: WatermarkKey, registry: tuple[list[Message], CandidateSet]
) -> None:
    """A low-entropy synthetic LM (about 1.1 nats per step) at temperature 0.7, 150 tokens, among
    10,000 registered messages: the counting decoder names few authors, the model-aware one most,
    nobody wrongly (measured: 3/50 against 40/50)."""
    messages, candidates = registry
    g = generate(gkey, messages[:50], 150, seed=3, temperature=0.7, top_k=TOP, scale=8.0)
    counted = weighted = 0
    for row in range(50):
        by_count = attribute(decode(g.tokens[row], gkey), candidates).best
        result = score_gumbel_text(g.tokens[row], _scores(g, row), gkey)
        attribution = attribute_gumbel_likelihood(result, candidates)
        by_model = attribution.best
        assert by_count is None or by_count.id == row
        assert by_model is None or by_model.id == row
        counted += by_count is not None
        weighted += by_model is not None
        if by_model is not None:
            assert attribution.identity_p_value is not None and attribution.identity_p_value <= 1e-3
    assert counted <= 12
    assert weighted >= 32


def test_larger_blocks_name_the_authors_two_bit_blocks_cannot(registry: tuple[list[Message], CandidateSet]) -> None:
    """The same IDs and the same low-entropy setting as above, read in blocks of 8 bits instead of 2:
    the nearest registered ID now differs from the author in most of the text's tokens, so the
    identity test, which is what refuses most authors with 2-bit blocks, passes (measured: counting
    31/50 against 3/50, model-aware 50/50 against 40/50), and nobody is named wrongly."""
    messages, _ = registry
    params = replace(PARAMS, block_bits=8)
    key = WatermarkKey.from_secret(SECRET, params)
    candidates = CandidateSet([m.bits for m in messages], list(range(len(messages))), params)
    authors = [Message(m.bits, params) for m in messages[:50]]
    g = generate(key, authors, 150, seed=3, temperature=0.7, top_k=TOP, scale=8.0)
    counted = weighted = 0
    for row in range(50):
        by_count = attribute(decode(g.tokens[row], key), candidates).best
        by_model = attribute_gumbel_likelihood(score_gumbel_text(g.tokens[row], _scores(g, row), key), candidates).best
        assert by_count is None or by_count.id == row
        assert by_model is None or by_model.id == row
        counted += by_count is not None
        weighted += by_model is not None
    assert counted >= 20
    assert weighted >= 47


def test_identity_test_refuses_a_neighbour_it_cannot_tell_apart(
    gkey: WatermarkKey, registry: tuple[list[Message], CandidateSet]
) -> None:
    """The author's neighbour differs in one block: where that block holds no scored token the two
    cannot be told apart and nobody is named; where it does, the author is."""
    messages, _ = registry
    author = messages[0]
    g = generate(gkey, [author], 150, seed=3, temperature=0.7, top_k=TOP, scale=8.0)
    result = score_gumbel_text(g.tokens[0], _scores(g, 0), gkey)
    blocks = author.blocks.copy()
    busiest = int(np.argmax(result.row_counts))
    blocks[busiest] = (blocks[busiest] + 1) % PARAMS.num_shards
    neighbour = "".join(format(int(v), "02b") for v in blocks)
    pool = CandidateSet([author.bits, neighbour], ["author", "neighbour"], PARAMS)
    told = attribute_gumbel_likelihood(result, pool)
    assert told.best is not None and told.best.id == "author"
    assert told.identity_p_value is not None and told.identity_p_value < 1e-3
    # a prefix of the text leaves some block without a scored token: a neighbour differing there
    # cannot be told apart (p = 1), so it is never named over the author, nor the author over it
    short = score_gumbel_text(g.tokens[0][:24], _scores(g, 0).prefix(24), gkey)
    empty = int(np.flatnonzero(short.row_counts == 0)[0])
    blocks = author.blocks.copy()
    blocks[empty] = (blocks[empty] + 1) % PARAMS.num_shards
    twin = CandidateSet([author.bits, "".join(format(int(v), "02b") for v in blocks)], ["author", "twin"], PARAMS)
    assert gumbel_likelihood_identity_p(short, twin, 0) == 1.0
    assert attribute_gumbel_likelihood(short, twin, alpha=0.5, min_confidence=0.0).best is None


def test_only_the_first_position_of_each_context_is_scored(gkey: WatermarkKey) -> None:
    ids = np.array([5, 6, 7, 5, 6, 8, 5, 6, 7, 9])
    scores = ModelScores(np.full(10, -1.0), np.zeros((10, 2), np.int64), np.full((10, 2), -1.0), 100)
    result = score_gumbel_text(ids, scores, gkey)
    assert result.positions.tolist() == [2, 3, 4, 6, 7]  # (5, 6) predicts 2, 5, 8; (6, 7) predicts 3, 9


def test_bad_input_is_refused(gkey: WatermarkKey) -> None:
    scores = ModelScores(np.zeros(3), np.zeros((3, 1), np.int64), np.zeros((3, 1)), 64)
    with pytest.raises(ParamsError, match="gumbel"):
        score_gumbel_text([1, 2, 3], scores, WatermarkKey.from_secret(SECRET, WatermarkParams()))
    with pytest.raises(ValueError, match="temperature"):
        score_gumbel_text([1, 2, 3], scores, gkey, temperature=0.0)
    with pytest.raises(ValueError, match="edit_rate"):
        score_gumbel_text([1, 2, 3], scores, gkey, edit_rate=1.0)


def test_identity_test_reads_each_pattern_of_differing_blocks_once(
    gkey: WatermarkKey, registry: tuple[list[Message], CandidateSet]
) -> None:
    """The test depends only on the blocks in which a rival differs: a registry whose every ID is
    registered three times gives the same p-value, and on a few near neighbours it is the largest
    exact tail over them one by one."""
    messages, _ = registry
    author = messages[0]
    g = generate(gkey, [author], 150, seed=5, temperature=0.7, top_k=TOP, scale=8.0)
    result = score_gumbel_text(g.tokens[0], _scores(g, 0), gkey)
    bits = [m.bits for m in messages[:2_000]]
    once = CandidateSet(bits, list(range(len(bits))), PARAMS)
    thrice = CandidateSet(bits * 3, list(range(3 * len(bits))), PARAMS)
    assert gumbel_likelihood_identity_p(result, thrice, 0) == gumbel_likelihood_identity_p(result, once, 0)
    neighbours = [author.bits]
    for block in np.argsort(-result.row_counts)[:4]:  # one block off, in the busiest blocks
        values = author.blocks.copy()
        values[block] = (values[block] + 1) % PARAMS.num_shards
        neighbours.append("".join(format(int(v), "02b") for v in values))
    near = CandidateSet(neighbours, list(range(len(neighbours))), PARAMS)
    own = result.units[np.arange(PARAMS.num_blocks), author.blocks.astype(np.int64)]
    exact = 0.0
    for rival in near.blocks[1:]:
        differs = rival != near.blocks[0]
        exact = max(exact, result.tail(int(own[differs].sum()), np.flatnonzero(differs).tolist()))
    assert gumbel_likelihood_identity_p(result, near, 0) == pytest.approx(exact, rel=1e-12)
