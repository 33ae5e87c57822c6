"""The watermark encoder on a CUDA GPU: cost per decoding step against the sampler's own work.

    python -m benchmarks.encode_gpu --json

Needs a CUDA device (it exits with a message otherwise); torch and transformers only, no model
files: the end-to-end part builds a randomly initialised model of SmolLM2-135M's shape, whose
speed does not depend on its weights. Everything is measured in this run, on this GPU:

1. Bit-identity: for each vocabulary width and logits dtype, the eager op and the fused
   (``torch.compile``) op on the GPU return exactly what the eager op returns on the CPU.
2. The op per step (CUDA events, median of repeats): the eager op (about ten passes over
   [B, V]) and the fused op (one generated kernel), in place, for a grid of batch sizes and
   vocabulary widths, each beside the work every sampling step does anyway on the same logits
   (softmax and an exponential-race draw, as vLLM's sampler does), as a ratio.
3. The entropy rule and the distortion-free scheme (``bench_rules``): the rule's fused op against
   the default key's, and the ``gumbel`` sampling op against the sampler's own work, per step;
   and whether the ``gumbel`` op chooses the same tokens on the GPU as on the CPU.
4. End to end: ``model.generate`` with sampling, with and without the XMark logits processor
   (transformers adapter, eager op), in alternating rounds (ABBA); median tokens per second for
   each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from xmark_core.encoder import TorchWatermarker
from xmark_core.keys import WatermarkKey
from xmark_core.message import Message
from xmark_core.params import WatermarkParams

SECRET = "benchmark-secret-not-for-production"
PARAMS = WatermarkParams(bits=16, block_bits=2, num_keys=2, delta=2.0)
# SmolLM2 (49,152), Llama 3 (128,256), Qwen 2.5 (151,936)
VOCABS = (49_152, 128_256, 151_936)
BATCHES = (1, 8, 32, 128, 256)


def _inputs(batch: int, vocab: int, dtype: torch.dtype, device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen).to(dtype)
    context = torch.randint(0, vocab, (batch, 2), generator=gen)
    blocks = torch.randint(0, PARAMS.num_shards, (batch, PARAMS.num_blocks), generator=gen)
    active = torch.ones(batch, dtype=torch.bool)
    active[::4] = False  # a mixed batch: some rows unwatermarked
    return tuple(t.to(device) for t in (logits, context, blocks, active))


def _cuda_ms(fn: Callable[[], object], number: int, repeat: int = 7) -> float:
    """Median over ``repeat`` runs of the mean GPU time of ``number`` back-to-back calls (ms)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(number):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / number)
    return float(statistics.median(times))


