"""Simulated users (uniformly random messages), the registry of registered users, and the keys."""

from __future__ import annotations

import random

from xmark_core import CandidateSet, Message, WatermarkKey, WatermarkParams


def evaluation_secret(seed: int) -> str:
    """The watermark secret of an evaluation run (a fixed function of the seed, >= 16 bytes)."""
    return f"xmark-evaluation/secret/seed-{seed}"


def evaluation_key(params: WatermarkParams, seed: int) -> WatermarkKey:
    return WatermarkKey.from_secret(evaluation_secret(seed), params)


def null_keys(params: WatermarkParams, seed: int, count: int) -> list[WatermarkKey]:
    """Independent keys that never touched any text: more null samples from the same unwatermarked texts."""
    return [WatermarkKey.from_secret(f"{evaluation_secret(seed)}/null-{j}", params) for j in range(count)]


def user_messages(bits: int, users: int, seed: int) -> list[Message]:
    """Uniformly random, distinct b-bit messages of the simulated users (the same for every method)."""
    params = WatermarkParams(bits=bits, num_keys=1, scheme="loso")
    if users > (1 << bits):
        raise ValueError(f"cannot give {users} users distinct {bits}-bit messages")
    rng = random.Random(f"xmark-eval/{seed}/users/{bits}")
    seen: set[int] = set()
    out = []
    while len(out) < users:
        value = rng.getrandbits(bits)
        if value not in seen:
            seen.add(value)
            out.append(Message.from_int(value, params))
    return out


def registry(bits: int, users: int, size: int, seed: int, params: WatermarkParams) -> CandidateSet:
    """A registry of ``size`` distinct messages: the simulated users (ids 0..users-1) plus random others."""
    if size > (1 << bits):
        raise ValueError(f"a {bits}-bit registry holds at most {1 << bits} users")
    own = [m.to_int() for m in user_messages(bits, users, seed)]
    values = list(own)
    seen = set(own)
    rng = random.Random(f"xmark-eval/{seed}/registry/{bits}")
    while len(values) < size:
        value = rng.getrandbits(bits)
        if value not in seen:
            seen.add(value)
            values.append(value)
    return CandidateSet([format(v, f"0{bits}b") for v in values], list(range(len(values))), params)
