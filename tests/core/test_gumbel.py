"""The distortion-free scheme ``gumbel`` (xmark_core.gumbel): sampling, decoding, exact p-values."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy import stats

from xmark_core import (
    CandidateSet,
    Message,
    ModelScores,
    ParamsError,
    TorchWatermarker,
    WatermarkKey,
    WatermarkParams,
    apply_watermark,
    attribute,
    decode,
    detect,
    gumbel,
    score_text,
)
from xmark_core.hashing import context_multipliers, token_codes
from xmark_core.hf import XMarkLogitsProcessor

from .synthetic import OTHER_SECRET, SECRET, generate, random_messages

PARAMS = WatermarkParams(bits=32, block_bits=2, num_keys=1, scheme="gumbel")


@pytest.fixture(scope="module")
def gkey() -> WatermarkKey:
    return WatermarkKey.from_secret(SECRET, PARAMS)


def _step(key: WatermarkKey, logits: torch.Tensor, context: torch.Tensor, blocks: torch.Tensor, **kw):
    rows = logits.shape[0]
    active = kw.pop("active", torch.ones(rows, dtype=torch.bool))
    temperature = kw.pop("temperature", torch.full((rows,), 0.7))
    return TorchWatermarker(key).apply(logits, context, blocks, active, temperature=temperature)


# ---- parameters --------------------------------------------------------------------------------


def test_parameters_of_the_scheme_are_checked() -> None:
    assert PARAMS.distortion_free and not WatermarkParams().distortion_free
    with pytest.raises(ParamsError, match="num_keys must be 1"):
        WatermarkParams(bits=32, num_keys=4, scheme="gumbel")
    with pytest.raises(ParamsError, match="adds no bias"):
        WatermarkParams(bits=32, num_keys=1, delta=3.0, scheme="gumbel")
    with pytest.raises(ParamsError, match="entropy rule"):
        WatermarkParams(bits=32, num_keys=1, min_entropy=0.5, scheme="gumbel")
    # its own fingerprint: the same secret under another scheme is another key version
    assert (
        WatermarkKey.from_secret(SECRET, PARAMS).fingerprint
        != WatermarkKey.from_secret(SECRET, WatermarkParams(bits=32, num_keys=1, scheme="loso")).fingerprint
    )


def test_biasing_entry_points_refuse_the_sampling_scheme(gkey: WatermarkKey) -> None:
    logits, context, blocks = (
        torch.zeros(1, 64),
        torch.zeros(1, 2, dtype=torch.int64),
        torch.zeros(1, 16, dtype=torch.int64),
    )
    marker = TorchWatermarker(gkey)
    with pytest.raises(ParamsError, match="temperature"):
        marker.apply(logits, context, blocks, torch.ones(1, dtype=torch.bool))
    with pytest.raises(ParamsError, match="samples instead of biasing"):
        apply_watermark(
            logits,
            context,
            blocks,
            torch.ones(1, dtype=torch.bool),
            words=marker.words(logits.device),
            codes=marker.codes(logits.device, 64),
            params=PARAMS,
        )
    assert marker.cpu_step(64) is None  # the vLLM CPU worker's bound biasing op does not serve it
    scores = ModelScores(np.zeros(3), np.zeros((3, 1), np.int64), np.zeros((3, 1)), 64)
    with pytest.raises(ParamsError, match="likelihood decoder"):
        score_text([1, 2, 3], scores, gkey)
    with pytest.raises(ParamsError, match="temperature"):
        XMarkLogitsProcessor(gkey, [None])


# ---- the sampler ---------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_over_keyed_draws_the_choice_has_the_models_distribution(gkey: WatermarkKey, temperature: float) -> None:
    """Distortion-free: over 40,000 contexts (independent keyed draws) the chosen tokens follow
    softmax(logits / temperature) (chi-square goodness of fit)."""
    g = torch.Generator().manual_seed(11)
    vocab, rows = 40, 40_000
    logits = (torch.randn(vocab, generator=g) * 2.0).repeat(rows, 1)
    context = torch.randint(0, 49_152, (rows, 2), generator=g)
    blocks = torch.randint(0, 4, (rows, 16), generator=g)
    out = _step(gkey, logits.clone(), context, blocks, temperature=torch.full((rows,), temperature))
    assert bool((torch.isfinite(out).sum(dim=1) == 1).all())  # one finite logit per row
    counts = np.bincount(out.argmax(dim=1).numpy(), minlength=vocab)
    expected = torch.softmax(logits[0] / temperature, dim=0).double().numpy() * rows
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    wanted = np.append(expected[big], expected[~big].sum())
    assert stats.chisquare(observed, wanted * observed.sum() / wanted.sum()).pvalue > 1e-3


@pytest.mark.parametrize(
    ("temperature", "nucleus"),
    [
        (0.7, {"top_p": 0.8}),
        (1.0, {"top_k": 7}),
        (1.0, {"min_p": 0.05, "top_p": 0.95}),
        (1.3, {"top_k": 12, "top_p": 0.9}),
    ],
)
def test_within_a_nucleus_the_choice_has_the_truncated_distribution(
    gkey: WatermarkKey, temperature: float, nucleus: dict[str, float]
) -> None:
    """top-k / top-p / min-p: over 40,000 contexts the chosen tokens never leave the nucleus and
    follow the model's distribution renormalised within it, the distribution an unwatermarked
    sampler with those settings draws from (chi-square goodness of fit)."""
    g = torch.Generator().manual_seed(21)
    vocab, rows = 40, 40_000
    logits = (torch.randn(vocab, generator=g) * 2.0).repeat(rows, 1)
    context = torch.randint(0, 49_152, (rows, 2), generator=g)
    blocks = torch.randint(0, 4, (rows, 16), generator=g)
    truncation = gumbel.Truncation(**{name: torch.full((rows,), value) for name, value in nucleus.items()})
    tau = torch.full((rows,), temperature)
    out = TorchWatermarker(gkey).apply(
        logits.clone(), context, blocks, torch.ones(rows, dtype=torch.bool), temperature=tau, truncation=truncation
    )
    assert bool((torch.isfinite(out).sum(dim=1) == 1).all())
    # the nucleus, from the rules written out on one row: min-p, then top-k, then top-p
    probs = torch.softmax(logits[0].double() / temperature, dim=0)
    kept = probs >= nucleus.get("min_p", 0.0) * probs.max()
    if "top_k" in nucleus:
        kept &= probs >= probs.sort(descending=True).values[int(nucleus["top_k"]) - 1]
    if "top_p" in nucleus:
        inside = torch.where(kept, probs, 0.0)
        order = inside.argsort(descending=True)
        before = torch.cumsum(inside[order], dim=0) - inside[order]  # mass of the likelier tokens
        top = torch.zeros_like(kept)
        top[order] = before < nucleus["top_p"] * inside.sum()
        kept &= top
    assert 2 <= int(kept.sum()) < vocab  # a real truncation
    counts = np.bincount(out.argmax(dim=1).numpy(), minlength=vocab)
    assert counts[~kept.numpy()].sum() == 0
    expected = torch.where(kept, probs, 0.0).numpy()
    expected = expected / expected.sum() * rows
    big = expected >= 5
    small = kept.numpy() & ~big  # the nucleus's rare tokens, pooled
    observed = np.append(counts[big], counts[small].sum()) if small.any() else counts[big]
    wanted = np.append(expected[big], expected[small].sum()) if small.any() else expected[big]
    assert stats.chisquare(observed, wanted * observed.sum() / wanted.sum()).pvalue > 1e-3


def test_truncation_is_the_engines_own(gkey: WatermarkKey) -> None:
    """truncate_ removes what transformers' top-k / top-p / min-p warpers remove at the same
    temperature, on active rows only; inactive and greedy rows keep every logit."""
    from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(23)
    logits = torch.randn(6, 3_000, generator=g) * 3
    tau = torch.tensor([0.7, 1.0, 1.3, 0.7, 0.0, 1.0])
    active = torch.tensor([True, True, True, True, True, False])
    ids = torch.zeros((1, 1), dtype=torch.long)
    for warper, field in (
        (TopPLogitsWarper(top_p=0.9), {"top_p": 0.9}),
        (TopKLogitsWarper(top_k=40), {"top_k": 40}),
        (MinPLogitsWarper(min_p=0.1), {"min_p": 0.1}),
    ):
        out = logits.clone()
        gumbel.truncate_(out, tau, active, gumbel.Truncation(**{k: torch.full((6,), v) for k, v in field.items()}))
        for row in range(4):
            reference = warper(ids, (logits[row : row + 1] / tau[row]).float())[0]
            assert torch.equal(torch.isneginf(out[row]), torch.isneginf(reference)), (field, row)
            assert 0 < int(torch.isfinite(out[row]).sum()) < 3_000
        assert torch.equal(out[4:], logits[4:])  # greedy and inactive rows


def test_the_choice_is_fixed_by_key_context_and_value(gkey: WatermarkKey) -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 500, generator=g) * 3
    context = torch.randint(0, 49_152, (6, 2), generator=g)
    blocks = torch.randint(0, 4, (6, 16), generator=g)
    first = _step(gkey, logits.clone(), context, blocks).argmax(dim=1)
    assert torch.equal(first, _step(gkey, logits.clone(), context, blocks).argmax(dim=1))  # the same answer again
    other = WatermarkKey.from_secret(OTHER_SECRET, PARAMS)
    assert not torch.equal(first, _step(other, logits.clone(), context, blocks).argmax(dim=1))
    index = (context[:, 0] + context[:, 1]) % 16
    flipped = blocks.clone()
    flipped[torch.arange(6), index] = (blocks[torch.arange(6), index] + 1) % 4  # another user's value here
    assert not torch.equal(first, _step(gkey, logits.clone(), context, flipped).argmax(dim=1))


def test_rows_it_must_not_touch_are_left_alone(gkey: WatermarkKey) -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 300, generator=g)
    logits[3, :299] = float("-inf")  # only token 299 may be sampled (suppressed tokens are never chosen)
    context = torch.randint(0, 49_152, (4, 2), generator=g)
    blocks = torch.zeros(4, 16, dtype=torch.int64)
    out = _step(
        gkey,
        logits.clone(),
        context,
        blocks,
        active=torch.tensor([False, True, True, True]),
        temperature=torch.tensor([0.7, 0.0, 1.0, 1.0]),  # temperature 0: a greedy request
    )
    assert torch.equal(out[0], logits[0]) and torch.equal(out[1], logits[1])
    assert int(torch.isfinite(out[2]).sum()) == 1
    assert int(out[3].argmax()) == 299 and float(out[3, 299]) == float(logits[3, 299])


def test_repeated_context_marks_contexts_the_answer_already_used() -> None:
    # prompt [5, 6], generated 7 8 5 6: the context (5, 6) wrote 7 at position 2, so it repeats now
    ids = torch.tensor([[5, 6, 7, 8, 5, 6], [5, 6, 7, 8, 9, 10]])
    assert gumbel.repeated_context(ids, start=2).tolist() == [True, False]
    assert gumbel.repeated_context(ids[:, :3], start=2).tolist() == [False, False]


def test_decoder_scores_are_the_encoders_draws(gkey: WatermarkKey) -> None:
    """numpy (decoder) and torch (encoder) compute the same keyed draw for every value."""
    rng = np.random.default_rng(0)
    p2, p1, tok = (rng.integers(0, 49_152, 200) for _ in range(3))
    scores = gumbel.token_scores(gkey.words, p2, p1, tok, 4)  # [n, D]
    words = torch.from_numpy(gkey.words.copy())
    mult = context_multipliers(words, torch.from_numpy(p2), torch.from_numpy(p1))[:, :1]
    codes = token_codes(words, torch.from_numpy(tok))[:, :1]
    values = gumbel.value_codes(words, torch.arange(4))[None, :]
    draws = gumbel.hashed(mult, codes, values).to(torch.float64)
    assert np.array_equal(scores, -np.log1p(-((draws.numpy() + 0.5) / 2**32)))


def test_the_encoders_32_bit_draws_are_the_decoders_draws(gkey: WatermarkKey) -> None:
    """draws32 (int32 lanes, what the encoder computes) has the int64 draw's 32 bits, for every
    sign and carry the operands can take."""
    from xmark_core.hashing import wrap32

    g = torch.Generator().manual_seed(11)
    words = torch.from_numpy(gkey.words.copy())
    p2, p1 = (torch.randint(0, 49_152, (64,), generator=g) for _ in range(2))
    mult = context_multipliers(words, p2, p1)[:, :1]  # [64, 1]
    codes = token_codes(words, torch.arange(49_152))[:, :1].T  # [1, V]
    values = gumbel.value_codes(words, torch.randint(0, 4 * 16, (64, 1), generator=g))
    wide = gumbel.hashed(mult, codes, values)  # int64 in [0, 2**32)
    narrow = gumbel.draws32(wrap32(mult), wrap32(codes), wrap32(values))
    assert narrow.dtype == torch.int32 and torch.equal(narrow.to(torch.int64) & 0xFFFFFFFF, wide)
    assert bool((narrow < 0).any()) and bool((narrow >= 0).any())


def test_the_float32_noise_keeps_both_tails() -> None:
    """gumbel_noise (float32) is -log(-log u) computed in float64, to float32 precision, at the ends
    of the draw's range where u = 1 - 2**-33 decides a choice and a naive float32 form gives inf."""
    edges = np.array([0, 1, 2, 2**20, 2**31 - 1, 2**31, 2**32 - 2**20, 2**32 - 2, 2**32 - 1], dtype=np.int64)
    spread = np.random.default_rng(12).integers(0, 2**32, 100_000)
    draws = np.concatenate([edges, spread])
    u = (draws.astype(np.float64) + 0.5) / 2**32
    w = (2**32 - draws.astype(np.float64) - 0.5) / 2**32  # 1 - u, exact in float64
    expected = -np.log(np.where(u <= 0.5, -np.log(u), -np.log1p(-w)))
    signed = torch.from_numpy(((draws + 2**31) % 2**32 - 2**31).astype(np.int32))
    noise = gumbel.gumbel_noise(signed)
    assert noise.dtype == torch.float32 and bool(torch.isfinite(noise).all())
    np.testing.assert_allclose(noise.numpy(), expected, rtol=2e-6, atol=2e-6)
    assert float(noise[signed.numpy() == -1][0]) == pytest.approx(-np.log(0.5 / 2**32), rel=1e-6)  # 22.2


