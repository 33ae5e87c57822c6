"""The local backend's generation throughput with the watermark off and on three ops (eager, the
compiled kernel, the C++ op), in one run, with bootstrap intervals on the ratios.

The local backend generates with transformers' ``generate`` and ``xmark_core.hf.XMarkLogitsProcessor``.
This benchmark loads the same checkpoint the same way (float32, CPU) and, for each batch size
(``--batch 1,8``), runs ``--rounds`` rounds; each round generates ``--max-tokens`` tokens per row
(EOS ignored) four times, once per mode, the order rotating from round to round:

* ``off``: no watermark processor;
* ``eager``: the processor with the eager op (several passes over the [B, V] logits);
* ``fused``: the processor with the op compiled by ``torch.compile`` into one pass (compiled
  before the first round);
* ``cpp``: the processor with the C++ op (``xmark_core.cpu_op``, one pass, no compilation at
  start-up): what the local backend runs.

Reported per batch size: tokens/s per mode, each watermarked mode's ratio to ``off`` and a 95 %
interval on it (``scipy.stats.bootstrap`` over the rounds, paired, BCa), and the op's own time
per step (the processor timed inside generate).

    python -m benchmarks.local_overhead --json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy import stats
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from benchmarks.launch import MODEL_NAME
from xmark_core import Message, WatermarkKey, WatermarkParams
from xmark_core.encoder import TorchWatermarker
from xmark_core.hf import XMarkLogitsProcessor

DEFAULT_MODEL_PATH = Path(__file__).resolve().parent.parent / "var" / "models" / MODEL_NAME
MODES = ("off", "eager", "fused", "cpp")
WATERMARKED = MODES[1:]
SECRET = b"local-overhead-benchmark-secret-0123456789"


class Timed(LogitsProcessor):
    """Wraps a processor and adds up the seconds it takes per call."""

    def __init__(self, inner: LogitsProcessor) -> None:
        self.inner = inner
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        start = time.perf_counter()
        out = self.inner(input_ids, scores)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out  # type: ignore[no-any-return]


def run_generate(
    model: Any,
    tokenizer: Any,
    encoded: Any,
    key: WatermarkKey,
    messages: list[Message],
    watermarker: TorchWatermarker | None,
    tokens: int,
    seed: int,
) -> tuple[float, float, int]:
    """One ``generate`` of exactly ``tokens`` tokens per row; its seconds, and the processor's
    seconds and calls (zero without a watermarker)."""
    processors = LogitsProcessorList()
    timed = None
    if watermarker is not None:
        timed = Timed(XMarkLogitsProcessor(key, messages, watermarker=watermarker))
        processors.append(timed)
    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            **encoded,
            logits_processor=processors,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            pad_token_id=tokenizer.pad_token_id,
        )
    seconds = time.perf_counter() - start
    assert out.shape[1] - encoded["input_ids"].shape[1] == tokens
    return seconds, (timed.seconds if timed else 0.0), (timed.calls if timed else 0)


def ratio_of_sums(off_s: Any, on_s: Any, axis: int = -1) -> Any:
    """Throughput with the watermark / without it, from the rounds' seconds (same tokens in both)."""
    return np.sum(off_s, axis=axis) / np.sum(on_s, axis=axis)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--model-path", type=Path, default=Path(os.environ.get("XMARK_MODEL_PATH", DEFAULT_MODEL_PATH)))
    parser.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--resamples", type=int, default=10_000)
    args = parser.parse_args(argv)
    if not (args.model_path / "config.json").is_file():
        parser.error(f"no model checkpoint at {args.model_path} (run `make model`)")

    tokenizer = AutoTokenizer.from_pretrained(args.model_path, local_files_only=True, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.model_path, local_files_only=True, dtype=torch.float32)
    model.eval()
    params = WatermarkParams(bits=32, block_bits=2, num_keys=4, delta=2.0)
    key = WatermarkKey.from_secret(SECRET, params)
    eager = TorchWatermarker(key)
    fused = TorchWatermarker(key, compile=True, native_on_cpu=False)
    fused.warm_up(torch.device("cpu"), model.config.vocab_size)  # generate runs under inference mode here
    native = TorchWatermarker(key, native_on_cpu=True)  # as service.backends.local builds it
    if not native.uses_cpp_op():
        parser.error("the C++ op could not be built here (a C++ compiler and ninja on PATH)")
    rng = np.random.default_rng(0)

    results = []
    for batch in [int(b) for b in str(args.batch).split(",") if b.strip()]:
        prompts = [f"Write a long story about traveller number {i}." for i in range(batch)]
        encoded = tokenizer.apply_chat_template(
            [[{"role": "user", "content": p}] for p in prompts],
            add_generation_prompt=True,
            padding=True,
            return_tensors="pt",
            return_dict=True,
        )
        messages = [Message.from_int(int(rng.integers(2**32)), params) for _ in range(batch)]

        ops = {"off": None, "eager": eager, "fused": fused, "cpp": native}
        for mode in MODES:  # warm-up
            run_generate(model, tokenizer, encoded, key, messages, ops[mode], 4, 0)
        seconds: dict[str, list[float]] = {m: [] for m in MODES}
        op_s = dict.fromkeys(MODES, 0.0)
        op_calls = dict.fromkeys(MODES, 0)
        for r in range(args.rounds):
            order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
            for mode in order:
                s, op, calls = run_generate(
                    model, tokenizer, encoded, key, messages, ops[mode], args.max_tokens, 1000 + r
                )
                seconds[mode].append(s)
                op_s[mode] += op
                op_calls[mode] += calls
        tokens = batch * args.max_tokens * args.rounds
        off = np.array(seconds["off"])
        entry: dict[str, Any] = {"batch": batch}
        for mode in MODES:
            entry[f"tokens_per_s_{mode}"] = round(tokens / sum(seconds[mode]), 2)
        for mode in WATERMARKED:
            on = np.array(seconds[mode])
            interval = stats.bootstrap(
                (off, on),
                ratio_of_sums,
                paired=True,
                vectorized=True,
                n_resamples=args.resamples,
                method="BCa",
                random_state=np.random.default_rng(1),
            ).confidence_interval
            entry[f"ratio_{mode}"] = round(float(ratio_of_sums(off, on)), 4)
            entry[f"ratio_{mode}_ci95"] = [round(float(interval.low), 4), round(float(interval.high), 4)]
            entry[f"op_us_per_step_{mode}"] = round(1e6 * op_s[mode] / max(op_calls[mode], 1), 1)
        results.append(entry)
        if not args.json:
            print(entry, flush=True)
    report = {
        "benchmark": "local_overhead",
        "engine": "transformers generate, float32, CPU",
        "model": MODEL_NAME,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "torch_threads": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "results": results,
    }
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
