"""Messages (the b-bit IDs the watermark carries) and their allocation far apart in Hamming distance."""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from .errors import ArgumentTypeError, MessageError
from .errors import MessageSpaceExhausted as MessageSpaceExhausted  # re-exported: its historic home
from .params import WatermarkParams

ALLOCATION_CANDIDATES = 256
_TABLE_BITS = 16


@dataclass(frozen=True, slots=True)
class Message:
    """A b-bit message; block i is bits[i*d:(i+1)*d] read most-significant bit first."""

    bits: str
    params: WatermarkParams

    def __post_init__(self) -> None:
        if not isinstance(self.bits, str):
            raise ArgumentTypeError(f"message bits must be a str of '0'/'1' (got {type(self.bits).__name__})")
        if len(self.bits) != self.params.bits:
            raise MessageError(f"message must have exactly {self.params.bits} bits (got {len(self.bits)})")
        if self.bits.strip("01"):
            raise MessageError("message must contain only the characters '0' and '1'")

    @classmethod
    def from_bits(cls, bits: str | Sequence[int], params: WatermarkParams) -> Message:
        if not isinstance(bits, str):
            values = list(bits)
            if any(v not in (0, 1) or isinstance(v, bool) for v in values):
                raise MessageError("message bits must be 0 or 1")
            bits = "".join(str(v) for v in values)
        return cls(bits, params)

    @classmethod
    def from_int(cls, value: int, params: WatermarkParams) -> Message:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ArgumentTypeError("message value must be an int")
        if not 0 <= value < (1 << params.bits):
            raise MessageError(f"message value must be in [0, 2**{params.bits})")
        return cls(format(value, f"0{params.bits}b"), params)

    @classmethod
    def from_blocks(cls, blocks: Sequence[int] | np.ndarray, params: WatermarkParams) -> Message:
        values = np.asarray(blocks)
        if values.dtype == bool or not np.issubdtype(values.dtype, np.integer):
            raise ArgumentTypeError(f"block values must be integers (got dtype {values.dtype})")
        if values.shape != (params.num_blocks,):
            raise MessageError(f"expected {params.num_blocks} block values (got shape {values.shape})")
        if values.min(initial=0) < 0 or values.max(initial=0) >= params.num_shards:
            raise MessageError(f"block values must be in [0, {params.num_shards})")
        d = params.block_bits
        return cls("".join(format(int(v), f"0{d}b") for v in values), params)

    @property
    def blocks(self) -> np.ndarray:
        """int64 [r] block values."""
        blocks: np.ndarray = bits_to_blocks([self.bits], self.params)[0]
        return blocks

    def to_int(self) -> int:
        return int(self.bits, 2)


def bits_to_blocks(bits: Sequence[str], params: WatermarkParams) -> np.ndarray:
    """Many b-bit strings -> int64 [C, r] block values (vectorised)."""
    b, d = params.bits, params.block_bits
    if len(bits) == 0:
        return np.zeros((0, params.num_blocks), dtype=np.int64)
    raw = np.frombuffer("".join(bits).encode("ascii"), dtype=np.uint8)
    if raw.size != b * len(bits):
        raise MessageError(f"every message must have exactly {b} bits")
    digits = raw.reshape(len(bits), params.num_blocks, d).astype(np.int64) - ord("0")  # [C, r, d]
    if ((digits != 0) & (digits != 1)).any():
        raise MessageError("messages must contain only the characters '0' and '1'")
    weights = 1 << np.arange(d - 1, -1, -1, dtype=np.int64)  # [d]
    return digits @ weights


