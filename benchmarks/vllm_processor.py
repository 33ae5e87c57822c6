"""The V1 logits processor's cost per engine step, as a vLLM CPU worker calls it, against the op alone.

A vLLM CPU worker runs the processor on one thread right after the model's forward pass, which
leaves the caches cold. For batches of ``--batch 1,16,64`` rows (every row watermarked, one key
version, SmolLM2's vocabulary) this times, one thread, each call right after a pass over 64 MiB
that evicts the caches:

* ``processor``: ``xmark_core.vllm_v1.XMarkLogitsProcessor.apply`` (the context of every row from
  its prompt and output lists, the placeholder check, the call into the op);
* ``generic``: the same processor on its generic path (the one GPU workers and other dtypes take:
  operand tensors built per step, ``TorchWatermarker.apply`` with its checks), which the CPU
  worker took before it called the bound op directly; the baseline, in the same run;
* ``op``: the C++ op alone on prepared operands (``TorchWatermarker.cpu_step``);

and the same back to back (warm). ``processor - op`` is the processor's own Python per step.

    python -m benchmarks.vllm_processor --json

Needs vLLM importable (``make venv-vllm``); no model files.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable

import numpy as np
import torch

SECRET = "vllm-processor-benchmark-secret-3f9a27c1"
VOCAB = 49152  # SmolLM2's vocabulary
MESSAGE_BITS = "01101100000110110110110000011011"  # 32 bits: the product's default b


def mean_us(fn: Callable[[], object], evict: torch.Tensor | None, calls: int) -> float:
    total = 0.0
    for _ in range(calls):
        if evict is not None:
            evict.add_(1.0)
        start = time.perf_counter()
        fn()
        total += time.perf_counter() - start
    return 1e6 * total / calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--batch", default="1,16,64", help="comma-separated batch sizes")
    parser.add_argument("--calls", type=int, default=300, help="timed calls per figure")
    args = parser.parse_args(argv)
    os.environ["XMARK_WATERMARK_SECRETS"] = f"bench:{SECRET}"
    os.environ.pop("XMARK_SECRETS_FILE", None)
    os.environ.pop("XMARK_PROCESSOR_PROFILE", None)

    from vllm.config import VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from xmark_core.vllm_common import worker_keyring
    from xmark_core.vllm_v1 import XMarkLogitsProcessor

    worker_keyring.cache_clear()
    torch.set_num_threads(1)
    evict = torch.zeros(64 * 2**20 // 4)
    rng = np.random.default_rng(0)
    results = []
    with torch.inference_mode():
        for batch in [int(b) for b in str(args.batch).split(",") if b.strip()]:
            config = VllmConfig()
            config.scheduler_config.max_num_seqs = batch
            processor = XMarkLogitsProcessor(config, torch.device("cpu"), False)
            xargs = {"xmark_message": MESSAGE_BITS, "xmark_key_version": "bench"}
            added = [
                (row, SamplingParams(max_tokens=8, extra_args=xargs), rng.integers(0, VOCAB, 30).tolist(),
                 rng.integers(0, VOCAB, 60).tolist())
                for row in range(batch)
            ]  # fmt: skip
            processor.update_state(BatchUpdate(batch_size=batch, removed=[], added=added, moved=[]))
            logits = torch.randn(batch, VOCAB)
            marker = processor._watermarkers[0]
            step = marker.cpu_step(VOCAB)
            if step is None:
                parser.error("the C++ op could not be built here (a C++ compiler and ninja on PATH)")
            context = torch.randint(0, VOCAB, (batch, 2))
            blocks = torch.from_numpy(processor._blocks[:batch].copy())
            active = torch.ones(batch, dtype=torch.bool)

            def run_processor(p: XMarkLogitsProcessor = processor, x: torch.Tensor = logits) -> object:
                return p.apply(x)

            generic = XMarkLogitsProcessor(config, torch.device("cpu"), False)
            generic.update_state(BatchUpdate(batch_size=batch, removed=[], added=added, moved=[]))
            generic._steps, generic._step_width = None, 2**31  # no bound op: the generic path

            def run_generic(p: XMarkLogitsProcessor = generic, x: torch.Tensor = logits) -> object:
                return p.apply(x)

            def run_op(
                s: Callable[..., None] = step,
                x: torch.Tensor = logits,
                c: torch.Tensor = context,
                b: torch.Tensor = blocks,
                a: torch.Tensor = active,
            ) -> object:
                s(x, c, b, a)
                return x

            for _ in range(20):
                run_processor()
                run_generic()
                run_op()
            entry: dict[str, float | int] = {"batch": batch}
            for name, fn in (("processor", run_processor), ("generic", run_generic), ("op", run_op)):
                entry[f"{name}_us_cold"] = round(mean_us(fn, evict, args.calls), 1)
                entry[f"{name}_us_warm"] = round(mean_us(fn, None, args.calls), 1)
            entry["processor_python_us_cold"] = round(float(entry["processor_us_cold"]) - float(entry["op_us_cold"]), 1)
            results.append(entry)
            if not args.json:
                print(entry, flush=True)
    report = {
        "benchmark": "vllm_processor",
        "vocab": VOCAB,
        "params": processor._watermarkers[0].params.to_dict(),
        "threads": 1,
        "calls": args.calls,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "results": results,
    }
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
