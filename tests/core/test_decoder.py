"""The cTMM decoder against a per-token reference, skipping, dedup, erasures, per-token output, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from xmark_core import WatermarkKey, WatermarkParams, decode, shard

from .synthetic import SECRET, generate, random_messages


def _reference(texts, key: WatermarkKey, *, constrained=True, dedup=True, skip=()):
    """Algorithm 2 token by token: (matrix [r, D], row_counts [r], scored positions per text)."""
    p = key.params
    matrix = np.zeros((p.num_blocks, p.num_shards), dtype=np.int64)
    counts = np.zeros(p.num_blocks, dtype=np.int64)
    seen: set[tuple[int, int, int]] = set()
    scored = []
    for text in texts:
        positions = []
        for t in range(2, len(text)):
            a, b, v = int(text[t - 2]), int(text[t - 1]), int(text[t])
            triple = (a, b, v)
            if v in skip or (dedup and triple in seen):
                seen.add(triple)
                continue
            seen.add(triple)
            row = (a + b) % p.num_blocks
            shards = shard(key.words, np.array([a]), np.array([b]), np.array([v]), p.block_bits)[0]
            for s in set(shards.tolist()) if constrained else shards.tolist():
                matrix[row, s] += 1
            counts[row] += 1
            positions.append(t)
        scored.append(positions)
    return matrix, counts, scored


@pytest.fixture(scope="module")
def texts() -> list[np.ndarray]:
    rng = np.random.default_rng(60)
    return [rng.integers(0, 300, n) for n in (150, 3, 80, 2, 200)]  # small vocab: repeated triples occur


@pytest.mark.parametrize(
    ("k", "d", "scheme"), [(2, 2, "xmark"), (1, 2, "loso"), (3, 1, "xmark"), (4, 4, "xmark"), (1, 3, "mpac")]
)
@pytest.mark.parametrize("constrained", [True, False])
@pytest.mark.parametrize("dedup", [True, False])
def test_matrix_matches_the_per_token_reference(texts, k, d, scheme, constrained, dedup) -> None:
    key = WatermarkKey.from_secret(SECRET, WatermarkParams(bits=8 * d, block_bits=d, num_keys=k, scheme=scheme))
    skip = (7, 11, 299)
    r = decode(texts, key, constrained=constrained, dedup=dedup, skip_ids=skip)
    matrix, counts, _ = _reference(texts, key, constrained=constrained, dedup=dedup, skip=skip)
    np.testing.assert_array_equal(r.matrix, matrix)
    np.testing.assert_array_equal(r.row_counts, counts)
    assert r.scored_tokens == counts.sum()
    assert r.matrix.dtype == np.int64 and r.matrix.shape == (8, 2**d)
    expected = r.matrix.argmax(axis=1) if scheme == "mpac" else r.matrix.argmin(axis=1)
    np.testing.assert_array_equal(r.blocks, np.where(counts > 0, expected, -1))


def test_first_two_tokens_of_each_text_are_context_only(key: WatermarkKey) -> None:
    r = decode([10, 20, 30], key, dedup=False)
    assert r.scored_tokens == 1 and r.row_counts.sum() == 1
    assert r.row_counts[(10 + 20) % 8] == 1
    s = shard(key.words, np.array([10]), np.array([20]), np.array([30]), 2)[0]
    assert r.matrix.sum() == len(set(s.tolist()))
    assert set(np.nonzero(r.matrix[(10 + 20) % 8])[0].tolist()) == set(s.tolist())
    # two texts: both lose their first two tokens; no triple spans the boundary
    both = decode([[10, 20, 30], [40, 50, 60, 70]], key, dedup=False)
    assert both.scored_tokens == 3
    joined = decode([10, 20, 30, 40, 50, 60, 70], key, dedup=False)
    assert joined.scored_tokens == 5


def test_skip_ids_are_not_scored_but_stay_context(key: WatermarkKey) -> None:
    text = [5, 6, 0, 9, 1, 0, 13, 0, 2]  # id 0 plays an end-of-turn token
    r = decode(text, key, skip_ids=[0], per_token=True)
    assert r.scored_tokens == 4
    expected = [-1, -1, -1, (6 + 0) % 8, (0 + 9) % 8, -1, (1 + 0) % 8, -1, (13 + 0) % 8]
    assert r.token_blocks.tolist() == expected
    assert decode(text, key).scored_tokens == 7
    assert decode(text, key, skip_ids={0, 9, 13}).scored_tokens == 2


def test_repeated_triples_count_once_unless_dedup_is_off(key: WatermarkKey) -> None:
    text = [1, 2, 3] * 20  # 3 distinct triples, 58 scored positions
    once = decode(text, key)
    many = decode(text, key, dedup=False)
    assert once.scored_tokens == 3 and many.scored_tokens == 58
    # the same triple in two texts of one user also counts once
    assert decode([[4, 5, 6], [4, 5, 6]], key).scored_tokens == 1
    assert decode([[4, 5, 6], [4, 5, 6]], key, dedup=False).scored_tokens == 2
    # dedup keeps the first occurrence: per_token marks the later ones unscored
    r = decode([7, 8, 9, 7, 8, 9], key, per_token=True)
    assert r.token_blocks.tolist() == [-1, -1, (7 + 8) % 8, (8 + 9) % 8, (9 + 7) % 8, -1]


def test_texts_of_one_user_add_up(key: WatermarkKey) -> None:
    messages = random_messages(key.params, 1, seed=61)
    gen = generate(key, messages * 3, 60, seed=62)
    texts = list(gen.tokens)
    parts = [decode(t, key) for t in texts]
    whole = decode(texts, key)
    np.testing.assert_array_equal(whole.matrix, sum(p.matrix for p in parts))
    np.testing.assert_array_equal(whole.row_counts, sum(p.row_counts for p in parts))
    assert whole.scored_tokens == sum(p.scored_tokens for p in parts) == 180
    # more text of the same user decodes at least as well as any single text
    truth = messages[0].blocks
    assert (whole.blocks == truth).sum() >= max((p.blocks == truth).sum() for p in parts)
    assert whole.message == messages[0]


def test_empty_blocks_are_erased_not_zero(key: WatermarkKey) -> None:
    rng = np.random.default_rng(63)
    text = 2 * rng.integers(0, 20_000, 400)  # even ids: x[t-2] + x[t-1] is even, odd rows never occur
    r = decode(text, key)
    odd = np.arange(8) % 2 == 1
    assert (r.row_counts[odd] == 0).all() and (r.row_counts[~odd] > 0).all()
    assert r.erased.tolist() == odd.tolist()
    assert (r.blocks[odd] == -1).all() and (r.blocks[~odd] >= 0).all()
    assert (r.confidence[odd] == 0).all() and (r.confidence[~odd] > 0).all()
    assert r.message is None
    for i in range(8):
        chunk = r.bits[2 * i : 2 * i + 2]
        assert (chunk == "??") == bool(odd[i]) and ("?" in chunk) == bool(odd[i])
    # min_observations: rows seen fewer times are erased too
    short = decode(rng.integers(0, 20_000, 20), key, min_observations=3)
    assert (short.erased == (short.row_counts < 3)).all() and short.erased.any()


def test_ctmm_counts_each_shard_once_per_token_and_tmm_counts_every_key() -> None:
    rng = np.random.default_rng(64)
    text = rng.integers(0, 50_000, 3000)
    for k in (1, 2, 4):
        key = WatermarkKey.from_secret(SECRET, WatermarkParams(bits=16, num_keys=k))
        tmm = decode(text, key, constrained=False, per_token=True)
        ctmm = decode(text, key, constrained=True)
        n = tmm.scored_tokens
        assert tmm.matrix.sum() == k * n
        np.testing.assert_array_equal(tmm.row_counts, ctmm.row_counts)
        distinct = [len(set(s)) for s in tmm.token_shards[tmm.token_blocks >= 0].tolist()]
        assert ctmm.matrix.sum() == sum(distinct)
        assert (ctmm.matrix <= ctmm.row_counts[:, None]).all()  # at most one per shard per token
        assert (ctmm.matrix <= tmm.matrix).all()
        # expected distinct shards among k uniform draws from D = 4: D * (1 - (1 - 1/D)**k)
        mean_distinct = ctmm.matrix.sum() / n
        expected = 4 * (1 - 0.75**k)
        sd = np.sqrt(np.var(distinct) / n) if k > 1 else 0.0
        assert abs(mean_distinct - expected) <= 5 * sd + 1e-12
        if k == 1:
            np.testing.assert_array_equal(ctmm.matrix, tmm.matrix)


def test_per_token_output_aligns_with_the_input(key: WatermarkKey) -> None:
    texts = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 3, 4, 5]]
    r = decode(texts, key, per_token=True, skip_ids=[12])
    assert r.token_blocks.shape == (13,) and r.token_shards.shape == (13, 2)
    flat = np.concatenate([np.asarray(t) for t in texts])
    # two context tokens per text, the whole 2-token text, the skipped 12, the repeated triple (3, 4, 5)
    unscored = [0, 1, 5, 6, 7, 8, 9, 12]
    scored = [i for i in range(13) if i not in unscored]
    assert (r.token_blocks[unscored] == -1).all() and (r.token_shards[unscored] == -1).all()
    assert (r.token_blocks[scored] >= 0).all()
    for i in scored:
        assert r.token_blocks[i] == (flat[i - 2] + flat[i - 1]) % 8
        np.testing.assert_array_equal(
            r.token_shards[i], shard(key.words, flat[i - 2 : i - 1], flat[i - 1 : i], flat[i : i + 1], 2)[0]
        )
    assert r.scored_tokens == len(scored)
    plain = decode(texts, key, skip_ids=[12])
    assert plain.token_blocks is None and plain.token_shards is None
    np.testing.assert_array_equal(plain.matrix, r.matrix)


def test_accepted_input_forms_agree(key: WatermarkKey) -> None:
    rng = np.random.default_rng(65)
    text = rng.integers(0, 50_000, 100)
    reference = decode(text.tolist(), key).matrix
    for form in (text, text.astype(np.int32), text.astype(np.uint32), tuple(text.tolist()), [int(x) for x in text]):
        np.testing.assert_array_equal(decode(form, key).matrix, reference)
    two = rng.integers(0, 50_000, (2, 50))
    np.testing.assert_array_equal(decode(two, key).matrix, decode([two[0], two[1]], key).matrix)


@pytest.mark.parametrize("dedup", [True, False])
def test_ids_beyond_any_vocabulary_decode(key: WatermarkKey, dedup: bool) -> None:
    """Every id in [0, 2**31 - 1] is valid input, also with deduplication on (the default)."""
    big = np.array([2**31 - 1, 0, 2**31 - 2, 5, 2**31 - 1, 0, 2**31 - 2, 5, 1 << 21], dtype=np.int64)
    r = decode(big, key, dedup=dedup)
    assert r.scored_tokens == (5 if dedup else 7)  # (2**31-1, 0, 2**31-2) and (0, 2**31-2, 5) repeat once
    np.testing.assert_array_equal(r.matrix, _reference([big], key, dedup=dedup)[0])


@pytest.mark.parametrize(
    ("token_ids", "exc", "pattern"),
    [
        ([], ValueError, "at least one text of 3 or more tokens"),
        ([[]], ValueError, "at least one text of 3 or more tokens"),
        ([5, 6], ValueError, "at least one text of 3 or more tokens"),
        ([[5, 6], [7]], ValueError, "at least one text of 3 or more tokens"),
        (np.array([5, 6], dtype=np.int64), ValueError, "at least one text of 3 or more tokens"),
        ([1, 2, -3], ValueError, r"token ids must be in \[0, 2147483647\]"),
        (np.array([1, 2, -3]), ValueError, r"token ids must be in \[0, 2147483647\]"),
        (np.array([1, 2, -3], dtype=np.int32), ValueError, r"token ids must be in \[0, 2147483647\]"),
        ([1, 2, 2**31], ValueError, r"token ids must be in \[0, 2147483647\]"),
        (np.array([1, 2, 2**40], dtype=np.uint64), ValueError, r"token ids must be in"),
        ([[1, 2, 3], [4, -5, 6]], ValueError, r"token ids must be in"),
        (np.array([1.0, 2.0, 3.0]), TypeError, "token ids must be integers"),
        ([1, 2, 3.5], TypeError, "token ids must be integers"),
        ([True, False, True], TypeError, "token ids must be integers"),
        ("some suspect text", TypeError, "not text"),
        (b"some suspect text", TypeError, "not text"),
        (["some", "suspect", "text"], TypeError, "token ids must be integers"),
        ([[1, 2, 3], "abc"], (TypeError, ValueError), "token ids|not text"),
        ([[1, 2, 3], 4], (TypeError, ValueError), "token ids|text"),
        ([[[1, 2, 3]]], ValueError, "1-D"),
    ],
)
def test_bad_input_gets_a_clear_error(key: WatermarkKey, token_ids, exc, pattern: str) -> None:
    with pytest.raises(exc, match=pattern):
        decode(token_ids, key)


def test_bad_options(key: WatermarkKey) -> None:
    with pytest.raises(ValueError, match="min_observations"):
        decode([1, 2, 3], key, min_observations=0)
