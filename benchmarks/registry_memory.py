"""What one length's registry snapshot costs a gateway process at a provider's scale of end users.

    python -m benchmarks.registry_memory [--accounts 10000] [--end-users 1000] [--bits 32 --block-bits 2]

``/trace`` scores a text against every registered ID of its key version's length, held in each
process as a ``RegistrySnapshot`` (``service.services.registry_cache``): the IDs packed for scoring
(``CandidateSet``) and, per holder, who it is (account id, name and status; the end user's id and
identifier). This builds that snapshot with the cache's own builder (``build_snapshot``) from
``--accounts`` × ``--end-users`` registry rows shaped as the registry reads them (random IDs, end
users' identifiers of 16 hex digits, as an HMAC-derived one would be about), without a database,
and prints one JSON object: the rows' memory as read, the build's seconds, and the process's
resident memory added by the snapshot (held, in all and per ID), and again once a trace restricted to
a content search's leads has built the holders' positions. A key version of another length holds a
snapshot of its own.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import time
from collections.abc import Iterator

import psutil

from service.repositories.registry import LOAD_SLICE, RegistryEntry
from service.services.registry_cache import SnapshotBuilder
from xmark_core import WatermarkParams

MIB = 2**20


def rows(accounts: int, end_users: int, bits: int, seed: int = 0) -> Iterator[list[RegistryEntry]]:
    """The registry's rows of one length in slices of ``LOAD_SLICE``, as the cache reads them: each
    account's end users, each with one random ID (drawn uniformly, as the allocation rule draws them
    past 10^5 registered)."""
    rng = random.Random(seed)
    piece: list[RegistryEntry] = []
    end_user_id = 0
    for account in range(1, accounts + 1):
        for _ in range(end_users):
            end_user_id += 1
            piece.append(
                RegistryEntry(
                    account,
                    # a string of its own per row, as the database driver returns each row's
                    f"platform-{account}",
                    "".join(("act", "ive")),
                    format(rng.getrandbits(bits), f"0{bits}b"),
                    end_user_id,
                    f"{rng.getrandbits(64):016x}",
                )
            )
            if len(piece) == LOAD_SLICE:
                yield piece
                piece = []
    if piece:
        yield piece


def measure(accounts: int, end_users: int, params: WatermarkParams) -> dict[str, object]:
    process = psutil.Process()
    gc.collect()
    base = process.memory_info().rss
    started = time.perf_counter()
    builder = SnapshotBuilder(params)
    for piece in rows(accounts, end_users, params.bits):
        builder.add(piece)
    snapshot = builder.finish()
    build_s = time.perf_counter() - started
    gc.collect()
    held = process.memory_info().rss - base
    ids = len(snapshot)
    # a trace restricted to a content search's leads first builds the holders' positions, held with the snapshot
    started = time.perf_counter()
    snapshot.restricted([int(snapshot.candidates.ids[0])])
    index_s = time.perf_counter() - started
    gc.collect()
    indexed = process.memory_info().rss - base
    return {
        "ids": ids,
        "accounts": accounts,
        "end_users_per_account": end_users,
        "bits": params.bits,
        "block_bits": params.block_bits,
        "build_s": round(build_s, 1),
        "held_mib": round(held / MIB),
        "held_bytes_per_id": round(held / ids),
        "restricted_index_s": round(index_s, 1),
        "held_with_index_mib": round(indexed / MIB),
        "held_with_index_bytes_per_id": round(indexed / ids),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accounts", type=int, default=10_000)
    parser.add_argument("--end-users", type=int, default=1_000, help="end users per account, one ID each")
    parser.add_argument("--bits", type=int, default=32)
    parser.add_argument("--block-bits", type=int, default=2)
    args = parser.parse_args()
    params = WatermarkParams(bits=args.bits, block_bits=args.block_bits)
    print(json.dumps(measure(args.accounts, args.end_users, params)))


if __name__ == "__main__":
    main()
