"""Naming at a provider's scale: /trace among 10^4 to 10^7 registered message IDs, per message length.

    python -m benchmarks.evaluation.registry_scale [--bits 32,48,64] [--sizes 10000,...] [--authors 200]

End users multiply the registry: a provider with 10^4 platform accounts of 10^3 end users each holds
10^7 message IDs of each length in use, and /trace ranks a text against all of them. This evaluation
measures how naming holds as the registry grows, and what a longer message buys there.

Protocol (the forensic protocol, ``benchmarks.evaluation.forensic``, on the gateway's default key
version ``spec_for("auto", bits=b)`` for each message length b):

* 10,000 IDs allocated by the gateway's allocator (``MessageAllocator``); the authors are a seeded
  sample of them. Beyond 10,000 the registry holds distinct uniformly random IDs (at 10^7 the
  allocator's best-of-candidates draw is close to random: the largest distance it can keep among
  10^7 IDs is a few bits), each one an end user: naming the right ID is naming the right account and
  end user, since the gateway maps one to the other.
* Each author asks one prompt of the committed set and gets one answer of 300 tokens, at each of the
  temperatures, written by the encoder the gateway's per-request rule chooses for that request.
* A text of T tokens is the answer's first T tokens re-tokenized as /trace sees them, scored by the
  model's forward pass (as the forensic evaluation does), and read by the gateway's own trace
  (``run_trace_now``, the ``auto`` decoder, α = 0.001), both encoders of the version read.
* Null: the unwatermarked answers of the same prompts at each temperature, each traced under
  ``--null-keys`` key versions (the evaluation's and independent ones) against the largest registry.

Every rate comes with its count and a Wilson 95 % interval. Answers and scores are cached under
``var/eval/registry-scale-seed<seed>``; writes ``docs/results/registry-scale.json`` and
``docs/results/REGISTRY-SCALE.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from xmark_core import CandidateSet, WatermarkParams
from xmark_core.encoders import PER_REQUEST, spec_for

from .forensic import Evaluation as ForensicEvaluation
from .forensic import (
    ForensicConfig,
    Population,
    Scorer,
    Setting,
    _log,
    companion_reason_of,
    encoder_rule,
    encoder_setting,
    generate,
    jobs,
    setting_fields,
    trace,
)
from .metrics import rate_cell
from .prompts import load_prompts
from .store import GenerationStore

if TYPE_CHECKING:
    from service.services.registry_cache import RegistrySnapshot

BITS = (32, 48, 64)
SIZES = (10_000, 100_000, 1_000_000, 10_000_000)
TEMPERATURES = (0.7, 1.0)
T_GRID = (150, 300)
NULL_T = (300,)


def scale_config(
    bits: int,
    *,
    authors: int,
    null_texts: int,
    null_keys: int,
    temperatures: tuple[float, ...],
    sizes: tuple[int, ...],
    seed: int = 0,
) -> ForensicConfig:
    """The default key version at ``bits``: each temperature's cell written by the encoder the
    gateway's rule chooses, and the unwatermarked answers of the same prompts."""
    version = spec_for(PER_REQUEST, bits=bits)
    rule = encoder_rule()
    settings = [
        encoder_setting(version, t, authors, companion=bool(companion_reason_of(t, (), rule)), by_rule=True)
        for t in temperatures
    ]
    settings += [Setting(0, 0, t, null_texts) for t in temperatures]
    return ForensicConfig(
        settings=tuple(settings),
        t_grid=T_GRID,
        max_tokens=max(T_GRID),
        registry_size=10_000,
        null_keys=dict.fromkeys(temperatures, null_keys - 1),
        attack_authors=0,
        scaling_sizes={bits: sizes},
        seed=seed,
        key_version=version,
        decoders=("auto",),
        report="registry-scale",
    )