# ---- the decoder and its p-values ---------------------------------------------------------------


def test_one_candidates_score_is_gamma_on_unwatermarked_text(gkey: WatermarkKey) -> None:
    """S_m = sum_i M[i, m_i] over n scored tokens is Gamma(n, 1) exactly (KS over 2,000 texts)."""
    rng = np.random.default_rng(1)
    message = random_messages(PARAMS, 1, seed=2)[0]
    candidates = CandidateSet([message.bits], [0], PARAMS)
    values = []
    for _ in range(2_000):
        result = decode(rng.integers(0, 49_152, 60), gkey)
        values.append(stats.gamma.cdf(float(candidates.hits(result.matrix)[0]), result.scored_tokens))
    assert stats.kstest(values, "uniform").pvalue > 1e-3


@pytest.mark.parametrize("block_bits", [2, 8])
def test_null_p_values_are_calibrated(block_bits: int) -> None:
    """On 600 unwatermarked texts: each candidate's corrected p-value and the detection p-value
    are super-uniform (at most their level, with a binomial allowance); blocks of 2 and of 8 bits
    (the detection null is then the sum of maxima of 256 Gamma variables per block)."""
    params = replace(PARAMS, block_bits=block_bits)
    gkey = WatermarkKey.from_secret(SECRET, params)
    rng = np.random.default_rng(4)
    messages = random_messages(params, 100, seed=5)
    candidates = CandidateSet([m.bits for m in messages], list(range(100)), params)
    attributed, detected = [], []
    for _ in range(600):
        result = decode(rng.integers(0, 49_152, int(rng.integers(20, 200))), gkey)
        attributed.append(attribute(result, candidates).p_value)
        detected.append(detect(result).p_value)
    for level in (0.05, 0.2, 0.5):
        allowance = 3 * np.sqrt(level * (1 - level) / 600)
        assert np.mean(np.asarray(attributed) <= level) <= level + allowance
        assert np.mean(np.asarray(detected) <= level) <= level + allowance
    # and not vacuous: the detection p-values are spread over (0, 1], not stuck at 1
    assert np.mean(np.asarray(detected) <= 0.5) > 0.3


