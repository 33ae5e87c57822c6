"""The keyed shard function: numpy/torch bit-identity, order sensitivity, uniformity, independence."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from xmark_core import WatermarkKey, WatermarkParams, block_index, context_multipliers, shard, token_codes
from xmark_core.hashing import MASK32

from .synthetic import SECRET

MAX_ID = (1 << 31) - 1
EDGE_IDS = np.array([0, 1, 2, 3, 255, 256, 49_151, 49_152, 65_535, 65_536, (1 << 21) - 1, 1 << 21, MAX_ID - 1, MAX_ID])
P_MIN = 1e-4  # fixed-seed significance floor of the goodness-of-fit tests below


def _words(num_keys: int, secret: str = SECRET) -> np.ndarray:
    return WatermarkKey.from_secret(secret, WatermarkParams(bits=8, block_bits=1, num_keys=num_keys)).words


def _triples(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n (x[t-2], x[t-1], token) triples: a quarter each of full-range ids, vocabulary-size ids,
    ids with a zero in some position, and all pairings of the edge ids."""
    rng = np.random.default_rng(seed)
    q = n // 4
    cols = []
    for _ in range(3):
        full = rng.integers(0, MAX_ID + 1, q)
        vocab = rng.integers(0, 50_000, q)
        with_zeros = np.where(rng.random(q) < 0.5, 0, rng.integers(0, MAX_ID + 1, q))
        edges = rng.choice(EDGE_IDS, n - 3 * q)
        cols.append(np.concatenate([full, vocab, with_zeros, edges]).astype(np.int64))
    return cols[0], cols[1], cols[2]


