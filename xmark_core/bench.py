"""Benchmarks of xmark_core: ``python -m xmark_core.bench --json``.

Every figure is measured in this run on this machine; speed-ups compare against the naive
implementations in ``xmark_core.naive`` measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import numpy as np

from .attribution import CandidateSet, attribute
from .decoder import decode
from .detect import Detection, detect
from .keys import WatermarkKey
from .params import WatermarkParams, default_block_bits, default_salts

VOCAB = 49_152
SECRET = "benchmark-secret-not-for-production"


def _best_time(fn: Callable[[], object], repeat: int, number: int = 1) -> float:
    """Best (minimum) over ``repeat`` runs of the mean time of ``number`` calls, in seconds.

    The minimum is the least disturbed estimate on a shared machine (as timeit recommends); the
    naive baselines are timed the same way, so the speed-ups compare like with like.
    """
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - start) / number)
    return float(min(times))


def _decode_and_detect(tokens: np.ndarray, key: WatermarkKey) -> Detection:
    return detect(decode(tokens, key))


def bench_decode(key: WatermarkKey, rng: np.random.Generator) -> dict[str, float]:
    out: dict[str, float] = {}
    rates = []
    for length in (150, 10_000):
        tokens = rng.integers(0, VOCAB, length)
        decode_tokens = partial(decode, tokens, key)
        _best_time(decode_tokens, repeat=1, number=200 if length < 1000 else 5)  # warm-up
        seconds = _best_time(decode_tokens, repeat=9, number=200 if length < 1000 else 5)
        rate = (length - 2) / seconds
        out[f"decode_tokens_per_s_T{length}"] = rate
        rates.append(rate)
        result = decode(tokens, key)
        detect(result)
        detect_seconds = _best_time(partial(_decode_and_detect, tokens, key), repeat=5, number=5)
        out[f"decode_detect_ms_T{length}"] = 1e3 * detect_seconds
    out["decode_tokens_per_s"] = min(rates)
    return out


def bench_naive_decode(key: WatermarkKey, rng: np.random.Generator, fast_rate: float) -> dict[str, float]:
    from .naive import naive_decode

    tokens = rng.integers(0, VOCAB, 102)
    keys = [int(w) for w in key.words[:, 0]]
    seconds = _best_time(lambda: naive_decode(tokens, keys, key.params, VOCAB), repeat=3)
    naive_rate = 100 / seconds
    return {"naive_decode_tokens_per_s": naive_rate, "decode_speedup_vs_naive": fast_rate / naive_rate}


def bench_encode(key: WatermarkKey) -> dict[str, float]:
    import torch

    from .encoder import TorchWatermarker
    from .naive import naive_encode

    params = key.params
    gen = torch.Generator().manual_seed(0)
    batch = 16
    logits = torch.randn(batch, VOCAB, generator=gen)
    context = torch.randint(0, VOCAB, (batch, 2), generator=gen)
    blocks = torch.randint(0, params.num_shards, (batch, params.num_blocks), generator=gen)
    active = torch.ones(batch, dtype=torch.bool)
    marker = TorchWatermarker(key)
    marker.apply(logits, context, blocks, active)
    fast = _best_time(lambda: marker.apply(logits, context, blocks, active, inplace=True), repeat=15, number=10)
    fast_copy = _best_time(lambda: marker.apply(logits, context, blocks, active), repeat=15, number=10)
    fused_marker = TorchWatermarker(key, compile=True)
    fused_marker.warm_up(logits.device, VOCAB, inference_mode=False)  # timed with gradients on
    fused = _best_time(lambda: fused_marker.apply(logits, context, blocks, active, inplace=True), repeat=15, number=10)
    wide_marker = TorchWatermarker(key, compile=True, narrow_on_cpu=False)  # the int64 kernel
    wide_marker.warm_up(logits.device, VOCAB, inference_mode=False)
    wide = _best_time(lambda: wide_marker.apply(logits, context, blocks, active, inplace=True), repeat=15, number=10)
    keys = [int(w) for w in key.words[:, 0]]
    naive = _best_time(lambda: naive_encode(logits, context, blocks, keys, params), repeat=3)
    return {
        # the CPU serving path (vLLM CPU workers): one fused pass, bit-identical to the eager op; for
        # float32 logits the C++ op (xmark_core.cpu_op) where it builds (encode_cpp_op_fused)
        "encode_ms_per_step": 1e3 * fused,
        "encode_fused_kernel": float(fused_marker.fused(logits.device)),
        "encode_cpp_op_fused": float(fused_marker.uses_cpp_op()),
        # what tests/core/test_encode_speed.py bounds (there on one thread): the fused step against the eager op
        "encode_speedup_vs_eager": fast / fused,
        "encode_ms_per_step_int64_kernel": 1e3 * wide,
        "encode_speedup_vs_int64_kernel": wide / fused,
        "encode_ms_per_step_eager": 1e3 * fast,
        "encode_ms_per_step_eager_out_of_place": 1e3 * fast_copy,
        "naive_encode_ms_per_step": 1e3 * naive,
        "encode_speedup_vs_naive": naive / fused,
        "encode_eager_speedup_vs_naive": naive / fast,
        "encode_threads": float(torch.get_num_threads()),
    }


def bench_sample(key: WatermarkKey) -> dict[str, float]:
    """The distortion-free scheme's step (``gumbel``: keyed sampling, one finite logit per row) on
    logits [16, 49152] at temperature 0.7, fused and eager, without and with a nucleus (top_p 0.9,
    truncated before the choice), against the sampler's own work on the same logits in the same run
    (softmax at the temperature and one multinomial draw per row; with top_p, the sort and cumulative
    sum of a nucleus sampler first). Each timing less the [B, V] copy its loop needs."""
    import torch

    from .encoder import TorchWatermarker
    from .gumbel import Truncation

    params = key.params
    gen = torch.Generator().manual_seed(0)
    batch = 16
    logits = torch.randn(batch, VOCAB, generator=gen) * 3
    context = torch.randint(0, VOCAB, (batch, 2), generator=gen)
    blocks = torch.randint(0, params.num_shards * params.salts, (batch, params.num_blocks), generator=gen)
    active = torch.ones(batch, dtype=torch.bool)
    tau = torch.full((batch,), 0.7)
    nucleus = Truncation(top_p=torch.full((batch,), 0.9))
    fused = TorchWatermarker(key, compile=True)
    fused.warm_up(logits.device, VOCAB, inference_mode=False)
    eager = TorchWatermarker(key)

    def step(marker: TorchWatermarker, truncation: Truncation | None) -> None:
        marker.apply(logits.clone(), context, blocks, active, inplace=True, temperature=tau, truncation=truncation)

    def own(top_p: float | None) -> None:
        scaled = logits.clone() / 0.7
        if top_p is not None:
            ordered, order = scaled.sort(dim=1)
            dropped = ordered.softmax(dim=1).cumsum(dim=1) <= 1.0 - top_p
            scaled.scatter_(1, order, ordered.masked_fill(dropped, float("-inf")))
        torch.multinomial(scaled.softmax(dim=1), 1, generator=gen)

    with torch.no_grad():
        step(fused, None)
        step(fused, nucleus)
        own(0.9)
        copy = _best_time(logits.clone, repeat=15, number=10)
        sample = _best_time(lambda: own(None), repeat=15, number=10) - copy
        sample_top_p = _best_time(lambda: own(0.9), repeat=15, number=10) - copy
        keyed = _best_time(lambda: step(fused, None), repeat=15, number=10) - copy
        keyed_top_p = _best_time(lambda: step(fused, nucleus), repeat=15, number=10) - copy
        keyed_eager = _best_time(lambda: step(eager, None), repeat=5, number=5) - copy
    return {
        "gumbel_sample_ms_per_step": 1e3 * keyed,
        "gumbel_sample_ms_per_step_top_p": 1e3 * keyed_top_p,
        "gumbel_sample_ms_per_step_eager": 1e3 * keyed_eager,
        "sampler_own_ms_per_step": 1e3 * sample,
        "sampler_own_ms_per_step_top_p": 1e3 * sample_top_p,
        "gumbel_vs_sampler_own": keyed / sample,
        "gumbel_top_p_vs_sampler_own_top_p": keyed_top_p / sample_top_p,
    }


def bench_encode_cold(key: WatermarkKey) -> dict[str, float]:
    """The CPU step as a vLLM CPU worker calls it: one thread (vLLM binds its worker to one core
    and keeps the other for the API server), each call right after a pass over 64 MiB that evicts
    the caches, as the model's forward pass does between two sampling steps. Mean of 100 calls,
    warm (back to back) and cold, at batch 1, 16 and 64, for the C++ op that serves float32 logits
    (``encode_1thread_*``), the same op under a key version with the entropy rule
    (``encode_rule_1thread_*``: the gate's two reductions over [B, V] added; every row open, the
    worst case) and the torch.compile'd kernel (``encode_compiled_1thread_*``); and the same for a
    compiled one-line op, the fixed cost of calling any compiled function (guards, the
    generated wrapper) with cold caches.
    """
    import torch

    from .encoder import TorchWatermarker

    params = key.params
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    evict = torch.zeros(64 * 2**20 // 4)

    def mean_ms(fn: Callable[[], object], *, cold: bool, calls: int = 100) -> float:
        total = 0.0
        for _ in range(calls):
            if cold:
                evict.add_(1.0)
            start = time.perf_counter()
            fn()
            total += time.perf_counter() - start
        return 1e3 * total / calls

    out: dict[str, float] = {}
    try:
        native = TorchWatermarker(key, compile=True)  # float32 on the C++ op (xmark_core.cpu_op)
        compiled = TorchWatermarker(key, compile=True, native_on_cpu=False)  # the torch.compile'd kernel
        ruled = TorchWatermarker(
            WatermarkKey.from_secret(SECRET, replace(params, min_entropy=0.69)), compile=True
        )  # the C++ op behind the entropy rule's gate
        gen = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            for marker in (native, compiled, ruled):
                marker.warm_up(torch.device("cpu"), VOCAB)
            out["encode_cpp_op"] = float(native.uses_cpp_op())
            for batch in (1, 16, 64):
                logits = torch.randn(batch, VOCAB, generator=gen)
                context = torch.randint(0, VOCAB, (batch, 2), generator=gen)
                blocks = torch.randint(0, params.num_shards, (batch, params.num_blocks), generator=gen)
                active = torch.ones(batch, dtype=torch.bool)
                for name, marker in (("", native), ("rule_", ruled), ("compiled_", compiled)):
                    step = partial(marker.apply, logits, context, blocks, active, inplace=True)
                    out[f"encode_{name}1thread_ms_batch{batch}_warm"] = mean_ms(step, cold=False)
                    out[f"encode_{name}1thread_ms_batch{batch}_cold"] = mean_ms(step, cold=True)
            one = torch.zeros(2, 8)
            add_one = torch.compile(lambda x: x.add_(1.0), dynamic=True)
            add_one(torch.zeros(1, 8))
            add_one(one)
            out["compiled_call_ms_warm"] = mean_ms(lambda: add_one(one), cold=False)
            out["compiled_call_ms_cold"] = mean_ms(lambda: add_one(one), cold=True)
            out["eager_call_ms_cold"] = mean_ms(lambda: one.add_(1.0), cold=True)
    finally:
        torch.set_num_threads(threads)
    return out


def bench_attribution(key: WatermarkKey, rng: np.random.Generator) -> dict[str, float]:
    params = key.params
    count = 1_000_000
    values = rng.choice(1 << params.bits, size=min(count, 1 << params.bits), replace=False)
    if values.size < count:  # b = 16 holds only 65,536 distinct IDs: draw with repetition for timing
        values = rng.integers(0, 1 << params.bits, count)
    bits = [format(int(v), f"0{params.bits}b") for v in values]
    candidates = CandidateSet(bits, list(range(count)), params)
    result = decode(rng.integers(0, VOCAB, 300), key)
    attribute(result, candidates)
    seconds = _best_time(lambda: attribute(result, candidates), repeat=7)
    return {"attribution_ms_1m": 1e3 * seconds, "attribution_candidates": float(count)}


def bench_fpr(key: WatermarkKey, rng: np.random.Generator, trials: int, length: int) -> dict[str, float]:
    p_values = np.array([detect(decode(rng.integers(0, VOCAB, length), key)).p_value for _ in range(trials)])
    return {
        "fpr_at_0.01": float((p_values < 0.01).mean()),
        "fpr_at_0.001": float((p_values < 0.001).mean()),
        "fpr_trials": float(trials),
        "fpr_tokens": float(length),
    }


def run(fpr_trials: int = 5000) -> dict[str, object]:
    params = WatermarkParams(bits=16, block_bits=2, num_keys=2, delta=2.0)
    key = WatermarkKey.from_secret(SECRET, params)
    rng = np.random.default_rng(0)
    import torch

    out: dict[str, object] = {"params": params.to_dict(), "machine": platform.machine(), "vocab": VOCAB}
    # the vector instructions the CPU kernels are built for (AVX2 and AVX-512 hosts differ several-fold)
    out["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    decode_stats = bench_decode(key, rng)
    out.update(decode_stats)
    out.update(bench_naive_decode(key, rng, decode_stats["decode_tokens_per_s"]))
    out.update(bench_encode(key))
    out.update(bench_encode_cold(WatermarkKey.from_secret(SECRET, WatermarkParams(bits=32, num_keys=4))))
    # the default scheme of new key versions (xmark_core.params.DEFAULT_SCHEME)
    gumbel = WatermarkParams(
        bits=32, block_bits=default_block_bits("gumbel"), num_keys=1, scheme="gumbel", salts=default_salts("gumbel")
    )
    out["gumbel_params"] = gumbel.to_dict()
    out.update(bench_sample(WatermarkKey.from_secret(SECRET, gumbel)))
    out.update(bench_attribution(key, rng))
    out.update(bench_fpr(key, rng, fpr_trials, 200))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--fpr-trials", type=int, default=5000)
    args = parser.parse_args(argv)
    result = run(args.fpr_trials)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        for name, value in sorted(result.items()):
            print(f"{name:36s} {value}")


if __name__ == "__main__":
    main()
