"""The keyed shard function, written once for numpy arrays and torch tensors on any device.

Every value is an int64 holding a number in [0, 2**32). The only operations are XOR, AND,
right shifts of non-negative numbers, and products of a value below 2**32 with a value below
2**31, which stay below 2**63: no overflow and no sign bit ever appear, so numpy, torch on the
CPU and torch on CUDA give bit-identical results.

shard_j(x[t-2], x[t-1], v) = top d bits of (a_j(x[t-2], x[t-1]) * c_j(v) mod 2**32), where
  a_j: a keyed mix of the *ordered* context, forced odd and below 2**31 (the context multiplier);
  c_j: a keyed mix of the token id, forced odd (the token code).
For a fixed context, v -> shard is a uniform keyed partition of any vocabulary; for a fixed
token, independent contexts give independent shards (a_j * c_j is uniform over odd numbers as
a_j is); the k keys use independent words, so their shards are independent. Decoding needs
O(k) operations per token; the encoder evaluates c_j once per vocabulary (cached) and one
multiply-shift per (row, token, key).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # for the annotations only: importing this module imports neither
    import numpy as np
    import numpy.typing as npt
    import torch

# int64 numpy arrays or torch tensors: each function is checked for both and returns what it is given
Array = TypeVar("Array", "npt.NDArray[np.int64]", "torch.Tensor")

MASK32 = 0xFFFFFFFF
MASK31 = 0x7FFFFFFF
MIX_MUL = 0x045D9F3B  # < 2**31: products with a 32-bit value stay below 2**63


def wrap32(values: torch.Tensor) -> torch.Tensor:
    """int32 with the same low 32 bits as int64 ``values`` (two's complement, no overflow)."""
    import torch

    return (((values + (1 << 31)) & MASK32) - (1 << 31)).to(torch.int32)


def mix32(x: Array) -> Array:
    """A 32-bit integer finaliser (xorshift-multiply, full avalanche). x: int64 in [0, 2**32)."""
    x = x ^ (x >> 16)  # a new array/tensor: the in-place steps below never touch the input
    x *= MIX_MUL
    x &= MASK32
    x ^= x >> 16
    x *= MIX_MUL
    x &= MASK32
    x ^= x >> 16
    return x


def context_multipliers(words: Array, prev2: Array, prev1: Array) -> Array:
    """Keyed, order-sensitive context multipliers.

    words: int64 [k, 5] key words; prev2, prev1: int64 [...] token ids (x[t-2], x[t-1]).
    Returns int64 [..., k], odd, in [1, 2**31).
    """
    p2 = (prev2 & MASK32)[..., None]  # [..., 1]
    p1 = (prev1 & MASK32)[..., None]
    h = mix32(words[:, 0] ^ p2)  # [..., k]
    h = mix32(h ^ words[:, 1] ^ p1) ^ words[:, 2]
    return (h & MASK31) | 1


def token_codes(words: Array, token: Array) -> Array:
    """Keyed token codes. words: int64 [k, 5]; token: int64 [...]. Returns int64 [..., k], odd."""
    t = (token & MASK32)[..., None]
    return (mix32(t ^ words[:, 3]) ^ words[:, 4]) | 1


def shard_of(multipliers: Array, codes: Array, block_bits: int) -> Array:
    """Shard index in [0, 2**d) from broadcastable context multipliers and token codes."""
    return ((multipliers * codes) & MASK32) >> (32 - block_bits)


def shard(words: Array, prev2: Array, prev1: Array, token: Array, block_bits: int) -> Array:
    """shard(keys, x[t-2], x[t-1], x[t]) -> int64 [..., k] in [0, 2**block_bits)."""
    return shard_of(context_multipliers(words, prev2, prev1), token_codes(words, token), block_bits)


def block_index(prev2: Array, prev1: Array, num_blocks: int) -> Array:
    """The paper's block index i = (x[t-2] + x[t-1]) mod r."""
    return (prev2 + prev1) % num_blocks
