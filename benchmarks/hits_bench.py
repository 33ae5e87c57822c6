"""What scoring every registered ID against a text's counts costs: ``CandidateSet.hits``.

    python -m benchmarks.hits_bench [--ids 10000000] [--bits 64] [--block-bits 2] [--repeats 7]

A trace of a biasing (counting) reading scores each candidate m of the key version's length,
H_m = sum_i A[i, m_i]; at 10^7 registered IDs that sum is most of a reading's time. This builds a
``CandidateSet`` of ``--ids`` random IDs, one counting matrix of a 150-token text's size, and times,
in the same process and alternating, the pairs' way (two blocks a lookup, summed in 64 bits: the way
every count was summed before four blocks a lookup, and still the way of float64 block scores) and
``hits`` as a trace calls it. It checks that both give the same sums and prints one JSON object:
each way's median and the ratio with a bootstrap 95 % interval over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

from xmark_core import WatermarkParams
from xmark_core.attribution import CandidateSet


def _timed(score: object, matrix: np.ndarray) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    out = score(matrix)  # type: ignore[operator]
    return (time.perf_counter() - start) * 1000, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ids", type=int, default=10_000_000)
    parser.add_argument("--bits", type=int, default=64)
    parser.add_argument("--block-bits", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    params = WatermarkParams(bits=args.bits, block_bits=args.block_bits)
    rng = np.random.default_rng(args.seed)
    blocks = rng.integers(0, params.num_shards, size=(args.ids, params.num_blocks), dtype=np.uint8)
    candidates = CandidateSet.from_blocks(blocks, range(args.ids), params)
    del blocks
    # a 150-token reading's counts: each token's trial lands in one block's row
    matrix = np.zeros((params.num_blocks, params.num_shards), dtype=np.int64)
    np.add.at(matrix, (rng.integers(0, params.num_blocks, 150), rng.integers(0, params.num_shards, 150)), 1)
    ways = {"pairs_int64_ms": candidates._pair_hits, "hits_ms": candidates.hits}
    for score in ways.values():  # warm: pages touched, tables built once
        score(matrix)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        outs = []
        for name, score in ways.items():
            ms, out = _timed(score, matrix)
            times[name].append(ms)
            outs.append(out)
        if not np.array_equal(outs[0], outs[1]):
            raise SystemExit("the two ways' sums differ")
    base, new = np.array(times["pairs_int64_ms"]), np.array(times["hits_ms"])
    ratios = base / new
    boot = rng.choice(ratios, size=(2000, ratios.size)).mean(axis=1)
    result = {
        "benchmark": "hits",
        "config": {"ids": args.ids, "bits": args.bits, "block_bits": args.block_bits, "repeats": args.repeats},
        "pairs_int64_ms_median": round(float(np.median(base)), 1),
        "hits_ms_median": round(float(np.median(new)), 1),
        "hits_dtype": str(candidates.hits(matrix).dtype),
        "speedup_mean": round(float(ratios.mean()), 2),
        "speedup_ci95": [round(float(np.percentile(boot, 2.5)), 2), round(float(np.percentile(boot, 97.5)), 2)],
        "same_sums": True,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "numpy": np.__version__},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