def random_ids(taken: np.ndarray, bits: int, count: int, seed: int) -> np.ndarray:
    """``count`` distinct uniformly random ``bits``-bit IDs (uint64) outside ``taken``, seeded."""
    rng = np.random.default_rng([seed, bits, 0x5CA1E])
    mask = np.uint64((1 << bits) - 1)
    out = np.zeros(0, dtype=np.uint64)
    while out.size < count:
        need = int((count - out.size) * 1.05) + 16
        draw = rng.integers(0, np.iinfo(np.uint64).max, size=need, dtype=np.uint64, endpoint=True) & mask
        merged = np.concatenate([out, draw])
        _, first = np.unique(merged, return_index=True)
        merged = merged[np.sort(first)]  # distinct, in the order drawn
        out = merged[~np.isin(merged, taken)]
    return out[:count]


def id_blocks(values: np.ndarray, params: WatermarkParams) -> np.ndarray:
    """uint8 [C, r] block values of ``params.bits``-bit IDs (most significant block first, as
    ``bits_to_blocks`` reads a bit string)."""
    b, d = params.bits, params.block_bits
    shifts = np.array([b - (i + 1) * d for i in range(params.num_blocks)], dtype=np.uint64)
    return ((values[:, None] >> shifts[None, :]) & np.uint64((1 << d) - 1)).astype(np.uint8)


class ScaleEvaluation(ForensicEvaluation):
    """The forensic evaluation's texts and readings, with registries of up to 10^7 IDs built as
    arrays (the forensic evaluation's string registry holds 10^6 at most in reasonable time)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._values: dict[tuple[int, int], np.ndarray] = {}

    def values(self, bits: int, size: int) -> np.ndarray:
        """The registry's IDs as integers: the allocator's, then random ones up to ``size``."""
        if (bits, size) not in self._values:
            self._values.clear()  # one size held at a time (10^7 IDs of 64 bits: 80 MB here, more per snapshot)
            allocated = np.array([int(m.bits, 2) for m in self.population.registry(bits)], dtype=np.uint64)
            rest = random_ids(allocated, bits, max(0, size - allocated.size), self.config.seed)
            self._values[(bits, size)] = np.concatenate([allocated, rest])[:size]
        return self._values[(bits, size)]

    def snapshot(self, params: WatermarkParams, size: int | None = None) -> RegistrySnapshot:
        from service.services.registry_cache import RegisteredUser, RegistrySnapshot

        size = size or self.config.registry_size
        if (params, size) not in self._snapshots:
            if any(held != size for _, held in self._snapshots):
                self._snapshots.clear()
            values = self.values(params.bits, size)
            # user ids are registry positions + 1 (as the provenance evaluation's: a log row's user is never 0)
            candidates = CandidateSet.from_blocks(id_blocks(values, params), list(range(1, size + 1)), params)
            users = {i: RegisteredUser(i, f"user-{i}", "active") for i in range(1, self.config.registry_size + 1)}
            self._snapshots[(params, size)] = RegistrySnapshot(candidates, users)
        return self._snapshots[(params, size)]


@dataclass
class Args:
    bits: tuple[int, ...]
    sizes: tuple[int, ...]
    temperatures: tuple[float, ...]
    authors: int
    null_texts: int
    null_keys: int
    seed: int


def configs_of(a: Args) -> dict[int, ForensicConfig]:
    return {
        b: scale_config(
            b,
            authors=a.authors,
            null_texts=a.null_texts,
            null_keys=a.null_keys,
            temperatures=a.temperatures,
            sizes=a.sizes,
            seed=a.seed,
        )
        for b in a.bits
    }


def measure(
    evaluation: ScaleEvaluation, sizes: tuple[int, ...], null_keys: int, null_t: tuple[int, ...], log_size: int
) -> list[dict[str, Any]]:
    """Named and wrong per (cell, registry size, T); the null texts' namings at the largest size."""
    cfg = evaluation.config
    rows: list[dict[str, Any]] = []
    for size in sizes:
        built = time.perf_counter()
        for setting, params, _, authors in evaluation.watermarked():
            groups = evaluation.reading(params, size=size)
            if built:
                _log(f"b={setting.bits}: registry of {size:,} built in {time.perf_counter() - built:.1f} s")
                built = 0.0
            for t in cfg.t_grid:
                named = wrong = 0
                seconds = []
                for author in range(setting.authors):
                    t0 = time.perf_counter()
                    outcome = trace("auto", evaluation.prefix(setting, author, t), evaluation.tokenizer, groups, cfg)
                    seconds.append(time.perf_counter() - t0)
                    named += outcome.attributed_user_id == authors[author] + 1
                    wrong += outcome.named and outcome.attributed_user_id != authors[author] + 1
                rows.append(
                    {
                        **setting_fields(setting),
                        "registry": size,
                        "T": t,
                        "named": rate_cell(named, setting.authors),
                        "wrong": rate_cell(wrong, setting.authors),
                        "trace_analysis_s_p50": round(statistics.median(seconds), 4),
                    }
                )
                _log(f"{setting.name} registry {size:,} T={t}: named {named}/{setting.authors}, wrong {wrong}")
        if size == max(sizes):
            rows += null_rows(evaluation, size, null_keys, null_t)
            if log_size:
                rows += in_log_rows(evaluation, size, log_size)
    return rows


