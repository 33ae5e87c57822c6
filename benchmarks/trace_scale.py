"""What a trace's analysis costs among 10^7 registered IDs, against the per-candidate baseline.

    python -m benchmarks.trace_scale [--count 10000000] [--bits 32,64]

For each message length, a registry of ``--count`` distinct random IDs under the default key
version's distortion-free encoder (8-bit blocks) and one 300-token text read by the counting
decoder (random tokens: the costs do not depend on what the text carries). Timed, best of
``--repeat``:

* the identity test (``gumbel_identity_p``) as the gateway runs it (once per pattern of differing
  blocks) and as it ran before (every candidate's tail, in slices of 65,536), with their values;
* the ranking of the top 5 candidates (``top_indices``) and a full ``argpartition``;
* the whole ``attribute`` call on that text (unwatermarked: nobody is named, so it runs no identity
  test; a named text adds the identity test's time).

Prints one JSON object (ratios against the baselines measured in the same run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable

import numpy as np

from xmark_core import CandidateSet, WatermarkKey, WatermarkParams, attribute, decode
from xmark_core.attribution import gumbel_identity_p, top_indices
from xmark_core.gumbel import gamma_log_sf_each
from xmark_core.params import default_block_bits, default_salts

VOCAB = 49_152


def per_candidate_identity_p(result: object, candidates: CandidateSet, best: int) -> float:
    """The identity test as it ran before patterns: every candidate's exact tail."""
    matrix = result.matrix  # type: ignore[attr-defined]
    values = candidates.blocks[best].astype(np.int64)
    own = matrix[np.arange(matrix.shape[0]), values]
    worst = 0.0
    for first in range(0, len(candidates), 65_536):
        differs = candidates.blocks[first : first + 65_536] != candidates.blocks[best][None, :]
        tokens = differs @ result.row_counts  # type: ignore[attr-defined]
        score = differs @ own
        others = differs.any(axis=1)
        if others.any():
            worst = max(worst, float(np.exp(gamma_log_sf_each(score[others], tokens[others])).max()))
    return worst


def best_of(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def measure(bits: int, count: int, repeat: int) -> dict[str, object]:
    params = WatermarkParams(
        bits=bits, block_bits=default_block_bits("gumbel"), num_keys=1, scheme="gumbel", salts=default_salts("gumbel")
    )
    key = WatermarkKey.from_secret("trace-scale-benchmark-secret", params)
    rng = np.random.default_rng(bits)
    blocks = rng.integers(0, params.num_shards, size=(count, params.num_blocks), dtype=np.uint8)
    candidates = CandidateSet.from_blocks(blocks, list(range(count)), params)
    result = decode(rng.integers(0, VOCAB, 300), key)
    totals = candidates.hits(result.matrix)
    new_p = gumbel_identity_p(result, candidates, 0)
    old_p = per_candidate_identity_p(result, candidates, 0)
    identity_s = best_of(lambda: gumbel_identity_p(result, candidates, 0), repeat)
    baseline_s = best_of(lambda: per_candidate_identity_p(result, candidates, 0), 1)
    top_s = best_of(lambda: top_indices(totals, 5), repeat)
    partition_s = best_of(lambda: np.argpartition(-totals, 4)[:5], repeat)
    attribute_s = best_of(lambda: attribute(result, candidates), repeat)
    return {
        "bits": bits,
        "blocks": params.num_blocks,
        "registry": count,
        "identity_ms": round(1e3 * identity_s, 1),
        "identity_per_candidate_ms": round(1e3 * baseline_s, 1),
        "identity_speedup": round(baseline_s / identity_s, 1),
        "identity_p": new_p,
        "identity_p_per_candidate": old_p,
        "top5_ms": round(1e3 * top_s, 1),
        "argpartition_ms": round(1e3 * partition_s, 1),
        "attribute_ms": round(1e3 * attribute_s, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trace_scale", description=__doc__)
    parser.add_argument("--count", type=int, default=10_000_000)
    parser.add_argument("--bits", default="32,64")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    rows = [measure(int(b), args.count, args.repeat) for b in args.bits.split(",")]
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    print(json.dumps({"command": "python -m benchmarks.trace_scale", "machine": machine, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
