"""Salts of the distortion-free scheme (``WatermarkParams.salts``): answers under different salts are
sampled independently, both decoders read the salt and pay for trying all of them, and their p-values
stay calibrated on text no salt wrote."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from xmark_core import (
    CandidateSet,
    ModelScores,
    ParamsError,
    TorchWatermarker,
    WatermarkKey,
    WatermarkParams,
    attribute,
    attribute_gumbel_likelihood,
    decode,
    detect,
    gumbel,
    score_gumbel_text,
)
from xmark_core.hf import XMarkLogitsProcessor

from .synthetic import SECRET, Generation, generate, random_messages

SALTED = WatermarkParams(bits=32, block_bits=8, num_keys=1, scheme="gumbel", salts=16)
TOP = 20


@pytest.fixture(scope="module")
def skey() -> WatermarkKey:
    return WatermarkKey.from_secret(SECRET, SALTED)


def _scores(g: Generation, row: int, vocab: int) -> ModelScores:
    assert g.token_logprobs is not None and g.top_ids is not None and g.top_logprobs is not None
    return ModelScores(
        np.concatenate([[0.0, 0.0], g.token_logprobs[row]]),
        np.concatenate([np.zeros((2, TOP), np.int64), g.top_ids[row]]),
        np.concatenate([np.zeros((2, TOP)), g.top_logprobs[row]]),
        vocab,
    )


def test_salts_are_part_of_the_key_version() -> None:
    plain = WatermarkParams(bits=32, block_bits=8, num_keys=1, scheme="gumbel")
    assert plain.salts == 1 and plain.num_values == 256 and SALTED.num_values == 4096
    assert "salts" not in plain.to_dict() and SALTED.to_dict()["salts"] == 16
    assert WatermarkParams.from_dict(SALTED.to_dict()) == SALTED
    assert WatermarkParams.from_dict(plain.to_dict()) == plain
    # salts=1 keeps every existing fingerprint; a salted version is another key version
    unsalted = WatermarkKey.from_secret(SECRET, plain).fingerprint
    assert WatermarkKey.from_secret(SECRET, replace(plain, salts=1)).fingerprint == unsalted
    assert WatermarkKey.from_secret(SECRET, SALTED).fingerprint != unsalted
    with pytest.raises(ParamsError, match="salts applies to scheme 'gumbel' only"):
        WatermarkParams(bits=32, num_keys=1, scheme="loso", salts=4)
    with pytest.raises(ParamsError, match="salts must be in"):
        WatermarkParams(bits=32, num_keys=1, scheme="gumbel", salts=0)
    with pytest.raises(ParamsError, match="salts must be in"):
        WatermarkParams(bits=32, num_keys=1, scheme="gumbel", salts=257)
    with pytest.raises(TypeError):
        WatermarkParams(bits=32, num_keys=1, scheme="gumbel", salts=2.0)  # type: ignore[arg-type]


def test_salted_values() -> None:
    blocks = np.array([0, 5, 255], dtype=np.int64)
    assert gumbel.salted(blocks, 0, SALTED).tolist() == [0, 5, 255]
    assert gumbel.salted(blocks, 3, SALTED).tolist() == [768, 773, 1023]
    for bad in (-1, 16, True, 1.0):
        with pytest.raises(ParamsError, match="salt must be an integer in"):
            gumbel.salted(blocks, bad, SALTED)  # type: ignore[arg-type]


def test_one_salt_fixes_the_answer_another_salt_samples_it_afresh(skey: WatermarkKey) -> None:
    """The same user, prompt and randomness: the same salt gives the same 100 tokens, another salt
    an answer that shares few of them (exponential sampling is a fixed function of the draws)."""
    message = random_messages(SALTED, 1, seed=3)[0]

    def answer(salt: int) -> np.ndarray:
        return generate(skey, [message], 100, vocab=4096, seed=11, temperature=0.7, salts=[salt]).tokens[0]

    first = answer(2)
    assert np.array_equal(first, answer(2))
    for salt in (0, 3, 15):
        assert (answer(salt)[2:] == first[2:]).mean() < 0.5


def test_the_processor_gives_a_requests_answers_consecutive_salts(skey: WatermarkKey) -> None:
    """Row i's answer j (num_return_sequences) is written under salt (salts[i] + j) mod S."""
    messages = random_messages(SALTED, 2, seed=5)
    proc = XMarkLogitsProcessor(skey, messages, temperature=0.7, salts=[14, 4])
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 4096, (6, 5), generator=g)  # 2 rows x 3 answers each
    scores = torch.randn(6, 4096, generator=g) * 3
    chosen = proc(ids, scores.clone()).argmax(dim=1)
    expected_salts = [14, 15, 0, 4, 5, 6]
    marker, cpu = TorchWatermarker(skey), torch.device("cpu")
    for row, salt in enumerate(expected_salts):
        message = messages[row // 3]
        blocks = torch.from_numpy(gumbel.salted(message.blocks, salt, SALTED))[None, :]
        reference = scores[row : row + 1].clone()
        gumbel.sample_(
            reference,
            torch.tensor([0.7]),
            ids[row : row + 1, -2:],
            blocks,
            torch.ones(1, dtype=torch.bool),
            words=marker.words(cpu),
            codes=marker.codes32(cpu, 4096),
            num_blocks=SALTED.num_blocks,
        )
        assert int(chosen[row]) == int(reference.argmax())
    with pytest.raises(ParamsError, match="salt must be an integer in"):
        XMarkLogitsProcessor(skey, messages, temperature=0.7, salts=[0, 16])
    with pytest.raises(ValueError, match="2 salts for 1 batch rows"):
        XMarkLogitsProcessor(skey, messages[:1], temperature=0.7, salts=[0, 1])


def test_both_decoders_read_the_salt_and_name_the_author(skey: WatermarkKey) -> None:
    """40 authors among 1,000 registered IDs, each answer (150 tokens, temperature 0.7) under its own
    salt: both decoders read every salt and name every author; a salt-0 answer's p-value under the
    salted key is exactly S times its p-value under the same secret without salts."""
    messages = random_messages(SALTED, 1_000, seed=7)
    candidates = CandidateSet([m.bits for m in messages], list(range(1_000)), SALTED)
    salts = [(7 * a) % 16 for a in range(40)]
    g = generate(skey, messages[:40], 150, vocab=4096, seed=8, temperature=0.7, top_k=TOP, salts=salts)
    for row in range(40):
        result = decode(g.tokens[row], skey)
        assert result.salt == salts[row]
        outcome = attribute(result, candidates)
        assert outcome.best is not None and outcome.best.id == row
        assert detect(result).is_watermarked
        reading = score_gumbel_text(g.tokens[row], _scores(g, row, 4096), skey, temperature=0.7)
        assert reading.salt == salts[row]
        by_model = attribute_gumbel_likelihood(reading, candidates)
        assert by_model.best is not None and by_model.best.id == row
    plain_params = replace(SALTED, salts=1)
    plain_key = WatermarkKey.from_secret(SECRET, plain_params)
    plain_candidates = CandidateSet([m.bits for m in messages], list(range(1_000)), plain_params)
    row = salts.index(0)
    salted_p = attribute(decode(g.tokens[row], skey), candidates).p_value
    plain_p = attribute(decode(g.tokens[row], plain_key), plain_candidates).p_value
    assert 0.0 < plain_p < 1e-6 and salted_p == pytest.approx(16 * plain_p, rel=1e-9)


def test_p_values_stay_calibrated_on_text_no_salt_wrote(skey: WatermarkKey) -> None:
    """400 texts of the synthetic LM written without the key (20 to 200 tokens): the salted readings'
    corrected p-values (counting attribution, detection, model-aware attribution; 100 registered IDs)
    are at most their level within a binomial allowance, and the counting decoders' readings are not
    stuck at 1.

    The 400 texts are drawn in one batch of 200 steps and each is cut to its own length: the
    synthetic LM draws every step's logits afresh, so a text's first n tokens are a text of n tokens.
    Seeded, so the outcome is fixed; the allowance is 3 binomial standard deviations at each level."""
    messages = random_messages(SALTED, 100, seed=9)
    candidates = CandidateSet([m.bits for m in messages], list(range(100)), SALTED)
    rng = np.random.default_rng(10)
    lengths = rng.integers(20, 200, size=400)
    g = generate(skey, [None] * 400, 200, vocab=4096, seed=100, temperature=1.0, top_k=TOP, scale=4.0)
    assert g.token_logprobs is not None and g.top_ids is not None and g.top_logprobs is not None
    counted, detected, modelled = [], [], []
    for row, length in enumerate(int(n) for n in lengths):
        text = Generation(
            tokens=g.tokens[row : row + 1, : 2 + length],
            entropy=g.entropy[row : row + 1, :length],
            top_ids=g.top_ids[row : row + 1, :length],
            top_logprobs=g.top_logprobs[row : row + 1, :length],
            token_logprobs=g.token_logprobs[row : row + 1, :length],
        )
        result = decode(text.tokens[0], skey)
        counted.append(attribute(result, candidates).p_value)
        detected.append(detect(result).p_value)
        reading = score_gumbel_text(text.tokens[0], _scores(text, 0, 4096), skey, temperature=1.0)
        modelled.append(attribute_gumbel_likelihood(reading, candidates).p_value)
    for values in (counted, detected, modelled):
        p = np.asarray(values)
        for level in (0.05, 0.2, 0.5):
            assert np.mean(p <= level) <= level + 3 * np.sqrt(level * (1 - level) / p.size)
    assert np.mean(np.asarray(detected) < 1.0) > 0.1  # not vacuous: S x tail still falls below 1