def null_rows(evaluation: ScaleEvaluation, size: int, null_keys: int, null_t: tuple[int, ...]) -> list[dict[str, Any]]:
    cfg = evaluation.config
    rows = []
    params = next(p for _, p, _, _ in evaluation.watermarked())
    readings = [evaluation.reading(params, version, size) for version in range(null_keys)]
    for setting in cfg.settings:
        if setting.bits:
            continue
        for t in null_t:
            false = pairs = 0
            for author in range(setting.authors):
                text = evaluation.prefix(setting, author, t)
                for reading in readings:
                    pairs += 1
                    false += trace("auto", text, evaluation.tokenizer, reading, cfg).named
            rows.append(
                {
                    "setting": setting.name,
                    "bits": params.bits,
                    "temperature": setting.temperature,
                    "registry": size,
                    "T": t,
                    "null_named": rate_cell(false, pairs),
                    "key_versions": null_keys,
                }
            )
            _log(f"null {setting.name} b={params.bits} registry {size:,} T={t}: named {false}/{pairs}")
    return rows


LOG_T = 150
SKETCH_SECRET = b"xmark-registry-scale-evaluation-sketch-secret"


def in_log_rows(evaluation: ScaleEvaluation, size: int, log_size: int) -> list[dict[str, Any]]:
    """The first 150 tokens of every author's answer traced with the generation log as second
    witness (``ProvenanceSearch.witness`` and the fan-out, as /trace runs them), the log holding
    every author's answer under its author and ``log_size`` other users' generations composed of
    sentences of the unwatermarked answers (to the same prompt where the cell has one), as the
    provenance evaluation builds its log."""
    import asyncio
    import random
    import re

    from service.provenance.retrieval import LoggedSketch, MemoryIndex
    from service.provenance.search import ProvenanceSearch
    from service.provenance.sketch import Sketcher, derive_sketch_key
    from service.trace.fanout import TextReading
    from service.trace.plan import decoders_for
    from service.trace.service import run_trace
    from service.vocabulary import TraceDecoder

    from .forensic import prompt_of
    from .provenance import _now

    cfg = evaluation.config
    policy = cfg.policy()
    decoders = decoders_for(TraceDecoder.AUTO, scorer_available=True)
    sketcher = Sketcher(derive_sketch_key(SKETCH_SECRET))
    prompts = load_prompts()
    index = MemoryIndex()
    now = _now()

    def logged(generation_id: int, user_id: int, text: str) -> LoggedSketch:
        sketch = sketcher.sketch(text)
        terms, minhash = (sketch.terms, sketch.minhash) if sketch is not None else ((), ())
        return LoggedSketch(
            generation_id, user_id, f"gen-{generation_id}", now, "smollm2-135m-instruct", terms, minhash
        )

    cells = list(evaluation.watermarked())
    generation_id = 0
    taken: set[int] = set()
    for setting, _, _, authors in cells:
        for author in range(setting.authors):
            generation_id += 1
            index.add(
                logged(generation_id, authors[author] + 1, evaluation.decode(evaluation.completion(setting, author)))
            )
            taken.add(authors[author])
    pools: dict[str, list[str]] = {}
    every: list[str] = []
    split = re.compile(r"(?<=[.!?])\s+")
    for setting in cfg.settings:
        if setting.bits:
            continue
        for author in range(setting.authors):
            parts = [p for p in split.split(evaluation.decode(evaluation.completion(setting, author))) if p.strip()]
            pools.setdefault(prompt_of(prompts, cfg.seed, author).id, []).extend(parts)
            every.extend(parts)
    rng = random.Random(f"xmark-registry-scale/{cfg.seed}/log")
    wanted = [prompt_of(prompts, cfg.seed, a).id for s, _, _, _ in cells for a in range(s.authors)]
    started = time.monotonic()
    for _ in range(log_size):
        pool = pools.get(rng.choice(wanted)) or every
        text = " ".join(rng.sample(pool, min(len(pool), rng.randint(3, 8))))
        other = rng.randrange(size)
        while other in taken:
            other = rng.randrange(size)
        generation_id += 1
        index.add(logged(generation_id, other + 1, text))
    _log(f"log: {len(index)} generations sketched in {time.monotonic() - started:.0f} s")
    search = ProvenanceSearch(index, sketcher, policy)
    rows = []
    for setting, params, _, authors in cells:
        groups = evaluation.reading(params, size=size)
        named = wrong = 0
        seconds = []
        for author in range(setting.authors):
            scored = evaluation.prefix(setting, author, LOG_T)
            text = evaluation.decode(evaluation.completion(setting, author)[:LOG_T])

            async def analyze(retrieved: Any, scored: Any = scored, groups: Any = groups) -> Any:
                async def scores() -> Any:
                    return scored.scores

                async def inline(work: Any) -> Any:
                    return work()

                return await run_trace(
                    groups,
                    retrieved,
                    TextReading(scored.ids, evaluation.tokenizer),
                    scores,
                    policy,
                    decoders=decoders,
                    run_counting=inline,
                    run_likelihood=inline,
                )

            t0 = time.perf_counter()
            outcome = asyncio.run(search.witness(text, analyze))
            seconds.append(time.perf_counter() - t0)
            named += outcome.attributed_user_id == authors[author] + 1
            wrong += outcome.named and outcome.attributed_user_id != authors[author] + 1
        rows.append(
            {
                **setting_fields(setting),
                "registry": size,
                "T": LOG_T,
                "in_log": True,
                "log_size": len(index),
                "named": rate_cell(named, setting.authors),
                "wrong": rate_cell(wrong, setting.authors),
                "trace_analysis_s_p50": round(statistics.median(seconds), 4),
            }
        )
        _log(f"in the log: {setting.name} registry {size:,} T={LOG_T}: named {named}/{setting.authors}, wrong {wrong}")
    return rows


