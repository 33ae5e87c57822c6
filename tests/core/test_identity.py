"""``xmark_core.identity_p``: one entry point to the four decoders' identity tests (counting and
likelihood, biasing and distortion-free schemes), each the same as the decoder's own test."""

from __future__ import annotations

import numpy as np
import pytest

from xmark_core import CandidateSet, WatermarkKey, WatermarkParams, decode, identity_p, score_gumbel_text, score_text
from xmark_core.attribution import counting_identity_p, gumbel_identity_p
from xmark_core.gumbel_likelihood import gumbel_likelihood_identity_p
from xmark_core.likelihood import identity_test

from .synthetic import SECRET, generate, random_messages
from .test_likelihood import scores_of


@pytest.mark.parametrize("scheme", ["xmark", "gumbel"])
def test_identity_p_is_the_decoder_s_own_identity_test(scheme: str) -> None:
    params = WatermarkParams(bits=32, block_bits=2, num_keys=2 if scheme == "xmark" else 1, scheme=scheme)  # type: ignore[arg-type]
    key = WatermarkKey.from_secret(SECRET, params)
    messages = random_messages(params, 40, seed=3)
    candidates = CandidateSet([m.bits for m in messages], list(range(len(messages))), params)
    generation = generate(key, [messages[5]] * 2, 120, top_k=20, seed=2, temperature=1.0)
    for row in range(2):
        ids = [int(t) for t in generation.tokens[row]]
        counted = decode(ids, key)
        own = gumbel_identity_p if params.distortion_free else counting_identity_p
        for best in (5, 11):  # the author, and another candidate as the best
            assert identity_p(counted, candidates, best) == own(counted, candidates, best)
        scores = scores_of(generation, row)
        if params.distortion_free:
            scored = score_gumbel_text(ids, scores, key, temperature=1.0)
            assert identity_p(scored, candidates, 5) == gumbel_likelihood_identity_p(scored, candidates, 5)
        else:
            likely = score_text(ids, scores, key, temperature=1.0)
            rivals = np.delete(candidates.blocks, 5, axis=0)
            expected = identity_test(likely, candidates.blocks[5].astype(np.int64), rivals)
            assert identity_p(likely, candidates, 5) == expected
        # the author's message cannot be ruled out where another candidate is taken for the best
        p_author = identity_p(counted, candidates, 11)
        assert p_author is not None and p_author > 0.01
    lone = candidates.subset([5])
    assert identity_p(decode([int(t) for t in generation.tokens[0]], key), lone, 0) == 0.0
