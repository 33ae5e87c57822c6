"""Straightforward reference implementations, as in the paper's code, used as benchmark baselines.

They build a seeded permutation of the whole vocabulary per token and key (``torch.randperm``)
and partition it into equal shards; the encoder intersects the green lists as Python sets per row.
They are slow by construction (O(V) per token) and exist only to measure the speed-up of the real
implementation; their partitions are not the product's.
"""

from __future__ import annotations

import numpy as np
import torch

from .params import WatermarkParams


def _perm(seed: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(vocab, generator=gen)


def _seed(key: int, prev2: int, prev1: int) -> int:
    return (key * 1_000_003 + prev2 * 7_919 + prev1) % (2**63 - 1)


def naive_decode(tokens: np.ndarray, keys: list[int], params: WatermarkParams, vocab: int) -> np.ndarray:
    """cTMM by building k vocabulary permutations per token. Returns int64 [r, D]."""
    r, shards = params.num_blocks, params.num_shards
    size = vocab // shards
    matrix = np.zeros((r, shards), dtype=np.int64)
    for t in range(2, len(tokens)):
        prev2, prev1, tok = int(tokens[t - 2]), int(tokens[t - 1]), int(tokens[t])
        row = (prev2 + prev1) % r
        hit = np.zeros(shards, dtype=bool)
        for key in keys:
            perm = _perm(_seed(key, prev2, prev1), vocab)
            position = int((perm == tok).nonzero()[0, 0])
            hit[min(position // size, shards - 1)] = True
        matrix[row] += hit
    return matrix


def naive_encode(
    logits: torch.Tensor, context: torch.Tensor, blocks: torch.Tensor, keys: list[int], params: WatermarkParams
) -> torch.Tensor:
    """Per row: k permutations, leave-one-shard-out green lists as sets, their intersection boosted."""
    out = logits.clone()
    batch, vocab = logits.shape
    r, shards = params.num_blocks, params.num_shards
    size = vocab // shards
    for row in range(batch):
        prev2, prev1 = int(context[row, 0]), int(context[row, 1])
        value = int(blocks[row, (prev2 + prev1) % r])
        evergreen: set[int] | None = None
        for key in keys:
            perm = _perm(_seed(key, prev2, prev1), vocab).tolist()
            green = set(perm[: value * size]) | set(perm[(value + 1) * size :])
            evergreen = green if evergreen is None else evergreen & green
        assert evergreen is not None
        out[row, list(evergreen)] += params.delta
    return out