def _packed(bits: Sequence[str], b: int) -> np.ndarray:
    """uint8 [C, ceil(b/8)] packed bits; validates length and alphabet."""
    if not bits:
        return np.zeros((0, (b + 7) // 8), dtype=np.uint8)
    raw = np.frombuffer("".join(bits).encode("ascii"), dtype=np.uint8)
    if raw.size != b * len(bits):
        raise MessageError(f"every message must have exactly {b} bits")
    raw = raw.reshape(len(bits), b)
    ones = raw == ord("1")
    if not (ones | (raw == ord("0"))).all():
        raise MessageError("messages must contain only the characters '0' and '1'")
    return np.packbits(ones, axis=1)


def _words(bits: Sequence[str], b: int) -> np.ndarray:
    """uint64 [C, ceil(b/64)]: the packed bits in 64-bit words (a Hamming distance is then one XOR
    and one popcount per word); validates length and alphabet."""
    packed = _packed(bits, b)  # [C, ceil(b/8)]
    width = -(-packed.shape[1] // 8) * 8
    padded = np.zeros((packed.shape[0], width), dtype=np.uint8)
    padded[:, : packed.shape[1]] = packed
    return padded.view(np.uint64)


def _distance_table(space: np.ndarray, taken: list[int], b: int) -> np.ndarray:
    """int16 [2**b]: Hamming distance of every point to the nearest taken ID (b + 1 if none), by
    multi-source breadth-first relaxation over the hypercube."""
    dist = np.full(space.size, b + 1, dtype=np.int16)
    if not taken:
        return dist
    dist[np.asarray(taken, dtype=np.int64)] = 0
    neighbours = [space ^ np.uint32(1 << j) for j in range(b)]
    for _ in range(b):
        relaxed = dist.copy()
        for flip in neighbours:
            np.minimum(relaxed, dist[flip] + 1, out=relaxed)
        if np.array_equal(relaxed, dist):
            break
        dist = relaxed
    return dist


class MessageAllocator:
    """Allocates message IDs far apart in Hamming distance, never reusing one.

    Rule: each new ID is the best of ``candidates`` uniformly random unallocated IDs, best meaning
    the largest minimum Hamming distance to every ID allocated so far (deleted users' tombstones
    included). For b <= 16 the allocator keeps the distance of every point of the space to the
    allocated set (updated in O(2**b) per allocation), so the candidates can be drawn among the
    farthest points; above that, random IDs are already far apart and candidates are scored
    against the allocated set directly.
    """

    def __init__(
        self,
        existing_bits: Iterable[str],
        params: WatermarkParams,
        rng: random.Random | None = None,
        candidates: int = ALLOCATION_CANDIDATES,
    ) -> None:
        self.params = params
        self._rng = rng or random.SystemRandom()
        self._candidates = candidates
        taken = list(dict.fromkeys(existing_bits))
        words = _words(taken, params.bits)  # validates every ID
        # allocated IDs in rows [0, _count) of a buffer that doubles when full
        self._words = np.zeros((max(16, 2 * words.shape[0]), words.shape[1]), dtype=np.uint64)
        self._words[: words.shape[0]] = words
        self._count = words.shape[0]
        self._taken = set(taken)
        b = params.bits
        self._dist: np.ndarray | None = None
        if b <= _TABLE_BITS:
            self._space = np.arange(1 << b, dtype=np.uint32)
            self._dist = _distance_table(self._space, [int(x, 2) for x in taken], b)

    def allocate(self) -> Message:
        b = self.params.bits
        if b <= 62 and len(self._taken) >= (1 << b):
            raise MessageSpaceExhausted(f"all 2**{b} message IDs are allocated")
        if self._dist is not None:
            value = self._pick_from_table()
            bits = format(value, f"0{b}b")
            self._dist = np.minimum(self._dist, np.bitwise_count(self._space ^ np.uint32(value)).astype(np.int16))
        else:
            bits = self._pick_by_sampling()
            if self._count == self._words.shape[0]:
                self._words = np.concatenate([self._words, np.zeros_like(self._words)])
            self._words[self._count] = _words([bits], b)[0]
            self._count += 1
        self._taken.add(bits)
        return Message(bits, self.params)

    def _pick_from_table(self) -> int:
        assert self._dist is not None
        dist = self._dist
        free = np.flatnonzero(dist > 0)  # distance 0 = already allocated
        if free.size == 0:
            raise MessageSpaceExhausted(f"all 2**{self.params.bits} message IDs are allocated")
        picks = [int(free[self._rng.randrange(free.size)]) for _ in range(min(self._candidates, free.size))]
        return max(picks, key=lambda v: dist[v])

    def _pick_by_sampling(self) -> str:
        b = self.params.bits
        pool: list[str] = []
        attempts = 0
        while len(pool) < self._candidates and attempts < 50 * self._candidates:
            attempts += 1
            bits = format(self._rng.getrandbits(b), f"0{b}b")
            if bits not in self._taken:
                pool.append(bits)
        if not pool:
            raise MessageSpaceExhausted("could not find an unallocated message ID")
        if not self._taken:
            return pool[0]
        pool_words = _words(pool, b)  # [P, w]
        taken = self._words[: self._count]  # [n, w]
        best, best_dist = pool[0], -1
        chunk = max(1, 4_000_000 // max(1, taken.size))
        for start in range(0, len(pool), chunk):
            block = pool_words[start : start + chunk]  # [p, w]
            apart = np.bitwise_count(block[:, None, :] ^ taken[None, :, :])  # [p, n, w] uint8
            dist = (apart[:, :, 0] if apart.shape[2] == 1 else apart.sum(axis=2, dtype=np.int64)).min(axis=1)
            j = int(dist.argmax())
            if dist[j] > best_dist:
                best, best_dist = pool[start + j], int(dist[j])
        return best


def allocate_message(
    existing_bits: Iterable[str],
    params: WatermarkParams,
    rng: random.Random | None = None,
    candidates: int = ALLOCATION_CANDIDATES,
) -> Message:
    """One new message ID far from every ID ever allocated (see :class:`MessageAllocator`)."""
    return MessageAllocator(existing_bits, params, rng, candidates).allocate()