def test_watermarked_texts_name_their_authors_and_nothing_else(gkey: WatermarkKey) -> None:
    """Synthetic LM (mean entropy ~2.9 nats), temperature 0.7, 100-token texts, 1,000 registered users."""
    messages = random_messages(PARAMS, 1_000, seed=7)
    candidates = CandidateSet([m.bits for m in messages], list(range(1_000)), PARAMS)
    authors = list(range(0, 1_000, 25))  # 40 authors
    marked = generate(gkey, [messages[a] for a in authors], 100, seed=8, temperature=0.7)
    plain = generate(gkey, [None] * 40, 100, seed=9, temperature=0.7)
    named = wrong = 0
    for row, author in enumerate(authors):
        result = decode(marked.tokens[row], gkey)
        outcome = attribute(result, candidates)
        assert detect(result).is_watermarked
        named += outcome.best is not None and outcome.best.id == author
        wrong += outcome.best is not None and outcome.best.id != author
    assert named >= 38 and wrong == 0
    false = sum(attribute(decode(tokens, gkey), candidates).best is not None for tokens in plain.tokens)
    assert false == 0
    # and under another key the authors' texts name nobody
    other = WatermarkKey.from_secret(OTHER_SECRET, PARAMS)
    assert sum(attribute(decode(t, other), candidates).best is not None for t in marked.tokens) == 0