def _pct(cell: dict[str, Any]) -> str:
    lo, hi = cell["ci95"]
    return f"{cell['count']}/{cell['of']} = {100 * cell['rate']:.1f} % ({100 * lo:.1f}–{100 * hi:.1f})"


def render(results: dict[str, Any]) -> str:
    """REGISTRY-SCALE.md: one table per message length, the null texts below."""
    lines = [
        "# Naming at a provider's scale",
        "",
        f"`{results['command']}` on {results['machine']}; generated by the gateway's default key version "
        f"at each message length, {results['authors']} authors per cell, answers of 300 tokens, the `auto` "
        "trace at α = 0.001; 10,000 allocated IDs, then random ones (see the module docstring). "
        "Wilson 95 % intervals.",
        "",
    ]
    named = [r for r in results["rows"] if "named" in r and not r.get("in_log")]
    for bits in results["bits"]:
        lines += [
            f"## b = {bits}",
            "",
            "| temperature (encoder) | registry | T = 150: named | wrong | T = 300: named | wrong "
            "| analysis p50 (T = 300) |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in named:
            if row["bits"] != bits or row["T"] != 150:
                continue
            long = next(
                r
                for r in named
                if r["setting"] == row["setting"] and r["registry"] == row["registry"] and r["T"] == 300
            )
            lines.append(
                f"| {row['temperature']} ({row['scheme']}) | {row['registry']:,} | {_pct(row['named'])} | "
                f"{row['wrong']['count']} | {_pct(long['named'])} | {long['wrong']['count']} | "
                f"{1000 * long['trace_analysis_s_p50']:.0f} ms |"
            )
        lines.append("")
    logged = [r for r in results["rows"] if r.get("in_log")]
    if logged:
        lines += [
            "## The first 150 tokens, the answer in the generation log",
            "",
            "| b | temperature (encoder) | registry | log | named | wrong | trace p50 |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in logged:
            cells = (
                row["bits"],
                f"{row['temperature']} ({row['scheme']})",
                f"{row['registry']:,}",
                f"{row['log_size']:,}",
                _pct(row["named"]),
                row["wrong"]["count"],
                f"{1000 * row['trace_analysis_s_p50']:.0f} ms",
            )
            lines.append("| " + " | ".join(map(str, cells)) + " |")
        lines.append("")
    nulls = [r for r in results["rows"] if "null_named" in r]
    if nulls:
        lines += [
            "## Unwatermarked answers of the same prompts, against the largest registry",
            "",
            "| b | temperature | registry | T | (text, key version) pairs named |",
            "|---|---|---|---|---|",
        ]
        for row in nulls:
            cells = (row["bits"], row["temperature"], f"{row['registry']:,}", row["T"], _pct(row["null_named"]))
            lines.append("| " + " | ".join(map(str, cells)) + " |")
        lines.append("")
    lines.append(f"Analysis seconds: {results['timing']['analysis_s']}.")
    return "\n".join(lines) + "\n"


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main(argv: list[str] | None = None) -> int:
    from service.backends.scoring import resolve_scorer_dtype, scoring_model

    from .generation import load_model

    parser = argparse.ArgumentParser(prog="python -m benchmarks.evaluation.registry_scale", description=__doc__)
    parser.add_argument("--model-path", type=Path, default=Path("var/models/smollm2-135m-instruct"))
    parser.add_argument("--output-dir", type=Path, default=Path("docs/results"))
    parser.add_argument("--cache-dir", type=Path)
    parser.add_argument("--bits", type=_ints, default=BITS, help="message lengths, comma-separated")
    parser.add_argument("--sizes", type=_ints, default=SIZES, help="registry sizes, comma-separated (the first 10000)")
    parser.add_argument("--temperatures", type=lambda s: tuple(float(x) for x in s.split(",")), default=TEMPERATURES)
    parser.add_argument("--authors", type=int, default=200)
    parser.add_argument("--null-texts", type=int, default=100, help="unwatermarked answers per temperature")
    parser.add_argument("--null-keys", type=int, default=2, help="key versions each null text is traced under")
    parser.add_argument("--null-t", type=_ints, default=NULL_T, help="the null texts' lengths (tokens)")
    parser.add_argument(
        "--log-size",
        type=int,
        default=100_000,
        help="other users' generations in the log of the in-the-log reading (0: no such reading)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=128, help="vLLM engine: rows decoded together")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of the forward pass")
    stage = parser.add_mutually_exclusive_group()
    stage.add_argument(
        "--prepare-only",
        action="store_true",
        help="generate and score, then stop (the analysis can then run per message length in parallel)",
    )
    stage.add_argument(
        "--part",
        action="store_true",
        help="analyse the cached answers only (no model) and keep the rows in the cache as a part",
    )
    stage.add_argument("--merge", action="store_true", help="write the report from the cached parts")
    args = parser.parse_args(argv)
    if args.sizes[0] != 10_000 or list(args.sizes) != sorted(args.sizes):
        parser.error("--sizes starts at 10000 (the allocated registry) and grows")
    a = Args(args.bits, args.sizes, args.temperatures, args.authors, args.null_texts, args.null_keys, args.seed)
    cache_dir = args.cache_dir or Path("var/eval") / f"registry-scale-seed{args.seed}"
    parts = cache_dir / "parts"
    if args.merge:
        return merge(parts, args.output_dir)
    configs = configs_of(a)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    store = GenerationStore(cache_dir / "generations.jsonl")
    populations = {b: Population(config, cache_dir) for b, config in configs.items()}
    prompts = load_prompts()
    pending, seen = [], set()
    for b, config in configs.items():
        for job in jobs(config, populations[b], prompts):
            key = (job.spec_name, job.user, job.slot)
            if key not in store and key not in seen:
                seen.add(key)
                pending.append(job)
    generation_s = None
    if pending and not args.part:
        _log(f"generating {len(pending)} answers of {max(T_GRID)} tokens")
        generation_s = generate(next(iter(configs.values())), pending, store, args)
    elif pending:
        raise SystemExit(f"--part: {len(pending)} answers are missing from {cache_dir}")
    model, tokenizer = load_model(args.model_path)
    tokenizer.padding_side = "right"
    dtype = resolve_scorer_dtype("auto")
    scores_path = cache_dir / f"scores-{str(dtype).removeprefix('torch.')}.pickle"
    scorer = Scorer(None if args.part else scoring_model(model, dtype), tokenizer, scores_path, 20)
    evaluations = {b: ScaleEvaluation(config, populations[b], store, scorer) for b, config in configs.items()}
    texts = {name: text for e in evaluations.values() for name, text in e.texts().items()}
    _log(f"scoring {sum(name not in scorer.cache for name in texts)} texts ({len(texts)} in all)")
    scorer.score_all(texts)
    if args.prepare_only:
        return 0
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    for b in list(evaluations):
        rows += measure(evaluations.pop(b), a.sizes, a.null_keys, args.null_t, args.log_size)
    result = {
        "command": " ".join(["python -m benchmarks.evaluation.registry_scale", *sys.argv[1:]]),
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, no GPU",
        "bits": list(a.bits),
        "sizes": list(a.sizes),
        "temperatures": list(a.temperatures),
        "authors": a.authors,
        "null_texts": a.null_texts,
        "null_keys": a.null_keys,
        "alpha": next(iter(configs.values())).alpha,
        "rows": rows,
        "timing": {
            "generation_s": None if generation_s is None else round(generation_s, 1),
            "scoring_s": round(scorer.seconds, 1),
            "analysis_s": round(time.monotonic() - started, 1),
        },
    }
    if args.part:
        parts.mkdir(parents=True, exist_ok=True)
        path = parts / f"b{'-'.join(map(str, a.bits))}.json"
        path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        _log(f"wrote {path}")
        return 0
    return write(result, args.output_dir)


def merge(parts: Path, out: Path) -> int:
    """One report from the parts analysed per message length (``--part``)."""
    found = sorted(parts.glob("b*.json"))
    if not found:
        raise SystemExit(f"no parts in {parts}: run with --part first")
    loaded = [json.loads(p.read_text(encoding="utf-8")) for p in found]
    loaded.sort(key=lambda r: r["bits"])
    result = dict(loaded[0])
    result["command"] = " / ".join(r["command"] for r in loaded)
    result["bits"] = [b for r in loaded for b in r["bits"]]
    result["rows"] = [row for r in loaded for row in r["rows"]]
    result["timing"] = {"analysis_s": [r["timing"]["analysis_s"] for r in loaded]}
    return write(result, out)


def write(result: dict[str, Any], out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / "registry-scale.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    (out / "REGISTRY-SCALE.md").write_text(render(result), encoding="utf-8")
    _log(f"wrote {out / 'REGISTRY-SCALE.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