def _sample(logits: torch.Tensor) -> torch.Tensor:
    """What a sampling step does with the logits anyway: softmax, then an exponential race."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    return probs.div_(torch.empty_like(probs).exponential_()).argmax(dim=-1)


def check_identity(key: WatermarkKey, device: torch.device) -> dict[str, bool]:
    eager, fused = TorchWatermarker(key), TorchWatermarker(key, compile=True)
    out: dict[str, bool] = {}
    for vocab in VOCABS:
        for dtype in (torch.float32, torch.bfloat16):
            cpu_args = _inputs(33, vocab, dtype, torch.device("cpu"), seed=vocab)
            reference = eager.apply(*cpu_args)
            gpu_args = _inputs(33, vocab, dtype, device, seed=vocab)
            name = f"V{vocab}_{str(dtype).removeprefix('torch.')}"
            out[f"eager_{name}"] = torch.equal(eager.apply(*gpu_args).cpu(), reference)
            out[f"fused_{name}"] = torch.equal(fused.apply(*gpu_args).cpu(), reference)
    return out


def bench_op(key: WatermarkKey, device: torch.device) -> list[dict[str, Any]]:
    eager, fused = TorchWatermarker(key), TorchWatermarker(key, compile=True)
    rows = []
    for vocab in VOCABS:
        fused.warm_up(device, vocab)
        for batch in BATCHES:
            logits, context, blocks, active = _inputs(batch, vocab, torch.float32, device, seed=batch)
            number = 50
            # each timed call is bound to this iteration's tensors
            sample_ms = _cuda_ms(partial(_sample, logits), number)
            eager_ms = _cuda_ms(partial(eager.apply, logits, context, blocks, active, inplace=True), number)
            fused_ms = _cuda_ms(partial(fused.apply, logits, context, blocks, active, inplace=True), number)
            rows.append(
                {
                    "vocab": vocab,
                    "batch": batch,
                    "sample_ms": round(sample_ms, 4),
                    "eager_ms": round(eager_ms, 4),
                    "fused_ms": round(fused_ms, 4),
                    "eager_vs_sample": round(eager_ms / sample_ms, 3),
                    "fused_vs_sample": round(fused_ms / sample_ms, 3),
                    "fused_speedup_vs_eager": round(eager_ms / fused_ms, 2),
                }
            )
    return rows


RULE_PARAMS = WatermarkParams(bits=32, block_bits=2, num_keys=4, delta=2.5, min_entropy=0.69)
GUMBEL_PARAMS = WatermarkParams(bits=32, block_bits=2, num_keys=1, scheme="gumbel")
RULE_BATCHES = (1, 32, 128, 256)
RULE_VOCABS = (49_152, 151_936)


def _rule_inputs(params: WatermarkParams, batch: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(batch + vocab)
    logits = torch.randn(batch, vocab, generator=gen) * 3
    context = torch.randint(0, vocab, (batch, 2), generator=gen)
    blocks = torch.randint(0, params.num_shards, (batch, params.num_blocks), generator=gen)
    active = torch.ones(batch, dtype=torch.bool)
    temperature = torch.full((batch,), 0.7)
    return tuple(t.to(device) for t in (logits, context, blocks, active, temperature))


def _sample_step(
    marker: TorchWatermarker, logits: torch.Tensor, operands: tuple[torch.Tensor, ...], temperature: torch.Tensor
) -> None:
    """One gumbel step on a copy of ``logits`` (the op leaves one finite logit per row)."""
    marker.apply(logits.clone(), *operands, inplace=True, temperature=temperature)


def bench_rules(device: torch.device) -> dict[str, Any]:
    """The entropy rule (b=32 k=4 δ=2.5 h=0.69, fused) and the distortion-free scheme's sampling op
    (gumbel b=32, eager and fused: float64 keyed draws over [B, V]; each timing less a [B, V] copy
    it needs to run again on the same logits) per step, against the sampler's own work
    and the default key's fused op on the same logits; and whether the gumbel op chooses on the GPU
    exactly the tokens it chooses on the CPU."""
    default = TorchWatermarker(WatermarkKey.from_secret(SECRET, WatermarkParams(bits=32, num_keys=4)), compile=True)
    rule = TorchWatermarker(WatermarkKey.from_secret(SECRET, RULE_PARAMS), compile=True)
    sampler = TorchWatermarker(WatermarkKey.from_secret(SECRET, GUMBEL_PARAMS))
    fused_sampler = TorchWatermarker(WatermarkKey.from_secret(SECRET, GUMBEL_PARAMS), compile=True)
    same_choice = True
    rows = []
    for vocab in RULE_VOCABS:
        default.warm_up(device, vocab)
        rule.warm_up(device, vocab)
        logits, context, blocks, active, temperature = _rule_inputs(GUMBEL_PARAMS, 64, vocab, device)
        gpu = sampler.apply(logits, context, blocks, active, temperature=temperature).argmax(dim=1).cpu()
        cpu_args = [t.cpu() for t in (logits, context, blocks, active)]
        cpu = sampler.apply(*cpu_args, temperature=temperature.cpu()).argmax(dim=1)
        fused = fused_sampler.apply(logits, context, blocks, active, temperature=temperature).argmax(dim=1).cpu()
        same_choice = same_choice and torch.equal(gpu, cpu) and torch.equal(fused, cpu)
        for batch in RULE_BATCHES:
            number = 50
            logits, context, blocks, active, temperature = _rule_inputs(RULE_PARAMS, batch, vocab, device)
            sample_ms = _cuda_ms(partial(_sample, logits), number)
            default_ms = _cuda_ms(partial(default.apply, logits, context, blocks, active, inplace=True), number)
            rule_ms = _cuda_ms(partial(rule.apply, logits, context, blocks, active, inplace=True), number)
            logits, context, blocks, active, temperature = _rule_inputs(GUMBEL_PARAMS, batch, vocab, device)

            operands = (context, blocks, active)
            gumbel_ms = _cuda_ms(partial(_sample_step, sampler, logits, operands, temperature), number)
            fused_gumbel_ms = _cuda_ms(partial(_sample_step, fused_sampler, logits, operands, temperature), number)
            clone_ms = _cuda_ms(logits.clone, number)  # the copy both gumbel timings include
            rows.append(
                {
                    "vocab": vocab,
                    "batch": batch,
                    "sample_ms": round(sample_ms, 4),
                    "default_fused_ms": round(default_ms, 4),
                    "rule_fused_ms": round(rule_ms, 4),
                    "gumbel_eager_ms": round(gumbel_ms - clone_ms, 4),
                    "gumbel_fused_ms": round(fused_gumbel_ms - clone_ms, 4),
                    "rule_vs_default": round(rule_ms / default_ms, 3),
                    "gumbel_fused_vs_sample": round((fused_gumbel_ms - clone_ms) / sample_ms, 3),
                    "gumbel_fused_vs_default": round((fused_gumbel_ms - clone_ms) / default_ms, 3),
                }
            )
    return {"gumbel_gpu_choice_equals_cpu": same_choice, "per_step": rows}


def bench_generate(key: WatermarkKey, device: torch.device, batch: int, new_tokens: int, rounds: int) -> dict[str, Any]:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from xmark_core.hf import XMarkLogitsProcessor

    config = LlamaConfig(  # SmolLM2-135M's shape
        vocab_size=49_152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()
    prompt = torch.randint(0, config.vocab_size, (batch, 32), device=device)
    generation = GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=True,
        top_k=0,
        top_p=1.0,
        pad_token_id=0,
        eos_token_id=None,
    )
    messages = [Message.from_bits(format(i * 2_654_435_761 % (1 << 16), "016b"), PARAMS) for i in range(batch)]

    def run(watermark: bool) -> float:
        processors = [XMarkLogitsProcessor(key, messages)] if watermark else []
        torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                generation_config=generation,
                logits_processor=processors,
            )
        torch.cuda.synchronize()
        assert out.shape[1] - prompt.shape[1] == new_tokens
        return batch * new_tokens / (time.perf_counter() - started)

    run(False), run(True)  # warm-up
    off, on = [], []
    for index in range(rounds):  # ABBA order: whatever favours the first run of a pair cancels out
        for watermark in (False, True) if index % 2 == 0 else (True, False):
            (on if watermark else off).append(run(watermark))
    return {
        "batch": batch,
        "new_tokens": new_tokens,
        "rounds": rounds,
        "tokens_per_s_off": round(statistics.median(off), 1),
        "tokens_per_s_on": round(statistics.median(on), 1),
        "ratio_on_vs_off": round(statistics.median(on) / statistics.median(off), 4),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda")
    key = WatermarkKey.from_secret(SECRET, PARAMS)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "params": PARAMS.to_dict(),
    }
    identity = check_identity(key, device)
    result["bit_identical_to_cpu"] = identity
    result["all_bit_identical"] = all(identity.values())
    if "op" in args.parts:
        result["op_per_step"] = bench_op(key, device)
    if "rules" in args.parts:
        result["rules"] = bench_rules(device)
        result["all_bit_identical"] = result["all_bit_identical"] and result["rules"]["gumbel_gpu_choice_equals_cpu"]
    if "generate" in args.parts:
        result["generate"] = [
            bench_generate(key, device, batch, args.new_tokens, args.rounds) for batch in args.batches
        ]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=("op", "rules", "generate"),
        default=["op", "rules", "generate"],
        help="what to measure besides the bit-identity check (default: everything)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark measures the GPU path", file=sys.stderr)
        return 2
    result = run(args)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0 if result["all_bit_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
