"""Messages (the b-bit IDs the watermark carries) and their allocation far apart in Hamming distance."""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from .params import WatermarkParams

ALLOCATION_CANDIDATES = 256
_ENUMERATE_BELOW_BITS = 22


class MessageSpaceExhausted(RuntimeError):
    """Every b-bit message has been allocated; no new ID can be issued."""


@dataclass(frozen=True, slots=True)
class Message:
    """A b-bit message; block i is bits[i*d:(i+1)*d] read most-significant bit first."""

    bits: str
    params: WatermarkParams

    def __post_init__(self) -> None:
        if not isinstance(self.bits, str):
            raise TypeError(f"message bits must be a str of '0'/'1' (got {type(self.bits).__name__})")
        if len(self.bits) != self.params.bits:
            raise ValueError(
                f"message must have exactly {self.params.bits} bits (got {len(self.bits)})"
            )
        if self.bits.strip("01"):
            raise ValueError("message must contain only the characters '0' and '1'")

    @classmethod
    def from_bits(cls, bits: str | Sequence[int], params: WatermarkParams) -> "Message":
        if not isinstance(bits, str):
            values = list(bits)
            if any(v not in (0, 1) or isinstance(v, bool) for v in values):
                raise ValueError("message bits must be 0 or 1")
            bits = "".join(str(v) for v in values)
        return cls(bits, params)

    @classmethod
    def from_int(cls, value: int, params: WatermarkParams) -> "Message":
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError("message value must be an int")
        if not 0 <= value < (1 << params.bits):
            raise ValueError(f"message value must be in [0, 2**{params.bits})")
        return cls(format(value, f"0{params.bits}b"), params)

    @classmethod
    def from_blocks(cls, blocks: Sequence[int] | np.ndarray, params: WatermarkParams) -> "Message":
        values = np.asarray(blocks)
        if values.shape != (params.num_blocks,):
            raise ValueError(f"expected {params.num_blocks} block values (got shape {values.shape})")
        if values.min(initial=0) < 0 or values.max(initial=0) >= params.num_shards:
            raise ValueError(f"block values must be in [0, {params.num_shards})")
        d = params.block_bits
        return cls("".join(format(int(v), f"0{d}b") for v in values), params)

    @property
    def blocks(self) -> np.ndarray:
        """int64 [r] block values."""
        return bits_to_blocks([self.bits], self.params)[0]

    def to_int(self) -> int:
        return int(self.bits, 2)


def bits_to_blocks(bits: Sequence[str], params: WatermarkParams) -> np.ndarray:
    """Many b-bit strings -> int64 [C, r] block values (vectorised)."""
    b, d = params.bits, params.block_bits
    if len(bits) == 0:
        return np.zeros((0, params.num_blocks), dtype=np.int64)
    raw = np.frombuffer("".join(bits).encode("ascii"), dtype=np.uint8)
    if raw.size != b * len(bits):
        raise ValueError(f"every message must have exactly {b} bits")
    digits = raw.reshape(len(bits), params.num_blocks, d).astype(np.int64) - ord("0")  # [C, r, d]
    if ((digits != 0) & (digits != 1)).any():
        raise ValueError("messages must contain only the characters '0' and '1'")
    weights = 1 << np.arange(d - 1, -1, -1, dtype=np.int64)  # [d]
    return digits @ weights


def _packed(bits: Sequence[str], b: int) -> np.ndarray:
    if not bits:
        return np.zeros((0, (b + 7) // 8), dtype=np.uint8)
    raw = np.frombuffer("".join(bits).encode("ascii"), dtype=np.uint8).reshape(len(bits), b)
    return np.packbits(raw == ord("1"), axis=1)


def allocate_message(
    existing_bits: Iterable[str],
    params: WatermarkParams,
    rng: random.Random | None = None,
    candidates: int = ALLOCATION_CANDIDATES,
) -> Message:
    """Pick a new message ID far from every ID ever allocated.

    Rule: draw ``candidates`` uniformly random IDs that are not yet allocated and keep the one
    whose minimum Hamming distance to all allocated IDs (deleted users' tombstones included) is
    largest (best-candidate sampling). While the space is sparse this keeps IDs about as far
    apart as random codes of that size can be; when it fills up it still never reuses an ID.
    """
    rng = rng or random.SystemRandom()
    b = params.bits
    taken = list(existing_bits)
    taken_set = set(taken)
    for bits in taken_set:
        Message(bits, params)  # validates length and alphabet
    space = 1 << b if b <= 62 else None
    if space is not None and len(taken_set) >= space:
        raise MessageSpaceExhausted(f"all 2**{b} message IDs are allocated")
    pool: list[str] = []
    if space is not None and b <= _ENUMERATE_BELOW_BITS and len(taken_set) > space // 2:
        free = np.setdiff1d(np.arange(space), [int(x, 2) for x in taken_set])
        picks = free if free.size <= candidates else np.array(rng.sample(list(free), candidates))
        pool = [format(int(v), f"0{b}b") for v in picks]
    else:
        attempts = 0
        while len(pool) < candidates and attempts < 50 * candidates:
            attempts += 1
            bits = format(rng.getrandbits(b), f"0{b}b")
            if bits not in taken_set:
                pool.append(bits)
        if not pool:
            raise MessageSpaceExhausted("could not find an unallocated message ID")
    if not taken:
        return Message(pool[0], params)
    taken_packed = _packed(taken, b)  # [T, bytes]
    pool_packed = _packed(pool, b)  # [P, bytes]
    best, best_dist = pool[0], -1
    chunk = max(1, 4_000_000 // max(1, taken_packed.shape[0] * taken_packed.shape[1]))
    for start in range(0, len(pool), chunk):
        block = pool_packed[start : start + chunk]
        xor = block[:, None, :] ^ taken_packed[None, :, :]  # [p, T, bytes]
        dist = np.bitwise_count(xor).sum(axis=2, dtype=np.int64).min(axis=1)  # [p]
        j = int(dist.argmax())
        if dist[j] > best_dist:
            best, best_dist = pool[start + j], int(dist[j])
    return Message(best, params)