def test_the_transformers_processor_samples_with_the_scheme(gkey: WatermarkKey) -> None:
    message = random_messages(PARAMS, 1, seed=12)[0]
    proc = XMarkLogitsProcessor(gkey, [message, None], temperature=0.7)
    g = torch.Generator().manual_seed(13)
    ids = torch.randint(0, 49_152, (2, 6), generator=g)
    scores = torch.randn(2, 49_152, generator=g) * 3
    out = proc(ids, scores.clone())
    assert int(torch.isfinite(out[0]).sum()) == 1 and torch.equal(out[1], scores[1])
    chosen = int(out[0].argmax())
    expected = _step(gkey, scores[:1].clone(), ids[:1, -2:], torch.from_numpy(message.blocks)[None, :])
    assert chosen == int(expected.argmax())
    # the first call fixed the answer's start: a context the answer already used is sampled normally
    ids = torch.cat([ids, torch.tensor([[ids[0, 4], ids[0, 5]], [1, 2]])], dim=1)
    again = proc(ids, scores.clone())
    assert torch.equal(again[0], scores[0])


def test_the_transformers_processor_samples_within_top_p(gkey: WatermarkKey) -> None:
    """With ``top_p`` the processor chooses inside the nucleus, as the sampler with that truncation
    does; top_p = 1 is no truncation."""
    message = random_messages(PARAMS, 1, seed=12)[0]
    g = torch.Generator().manual_seed(29)
    ids = torch.randint(0, 49_152, (1, 6), generator=g)
    scores = torch.randn(1, 49_152, generator=g) * 3
    blocks = torch.from_numpy(message.blocks)[None, :]
    one = torch.ones(1, dtype=torch.bool)
    tau = torch.full((1,), 0.7)
    for top_p in (0.5, 0.9):
        proc = XMarkLogitsProcessor(gkey, [message], temperature=0.7, top_p=top_p)
        expected = TorchWatermarker(gkey).apply(
            scores.clone(),
            ids[:, -2:],
            blocks,
            one,
            temperature=tau,
            truncation=gumbel.Truncation(top_p=torch.full((1,), top_p)),
        )
        assert torch.equal(proc(ids, scores.clone()), expected)
    whole = XMarkLogitsProcessor(gkey, [message], temperature=0.7, top_p=1.0)
    assert torch.equal(whole(ids, scores.clone()), _step(gkey, scores.clone(), ids[:, -2:], blocks))
    with pytest.raises(ParamsError, match="top_p must be in"):
        XMarkLogitsProcessor(gkey, [message], temperature=0.7, top_p=0.0)


