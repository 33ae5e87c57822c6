"""One entry point to the identity tests of every decoder: the p-value that a text carries another
candidate's message rather than the best candidate's."""

from __future__ import annotations

import numpy as np

from .attribution import CandidateSet, counting_identity_p, gumbel_identity_p
from .decoder import DecodeResult
from .gumbel_likelihood import GumbelLikelihoodResult, gumbel_likelihood_identity_p
from .likelihood import LikelihoodResult, identity_test


def identity_p(
    result: DecodeResult | LikelihoodResult | GumbelLikelihoodResult, candidates: CandidateSet, best: int
) -> float | None:
    """The largest, over the candidates other than ``best`` (an index into ``candidates``), of the
    p-value of "the text carries that candidate's message", by the identity test of the decoder
    that read ``result``: counting (``counting_identity_p``; None where it has none: k > 1 without a
    cTMM reading), likelihood (``identity_test``), and the ``gumbel`` scheme's two. 0.0 when
    ``best`` is the only candidate."""
    if isinstance(result, GumbelLikelihoodResult):
        return gumbel_likelihood_identity_p(result, candidates, best)
    if isinstance(result, LikelihoodResult):
        rivals = np.delete(candidates.blocks, best, axis=0)
        return identity_test(result, candidates.blocks[best].astype(np.int64), rivals)
    if result.params.distortion_free:
        return gumbel_identity_p(result, candidates, best)
    return counting_identity_p(result, candidates, best)
