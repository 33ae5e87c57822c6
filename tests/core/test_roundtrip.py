"""Encoder -> synthetic LM sampling -> decoder round trips for XMark, XMark^-, LoSo and MPAC."""

from __future__ import annotations

import numpy as np
import pytest

from xmark_core import WatermarkKey, WatermarkParams, decode, detect
from xmark_core.params import Scheme

from .synthetic import SECRET, bit_accuracy, generate, random_messages

USERS = 16  # one batch row per user, all watermarked in the same decoding steps


def _accuracy(key: WatermarkKey, tokens: np.ndarray, messages, length: int, constrained: bool = True) -> float:
    """Mean bit accuracy over the rows, decoding the first ``length`` generated tokens of each."""
    return float(
        np.mean(
            [
                bit_accuracy(decode(row[: 2 + length], key, constrained=constrained).bits, m.bits)
                for row, m in zip(tokens[: len(messages)], messages, strict=True)  # rows past them: unwatermarked
            ]
        )
    )


@pytest.fixture(scope="module")
def xmark_run():
    key = WatermarkKey.from_secret(SECRET, WatermarkParams(bits=16, num_keys=2))
    messages = random_messages(key.params, USERS, seed=21)
    return key, messages, generate(key, [*messages, None], 600, seed=22)


def test_synthetic_lm_entropy_is_realistic(xmark_run) -> None:
    _, _, gen = xmark_run
    # sampled LLM text: a few nats per token on average, some near-deterministic steps, none near log V
    assert 2.5 < gen.entropy.mean() < 3.5
    assert np.quantile(gen.entropy, 0.05) > 1.0
    assert np.quantile(gen.entropy, 0.95) < 4.5
    assert gen.entropy.max() < np.log(4096) - 3


def test_bit_accuracy_rises_with_length(xmark_run) -> None:
    key, messages, gen = xmark_run
    acc = {t: _accuracy(key, gen.tokens, messages, t) for t in (50, 150, 600)}
    assert acc[50] < acc[150] <= acc[600]
    assert acc[50] > 0.6  # well above chance (0.5) already
    assert acc[600] > 0.99


@pytest.mark.slow  # a statistical simulation: seconds on two cores
def test_rows_in_one_batch_carry_their_own_messages(xmark_run) -> None:
    key, messages, gen = xmark_run
    decoded = [decode(row, key) for row in gen.tokens[:USERS]]
    exact = sum(r.message == m for r, m in zip(decoded, messages, strict=True))
    assert exact >= USERS - 1
    for r in decoded:
        d = detect(r)
        assert d.is_watermarked and d.p_value < 1e-4
    # the unwatermarked row of the same batch is not detected
    assert detect(decode(gen.tokens[USERS], key)).p_value > 1e-3


@pytest.mark.slow  # a statistical simulation: seconds on two cores
def test_xmark_minus_tmm_decoding_round_trips(xmark_run) -> None:
    key, messages, gen = xmark_run
    assert _accuracy(key, gen.tokens, messages, 600, constrained=False) > 0.98
    for row in gen.tokens[:4]:
        r = decode(row, key, constrained=False)
        assert r.matrix.sum() == 2 * r.scored_tokens
        assert detect(r).p_value < 1e-4


@pytest.mark.parametrize(("scheme", "k"), [("loso", 1), ("mpac", 1)])
@pytest.mark.slow  # a statistical simulation: seconds on two cores
def test_other_schemes_round_trip(scheme: Scheme, k: int) -> None:
    key = WatermarkKey.from_secret(SECRET, WatermarkParams(bits=16, num_keys=k, scheme=scheme))
    messages = random_messages(key.params, USERS, seed=31 + k)
    gen = generate(key, messages, 600, seed=32 + k)
    assert _accuracy(key, gen.tokens, messages, 600) > 0.98
    assert _accuracy(key, gen.tokens, messages, 50) < _accuracy(key, gen.tokens, messages, 600)
    ps = [detect(decode(row, key)).p_value for row in gen.tokens]
    assert max(ps) < 1e-4


def test_longer_messages_round_trip() -> None:
    key = WatermarkKey.from_secret(SECRET, WatermarkParams(bits=32, num_keys=2))
    messages = random_messages(key.params, 8, seed=41)
    gen = generate(key, messages, 600, seed=42)
    assert _accuracy(key, gen.tokens, messages, 600) > 0.97