def test_the_fused_sampler_chooses_what_the_eager_one_does(gkey: WatermarkKey) -> None:
    g = torch.Generator().manual_seed(17)
    logits = torch.randn(9, 3_000, generator=g) * 3
    context = torch.randint(0, 49_152, (9, 2), generator=g)
    blocks = torch.randint(0, 4, (9, 16), generator=g)
    active = torch.tensor([True, False, True, True, True, True, True, True, True])
    temperature = torch.tensor([0.7, 0.7, 0.0, 1.0, 1.3, 0.7, 0.7, 0.5, 1.0])
    eager = TorchWatermarker(gkey).apply(logits, context, blocks, active, temperature=temperature)
    fused_marker = TorchWatermarker(gkey, compile=True)
    fused = fused_marker.apply(logits, context, blocks, active, temperature=temperature)
    assert fused_marker._compiled_sampler is not None  # it ran compiled, not the eager fallback
    assert torch.equal(fused, eager)


def test_the_identity_test_refuses_a_name_a_neighbour_explains(gkey: WatermarkKey) -> None:
    """A registry holding the author and a neighbour that differs from them in one block: the
    identity test against the neighbour is only as strong as that block's tokens, and a twin that
    differs only in a block the text never visits cannot be told apart (p = 1, nobody named)."""
    from xmark_core.attribution import gumbel_identity_p

    author = random_messages(PARAMS, 1, seed=21)[0]
    marked = generate(gkey, [author], 120, seed=22, temperature=0.7)
    result = decode(marked.tokens[0], gkey)
    near = author.blocks.copy()
    visited = int(np.argmax(result.row_counts))
    near[visited] = (near[visited] + 1) % 4
    registry = [
        author.bits,
        *(m.bits for m in random_messages(PARAMS, 50, seed=23)),
        Message.from_blocks(near, PARAMS).bits,
    ]
    candidates = CandidateSet(registry, list(range(len(registry))), PARAMS)
    outcome = attribute(result, candidates)
    assert outcome.best is not None and outcome.best.id == 0
    assert 0.0 < gumbel_identity_p(result, candidates, 0) <= 1e-3
    # 12 scored tokens over 16 blocks: some block has none
    short = decode(marked.tokens[0][:14], gkey)
    empty = np.flatnonzero(short.row_counts == 0)
    assert empty.size >= 4
    twin = author.blocks.copy()
    twin[empty[0]] = (twin[empty[0]] + 1) % 4
    pair = CandidateSet([author.bits, Message.from_blocks(twin, PARAMS).bits], [0, 1], PARAMS)
    assert gumbel_identity_p(short, pair, 0) == 1.0
    assert attribute(short, pair).best is None
