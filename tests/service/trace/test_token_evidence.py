"""Per-token evidence of the trace report: the counting rule agrees with the encoder's boost list,
the likelihood rule follows the sign of the token's LLR, unscored tokens carry none."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from service.trace.analysis import candidate_blocks, token_evidence
from xmark_core import WatermarkKey, WatermarkParams, decode
from xmark_core.encoder import boost_mask
from xmark_core.hashing import token_codes

VOCAB = 400


def _key(scheme: str, num_keys: int) -> WatermarkKey:
    params = WatermarkParams(bits=16, block_bits=2, num_keys=num_keys, scheme=scheme)  # type: ignore[arg-type]
    return WatermarkKey.from_secret(f"evidence-test-{scheme}-{num_keys}", params)


def _boosted(key: WatermarkKey, ids: list[int], blocks: list[int]) -> np.ndarray:
    """bool per position >= 2: whether the encoder would have boosted that token for ``blocks``."""
    params = key.params
    words = torch.from_numpy(key.words.copy())
    codes = token_codes(words, torch.arange(VOCAB, dtype=torch.int64)).T.contiguous()  # [k, V]
    tokens = torch.tensor(ids, dtype=torch.int64)
    context = torch.stack([tokens[:-2], tokens[1:-1]], dim=1)  # [n - 2, 2]
    rows = torch.tensor(blocks, dtype=torch.int64).expand(context.shape[0], params.num_blocks)
    mask = boost_mask(context, rows, words, codes, params, VOCAB)
    return mask.gather(1, tokens[2:, None]).squeeze(1).numpy()


@pytest.mark.parametrize(("scheme", "num_keys"), [("xmark", 2), ("xmark", 3), ("loso", 1), ("mpac", 1)])
def test_counting_evidence_is_the_encoders_boost_list(scheme: str, num_keys: int) -> None:
    key = _key(scheme, num_keys)
    rng = np.random.default_rng(7)
    ids = rng.integers(0, VOCAB, size=600).tolist()
    ids[100:110] = ids[50:60]  # repeated context/token triples: left unscored by the decoder
    bits = "1001110001101011"
    blocks = candidate_blocks(bits, key.params.block_bits)
    assert blocks == [2, 1, 3, 0, 1, 2, 2, 3]
    result = decode(ids, key, per_token=True)
    evidence = token_evidence(result, blocks)
    assert len(evidence) == len(ids)
    assert evidence[0] is None and evidence[1] is None  # context only
    assert result.token_blocks is not None
    scored = result.token_blocks >= 0
    assert [e is not None for e in evidence] == scored.tolist()
    assert scored.sum() < len(ids) - 2  # the repeats were skipped
    boosted = _boosted(key, ids, blocks)
    for position in np.flatnonzero(scored):
        assert evidence[position] == ("supports" if boosted[position - 2] else "contradicts"), position
    # random text: both kinds occur, in about the share of the boost list
    supports = sum(e == "supports" for e in evidence)
    assert 0 < supports < int(scored.sum())


def test_text_drawn_from_the_boost_list_supports_its_message_only() -> None:
    key = _key("xmark", 2)
    bits, other = "0110001110110100", "1001110001001011"
    blocks = candidate_blocks(bits, 2)
    rng = np.random.default_rng(11)
    ids = [5, 9]
    words = torch.from_numpy(key.words.copy())
    codes = token_codes(words, torch.arange(VOCAB, dtype=torch.int64)).T.contiguous()
    rows = torch.tensor([blocks], dtype=torch.int64)
    for _ in range(300):  # every token sampled from the list the message boosts
        mask = boost_mask(torch.tensor([ids[-2:]]), rows, words, codes, key.params, VOCAB)[0]
        ids.append(int(rng.choice(np.flatnonzero(mask.numpy()))))
    result = decode(ids, key, per_token=True)
    own = token_evidence(result, blocks)
    assert own.count("contradicts") == 0 and own.count("supports") == result.scored_tokens
    foreign = token_evidence(result, candidate_blocks(other, 2))
    assert foreign.count("contradicts") > result.scored_tokens // 4


def test_likelihood_evidence_is_the_sign_of_the_llr() -> None:
    key = _key("xmark", 2)
    ids = list(range(10, 20))
    result = decode(ids, key, per_token=True)
    llr = np.array([np.nan, np.nan, 0.4, -0.2, 0.0, np.nan, 1e-9, -3.0, 2.0, -1e-9])
    assert token_evidence(result, [0] * 8, llr) == [
        None,
        None,
        "supports",
        "contradicts",
        None,
        None,
        "supports",
        "contradicts",
        "supports",
        "contradicts",
    ]


def test_no_candidate_means_no_evidence() -> None:
    key = _key("xmark", 2)
    result = decode(list(range(50)), key, per_token=True)
    assert token_evidence(result, None) == [None] * 50