def _distinct_triples(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Like ``_triples`` with repeated triples dropped: independent draws for the goodness-of-fit tests."""
    cols = np.unique(np.stack(_triples(n, seed), axis=1), axis=0)  # [m, 3]
    return cols[:, 0], cols[:, 1], cols[:, 2]


def test_key_words_do_not_depend_on_the_number_of_keys() -> None:
    # derived key j is the same for every k, so k = 8 results cover every k <= 8 column-wise
    eight = _words(8)
    for k in range(1, 8):
        np.testing.assert_array_equal(_words(k), eight[:k])


@pytest.mark.slow  # a statistical simulation: seconds on two cores
def test_numpy_and_torch_cpu_are_bit_identical_on_a_million_triples() -> None:
    prev2, prev1, token = _triples(1_000_000, seed=1)
    assert prev2.min() == 0 and prev2.max() == MAX_ID and token.min() == 0 and token.max() == MAX_ID
    words = _words(8)
    words_t = torch.from_numpy(words.copy())
    p2_t, p1_t, tok_t = (torch.from_numpy(a) for a in (prev2, prev1, token))
    mult = context_multipliers(words, prev2, prev1)
    mult_t = context_multipliers(words_t, p2_t, p1_t)
    np.testing.assert_array_equal(mult_t.numpy(), mult)
    codes = token_codes(words, token)
    np.testing.assert_array_equal(token_codes(words_t, tok_t).numpy(), codes)
    assert (mult % 2 == 1).all() and (mult < (1 << 31)).all() and (mult > 0).all()
    assert (codes % 2 == 1).all() and (codes <= MASK32).all() and (codes > 0).all()
    for d in range(1, 5):
        expected = shard(words, prev2, prev1, token, d)
        assert expected.shape == (prev2.size, 8) and expected.dtype == np.int64
        assert expected.min() == 0 and expected.max() == (1 << d) - 1
        np.testing.assert_array_equal(shard(words_t, p2_t, p1_t, tok_t, d).numpy(), expected)


@pytest.mark.parametrize("k", range(1, 9))
def test_numpy_and_torch_agree_for_every_key_count_and_shard_width(k: int) -> None:
    prev2, prev1, token = _triples(40_000, seed=100 + k)
    words = _words(k)
    words_t = torch.from_numpy(words.copy())
    for d in range(1, 5):
        expected = shard(words, prev2, prev1, token, d)
        got = shard(words_t, torch.from_numpy(prev2), torch.from_numpy(prev1), torch.from_numpy(token), d)
        assert expected.shape == (prev2.size, k)
        np.testing.assert_array_equal(got.numpy(), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_numpy_and_torch_cuda_are_bit_identical() -> None:
    prev2, prev1, token = _triples(1_000_000, seed=2)
    words = _words(8)
    dev = torch.device("cuda")
    args = [torch.from_numpy(a).to(dev) for a in (prev2, prev1, token)]
    words_t = torch.from_numpy(words.copy()).to(dev)
    for d in range(1, 5):
        np.testing.assert_array_equal(shard(words_t, *args, d).cpu().numpy(), shard(words, prev2, prev1, token, d))


def test_shard_does_not_modify_its_inputs() -> None:
    prev2, prev1, token = _triples(4_000, seed=3)
    words = _words(4).copy()
    copies = [a.copy() for a in (words, prev2, prev1, token)]
    shard(words, prev2, prev1, token, 2)
    token_codes(words, token)
    context_multipliers(words, prev2, prev1)
    for before, after in zip(copies, (words, prev2, prev1, token), strict=True):
        np.testing.assert_array_equal(before, after)
    tensors = [torch.from_numpy(a.copy()) for a in copies]
    shard(*tensors[:4], 2)
    for before, after in zip(copies, tensors, strict=True):
        np.testing.assert_array_equal(before, after.numpy())


def test_block_index_is_the_papers_sum_mod_r() -> None:
    prev2, prev1, _ = _triples(10_000, seed=4)
    for r in (1, 3, 8, 16, 128):
        np.testing.assert_array_equal(block_index(prev2, prev1, r), (prev2 + prev1) % r)


@pytest.mark.parametrize(("d", "k"), [(1, 1), (2, 1), (2, 2), (3, 2), (1, 4), (4, 1)])
def test_reversed_context_agrees_only_by_chance(d: int, k: int) -> None:
    """shard(a, b, v) == shard(b, a, v) on all k keys with probability D**-k, as for independent draws."""
    rng = np.random.default_rng(10 * d + k)
    n = 200_000
    a = rng.integers(0, 50_000, n)
    b = rng.integers(0, 50_000, n)
    b = np.where(a == b, b + 1, b)
    v = rng.integers(0, 50_000, n)
    words = _words(k)
    same = (shard(words, a, b, v, d) == shard(words, b, a, v, d)).all(axis=1)
    expected = float(2.0 ** (-d * k))
    tol = 5 * np.sqrt(expected * (1 - expected) / n)
    assert abs(same.mean() - expected) < tol, (same.mean(), expected)
    # the multipliers themselves almost never coincide for (a, b) and (b, a)
    mult_same = (context_multipliers(words, a, b) == context_multipliers(words, b, a)).all(axis=1)
    assert mult_same.mean() < 1e-3


@pytest.mark.parametrize("d", [1, 2, 3, 4])
def test_shard_frequencies_are_uniform(d: int) -> None:
    prev2, prev1, token = _distinct_triples(400_000, seed=20 + d)
    s = shard(_words(3), prev2, prev1, token, d)
    shards = 1 << d
    for j in range(3):
        counts = np.bincount(s[:, j], minlength=shards)
        assert stats.chisquare(counts).pvalue > P_MIN, counts
    joint = np.bincount((s * shards ** np.arange(3)).sum(axis=1), minlength=shards**3)
    assert stats.chisquare(joint).pvalue > P_MIN


def test_no_collapse_at_token_zero_or_context_zero() -> None:
    rng = np.random.default_rng(30)
    words = _words(2)
    n = 100_000
    ctx = rng.integers(0, 50_000, (2, n))
    zeros = np.zeros(n, dtype=np.int64)
    vocab = np.arange(n, dtype=np.int64)
    cases = {
        "token 0, random contexts": shard(words, ctx[0], ctx[1], zeros, 4),
        "context (0, 0), every token": shard(words, zeros, zeros, vocab, 4),
        "context (0, b), random tokens": shard(words, zeros, ctx[1], ctx[0], 4),
        "context (a, 0), random tokens": shard(words, ctx[0], zeros, ctx[1], 4),
    }
    for name, s in cases.items():
        for j in range(2):
            assert stats.chisquare(np.bincount(s[:, j], minlength=16)).pvalue > P_MIN, name
    # contexts with a zero id still get distinct multipliers (the product seed would give 0 for
    # all): only birthday collisions among the 2**30 odd multipliers below 2**31 remain
    for mult, ids in (
        (context_multipliers(words, zeros, ctx[1])[:, 0], ctx[1]),
        (context_multipliers(words, ctx[0], zeros)[:, 0], ctx[0]),
    ):
        m = np.unique(ids).size
        expected = m * (m - 1) / 2 / 2**30
        assert m - np.unique(mult).size <= expected + 6 * np.sqrt(expected) + 1


def test_token_zero_in_context_zero_is_uniform_across_keys() -> None:
    params = WatermarkParams(bits=8, block_bits=2, num_keys=2)
    zero = np.zeros(1, dtype=np.int64)
    s = np.concatenate(
        [
            shard(WatermarkKey.from_secret(f"secret-number-{i:06d}", params).words, zero, zero, zero, 2)
            for i in range(4000)
        ]
    )  # [4000, 2]
    for j in range(2):
        assert stats.chisquare(np.bincount(s[:, j], minlength=4)).pvalue > P_MIN
    assert stats.chi2_contingency(np.histogram2d(s[:, 0], s[:, 1], bins=4)[0]).pvalue > P_MIN


@pytest.mark.parametrize("d", [1, 2, 4])
def test_keys_are_independent(d: int) -> None:
    prev2, prev1, token = _distinct_triples(200_000, seed=40 + d)
    s = shard(_words(4), prev2, prev1, token, d)
    shards = 1 << d
    for i, j in ((0, 1), (1, 2), (0, 3)):
        table = np.zeros((shards, shards))
        np.add.at(table, (s[:, i], s[:, j]), 1)
        assert stats.chi2_contingency(table).pvalue > P_MIN, (i, j)


def test_same_token_under_two_contexts_is_independent() -> None:
    rng = np.random.default_rng(50)
    words = _words(2)
    tokens = np.arange(65_536, dtype=np.int64)
    a, b = (int(x) for x in rng.integers(1, 50_000, 2))
    pairs = [
        ((a, b), (b, a)),  # reversed
        ((a, b), (a, b + 1)),  # neighbouring last token
        ((a, b), (a + 1, b)),  # neighbouring first token
        ((0, 0), (0, 1)),
        ((0, 0), (1, 0)),
        ((a, b), tuple(int(x) for x in rng.integers(0, 50_000, 2))),
    ]
    for c1, c2 in pairs:
        s1 = shard(words, np.full_like(tokens, c1[0]), np.full_like(tokens, c1[1]), tokens, 2)
        s2 = shard(words, np.full_like(tokens, c2[0]), np.full_like(tokens, c2[1]), tokens, 2)
        for j in range(2):
            table = np.zeros((4, 4))
            np.add.at(table, (s1[:, j], s2[:, j]), 1)
            assert stats.chi2_contingency(table).pvalue > P_MIN, (c1, c2, j)
            assert stats.chisquare(table.sum(axis=1)).pvalue > P_MIN
