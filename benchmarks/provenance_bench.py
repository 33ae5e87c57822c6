"""Provenance benchmark: the generation log's retrieval on PostgreSQL at 10^5 and 10^6 logged
completions: sketch cost, lookup latency, recall and size per record.

    python -m benchmarks.provenance_bench --json

1. Sketch cost: CPU time (this thread's, ``time.thread_time_ns``) and wall time of
   ``Sketcher.sketch`` on synthetic completions of ~300 tokens (~230 words) and ~1,000 tokens
   (~770 words), one call at a time on one thread, and the stored size of the sketch
   (``Sketch.size_bytes``).
2. Lookup latency: a fresh database migrated to head is filled with generation records (COPY
   through asyncpg, the texts generated and sketched in a process pool, by ``LogSketcher``: the
   same sketch as ``Sketcher.sketch`` at less than half its cost, checked against it every 500
   records; the product's GIN index live during the load, as in production), then ``VACUUM`` (which
   flushes the GIN index's pending list, as autovacuum does) and ``ANALYZE`` (the term statistics
   the search reads come from ``pg_stats``). The database grows from one size to the next (10^5,
   then 900,000 more rows). At each size, three kinds of queries go through
   ``ProvenanceSearch.search(query, top=20)`` on a real ``AsyncSession`` (the call ``/trace``
   makes), each timed alone, the kinds interleaved, after a warm-up:

   * ``paraphrase``: a logged text with ~45 % of its words kept, the others replaced by words of
     the same topic and of the background vocabulary, and its sentences shuffled; the recall is
     the share whose source generation is the top lead, and among the top 5;
   * ``unrelated``: a text of a topic no logged text has (its background words are shared with
     the log); how often it still gets a lead above the gateway's lead and match thresholds;
   * ``verbatim``: the logged text itself.

   A breakdown on a subset of the queries times the search's steps apart (term statistics,
   candidates query, ranking) and counts the rows the candidates query had to read; one
   ``EXPLAIN (ANALYZE, BUFFERS)`` of the candidates query of a paraphrase is kept per size.
3. Size per record at each size: ``pg_total_relation_size`` of the table and of the GIN index
   ``ix_generations_sketch_terms``, and the sketch columns' average ``pg_column_size``.

The texts: a Zipf-distributed background vocabulary (the English stop words at its head, then
60,000 synthetic words, exponent 1.1) mixed with topic words: 2,000 topics of 40 words each, every
text drawing one topic (~500 texts per topic at 10^6: many users writing on the same prompt, the
hard case for a search by content words). Everything is seeded: a run is repeatable.

The database is created here and dropped at the end (``--keep-db`` keeps it). Progress goes to
stderr; stdout gets a table, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import numpy as np
from pydantic import SecretStr
from sqlalchemy import text
from sqlalchemy.engine import make_url

from benchmarks.pg_admin import create_database, drop_database
from service.config import Settings, load_secrets
from service.db import create_engine, create_sessionmaker, session_scope, upgrade_database
from service.keyring import params_from_settings
from service.models import KeyVersion, User
from service.provenance.retrieval import rank, select_terms
from service.provenance.search import CANDIDATES, ProvenanceSearch
from service.provenance.sketch import (
    QUERY_TERM_LIMIT,
    STOP_WORDS,
    TERM_LIMIT,
    Sketch,
    Sketcher,
    derive_sketch_key,
)
from service.repositories.planner import PlannerStatistics
from service.repositories.provenance import ProvenanceRepository
from service.trace.policy import TracePolicy

DEFAULT_URL = "postgresql+asyncpg://root@127.0.0.1:5432/xmark_provenance_bench"
MODEL = "smollm2-135m-instruct"
USERS = 8
TOP = 20
SHORT_WORDS = 230  # ~300 tokens
LONG_WORDS = 770  # ~1,000 tokens
TOKENS_PER_WORD = 1.3
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
SECONDS_PER_RECORD = 20  # 10^6 completions over ~8 months
COPY_CHUNK = 4_000
GIN_INDEX = "ix_generations_sketch_terms"
COLUMNS = (
    "id",
    "request_id",
    "choice_index",
    "user_id",
    "key_version_id",
    "model",
    "prompt_tokens",
    "completion_tokens",
    "finish_reason",
    "streamed",
    "completion_sha256",
    "completion_text",
    "created_at",
    "sketch_terms",
    "sketch_minhash",
)
QUERY_KINDS = ("paraphrase", "unrelated", "verbatim")
# query texts are drawn with indices far above any logged one
QUERY_INDEX_BASE = 1 << 40


def _log(message: str) -> None:
    print(f"[{datetime.now().strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the synthetic corpus ---------------------------------------------------------------------


@dataclass(frozen=True)
class CorpusSpec:
    seed: int = 20261125
    vocabulary: int = 60_000  # synthetic background words (after the stop words)
    exponent: float = 1.1  # Zipf exponent of the background
    topics: int = 2_000  # topics of logged texts
    held_out_topics: int = 200  # topics of the unrelated queries, never logged
    topic_words: int = 40
    topic_exponent: float = 0.8  # Zipf exponent within a topic
    topic_share: float = 0.15  # share of a text's words drawn from its topic
    long_share: float = 0.1  # share of ~1,000-token completions in the log (the rest ~300 tokens)
    keep: float = 0.45  # share of words a paraphrase keeps


_SYLLABLES = [c + v for c in "bcdfghjklmnprstvz" for v in "aeiou"]


class Corpus:
    """Seeded texts: ``text(index)`` is the same on every process and every run."""

    def __init__(self, spec: CorpusSpec) -> None:
        self.spec = spec
        rng = np.random.default_rng(spec.seed)
        stop = sorted(STOP_WORDS)
        rng.shuffle(stop)
        needed = spec.vocabulary + (spec.topics + spec.held_out_topics) * spec.topic_words
        synthetic: list[str] = []
        seen = set(STOP_WORDS)
        while len(synthetic) < needed:
            # words of 2 to 4 syllables ending in a vowel: the sketch's suffix stripping leaves them whole
            lengths = rng.integers(2, 5, size=needed)
            picks = rng.integers(0, len(_SYLLABLES), size=(needed, 4))
            for length, row in zip(lengths, picks, strict=True):
                word = "".join(_SYLLABLES[i] for i in row[:length])
                if word not in seen:
                    seen.add(word)
                    synthetic.append(word)
                    if len(synthetic) == needed:
                        break
        self.background = len(stop) + spec.vocabulary
        self.words = np.array(stop + synthetic, dtype=object)
        ranks = np.arange(1, self.background + 1, dtype=np.float64)
        weights = ranks**-spec.exponent
        self._cdf = np.cumsum(weights) / weights.sum()
        topic_weights = np.arange(1, spec.topic_words + 1, dtype=np.float64) ** -spec.topic_exponent
        self._topic_cdf = np.cumsum(topic_weights) / topic_weights.sum()

    def _draw(self, rng: np.random.Generator, topic: int, n: int) -> np.ndarray:
        background = np.minimum(np.searchsorted(self._cdf, rng.random(n)), self.background - 1)
        in_topic = np.minimum(np.searchsorted(self._topic_cdf, rng.random(n)), self.spec.topic_words - 1)
        in_topic = self.background + topic * self.spec.topic_words + in_topic
        return np.where(rng.random(n) < self.spec.topic_share, in_topic, background)

    def layout(
        self, index: int, *, topic: int | None = None, words: int | None = None
    ) -> tuple[int, np.ndarray, list[int]]:
        """Text ``index``: its topic, its words (indices into ``self.words``) and its sentence lengths."""
        rng = np.random.default_rng((self.spec.seed, index))
        if topic is None:
            topic = int(rng.integers(self.spec.topics))
        if words is None:
            mean, spread = (LONG_WORDS, 80) if rng.random() < self.spec.long_share else (SHORT_WORDS, 40)
            words = max(40, int(rng.normal(mean, spread)))
        drawn = self._draw(rng, topic, words)
        lengths: list[int] = []
        for length in rng.integers(8, 23, size=words // 8 + 1):
            if sum(lengths) >= words:
                break
            lengths.append(min(int(length), words - sum(lengths)))
        return topic, drawn, lengths

    def sentences(
        self, index: int, *, topic: int | None = None, words: int | None = None
    ) -> tuple[int, list[list[str]]]:
        """The topic and the sentences (lists of words) of text ``index``."""
        topic, drawn, lengths = self.layout(index, topic=topic, words=words)
        tokens = list(self.words[drawn])
        ends = np.cumsum(lengths)
        return topic, [tokens[end - length : end] for end, length in zip(ends, lengths, strict=True)]

    def text(self, index: int, *, topic: int | None = None, words: int | None = None) -> str:
        return render(self.sentences(index, topic=topic, words=words)[1])

    def paraphrase(self, index: int) -> str:
        """Text ``index`` rewritten: ``keep`` of its words kept, the rest replaced by words of its
        topic and of the background, its sentences shuffled."""
        topic, sentences = self.sentences(index)
        rng = np.random.default_rng((self.spec.seed, index, 1))
        rewritten = []
        for sentence in sentences:
            replacements = self.words[self._draw(rng, topic, len(sentence))]
            kept = rng.random(len(sentence)) < self.spec.keep
            rewritten.append([w if k else r for w, k, r in zip(sentence, kept, replacements, strict=True)])
        order = rng.permutation(len(rewritten))
        return render([rewritten[i] for i in order])

    def unrelated(self, number: int) -> str:
        """A ~300-token text of a held-out topic (no logged text has its topic words)."""
        topic = self.spec.topics + number % self.spec.held_out_topics
        return self.text(QUERY_INDEX_BASE + number, topic=topic, words=SHORT_WORDS)


def render(sentences: Sequence[Sequence[str]]) -> str:
    """Sentences capitalised and full-stopped, five to a paragraph."""
    rendered = [f"{s[0].capitalize()} {' '.join(s[1:])}.".replace(" .", ".") for s in sentences if s]
    return "\n\n".join(" ".join(rendered[i : i + 5]) for i in range(0, len(rendered), 5))


# -- the load: records made in a process pool -------------------------------------------------

_WORKER: dict[str, Any] = {}
CHECK_EVERY = 500  # every so many records, the fast sketch is checked against Sketcher.sketch


class LogSketcher:
    """``Sketcher.sketch`` of the corpus' logged texts, at less than half the cost (the load is
    bound by it). Terms: a text's terms are the union of its words' terms (``Sketcher.terms`` is
    per word: normalise, drop stop words, stem, hash, then the ``limit`` smallest), so each
    vocabulary word's term is computed once. MinHash: ``Sketcher.minhash`` itself. ``_records``
    checks the result against ``Sketcher.sketch`` every
    ``CHECK_EVERY`` records and stops the run on any difference."""

    def __init__(self, corpus: Corpus, sketcher: Sketcher, key: bytes) -> None:
        table = np.zeros(len(corpus.words), dtype=np.int64)  # 0: not a content word
        for number, word in enumerate(corpus.words):
            term = sketcher.terms([word], limit=1)
            table[number] = term[0] if term else 0
        self.table = table
        self._sketcher = sketcher

    def minhash(self, tokens: Sequence[str]) -> tuple[int, ...]:
        return self._sketcher.minhash(tokens)  # one keyed hash per distinct word, then vector arithmetic

    def sketch(self, drawn: np.ndarray, tokens: Sequence[str]) -> Sketch:
        terms = np.unique(self.table[drawn])
        terms = terms[terms > 0][:TERM_LIMIT]
        return Sketch(tuple(int(t) for t in terms), self.minhash(tokens))


def _init_worker(spec: CorpusSpec, sketch_key: bytes) -> None:
    corpus = Corpus(spec)
    sketcher = Sketcher(sketch_key)
    _WORKER.update(corpus=corpus, sketcher=sketcher, fast=LogSketcher(corpus, sketcher, sketch_key))


def request_id(index: int) -> str:
    return hashlib.blake2b(b"request %d" % index, digest_size=16).hexdigest()


def _records(start: int, stop: int, user_ids: Sequence[int], key_version_id: int) -> list[tuple[Any, ...]]:
    """Generation records ``start`` to ``stop`` (0-based; the row id is index + 1)."""
    corpus: Corpus = _WORKER["corpus"]
    sketcher: Sketcher = _WORKER["sketcher"]
    fast: LogSketcher = _WORKER["fast"]
    rows = []
    for index in range(start, stop):
        _topic, drawn, lengths = corpus.layout(index)
        tokens = list(corpus.words[drawn])
        ends = np.cumsum(lengths)
        completion = render([tokens[end - length : end] for end, length in zip(ends, lengths, strict=True)])
        sketch = fast.sketch(drawn, tokens)
        if index % CHECK_EVERY == 0 and sketcher.sketch(completion) != sketch:
            raise RuntimeError(f"the fast sketch of record {index} differs from Sketcher.sketch")
        mix = int.from_bytes(hashlib.blake2b(b"mix %d" % index, digest_size=8).digest(), "little")
        words = len(tokens)
        rows.append(
            (
                index + 1,
                request_id(index),
                0,
                user_ids[mix % len(user_ids)],
                key_version_id,
                MODEL,
                20 + (mix >> 8) % 400,
                round(words * TOKENS_PER_WORD),
                "length" if (mix >> 20) % 10 == 0 else "stop",
                (mix >> 24) % 2 == 0,
                hashlib.sha256(completion.encode()).hexdigest(),
                None,
                EPOCH + timedelta(seconds=index * SECONDS_PER_RECORD),
                None if sketch is None else list(sketch.terms),
                None if sketch is None else list(sketch.minhash),
            )
        )
    return rows


def _asyncpg_dsn(database_url: str) -> str:
    return make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)


async def _load(
    dsn: str, pool: ProcessPoolExecutor, workers: int, start: int, stop: int, user_ids: list[int], key_version_id: int
) -> dict[str, Any]:
    """COPY records ``start`` to ``stop`` in, the pool making the next chunks meanwhile."""
    loop = asyncio.get_running_loop()
    connection = await asyncpg.connect(dsn)
    started = time.perf_counter()
    copy_s = 0.0
    pending: deque[asyncio.Future[list[tuple[Any, ...]]]] = deque()
    cursor = start
    done = start
    last_log = started
    try:
        while cursor < stop or pending:
            while cursor < stop and len(pending) < 2 * workers:
                end = min(stop, cursor + COPY_CHUNK)
                pending.append(loop.run_in_executor(pool, _records, cursor, end, user_ids, key_version_id))
                cursor = end
            records = await pending.popleft()
            copy_started = time.perf_counter()
            await connection.copy_records_to_table("generations", records=records, columns=COLUMNS)
            copy_s += time.perf_counter() - copy_started
            done += len(records)
            if time.perf_counter() - last_log > 30 or done == stop:
                last_log = time.perf_counter()
                rate = (done - start) / (last_log - started)
                _log(f"  loaded {done:,} rows ({rate:,.0f} rows/s, ETA {(stop - done) / max(rate, 1e-9):,.0f} s)")
        await connection.execute(
            "SELECT setval(pg_get_serial_sequence('generations', 'id'), (SELECT max(id) FROM generations))"
        )
    finally:
        await connection.close()
    elapsed = time.perf_counter() - started
    return {
        "rows": stop - start,
        "seconds": round(elapsed, 1),
        "rows_per_s": round((stop - start) / elapsed),
        "copy_seconds": round(copy_s, 1),
    }


async def _maintain(dsn: str) -> dict[str, float]:
    """VACUUM (flushes the GIN pending list, as autovacuum would) and ANALYZE (the term statistics)."""
    connection = await asyncpg.connect(dsn)
    try:
        started = time.perf_counter()
        await connection.execute("VACUUM generations")
        vacuum_s = time.perf_counter() - started
        started = time.perf_counter()
        await connection.execute("ANALYZE generations")
        analyze_s = time.perf_counter() - started
    finally:
        await connection.close()
    return {"vacuum_s": round(vacuum_s, 1), "analyze_s": round(analyze_s, 1)}


async def _sizes(dsn: str) -> dict[str, Any]:
    connection = await asyncpg.connect(dsn)
    try:
        row = await connection.fetchrow(
            f"""
            SELECT count(*) AS rows,
                   pg_total_relation_size('generations') AS table_total,
                   pg_relation_size('generations') AS heap,
                   pg_indexes_size('generations') AS indexes,
                   pg_total_relation_size('{GIN_INDEX}') AS gin,
                   avg(pg_column_size(sketch_terms)) AS terms,
                   avg(pg_column_size(sketch_minhash)) AS minhash,
                   avg(cardinality(sketch_terms)) AS terms_count
            FROM generations
            """
        )
    finally:
        await connection.close()
    rows = int(row["rows"])
    columns = float(row["terms"]) + float(row["minhash"])
    gin = int(row["gin"])
    per_record = columns + gin / rows
    return {
        "rows": rows,
        "table_total_bytes": int(row["table_total"]),
        "heap_bytes": int(row["heap"]),
        "indexes_bytes": int(row["indexes"]),
        "gin_index_bytes": gin,
        "sketch_terms_avg_bytes": round(float(row["terms"]), 1),
        "sketch_minhash_avg_bytes": round(float(row["minhash"]), 1),
        "sketch_terms_avg_count": round(float(row["terms_count"]), 1),
        "per_record": {
            "sketch_columns_bytes": round(columns, 1),
            "gin_index_bytes": round(gin / rows, 1),
            "sketch_total_bytes": round(per_record, 1),
            "table_total_bytes": round(int(row["table_total"]) / rows, 1),
        },
        "goal_bytes": 2048,
        "meets_goal": per_record <= 2048,
    }


# -- measurements -----------------------------------------------------------------------------


def _pct(samples: Sequence[float], digits: int = 2) -> dict[str, float]:
    ordered = np.sort(np.asarray(samples, dtype=np.float64))

    def pick(q: float) -> float:
        return round(float(np.percentile(ordered, q, method="nearest")), digits)

    return {
        "p50": pick(50),
        "p95": pick(95),
        "p99": pick(99),
        "mean": round(float(ordered.mean()), digits),
        "max": round(float(ordered[-1]), digits),
    }


def _sketch_cost(corpus: Corpus, sketcher: Sketcher, calls: int) -> dict[str, Any]:
    """``Sketcher.sketch`` on ``calls`` distinct completions of each length, one at a time."""
    result: dict[str, Any] = {}
    for label, words in (("300_tokens", SHORT_WORDS), ("1000_tokens", LONG_WORDS)):
        texts = [corpus.text(QUERY_INDEX_BASE * 2 + words * 1_000_000 + i, words=words) for i in range(calls + 50)]
        cpu: list[float] = []
        wall: list[float] = []
        sizes: list[int] = []
        terms: list[int] = []
        for number, completion in enumerate(texts):
            cpu_started, wall_started = time.thread_time_ns(), time.perf_counter_ns()
            sketch = sketcher.sketch(completion)
            cpu_ns, wall_ns = time.thread_time_ns() - cpu_started, time.perf_counter_ns() - wall_started
            if number < 50:  # warm-up
                continue
            assert sketch is not None
            cpu.append(cpu_ns / 1000)
            wall.append(wall_ns / 1000)
            sizes.append(sketch.size_bytes)
            terms.append(len(sketch.terms))
        result[label] = {
            "words": words,
            "tokens_approx": round(words * TOKENS_PER_WORD),
            "chars_mean": round(statistics.fmean(len(t) for t in texts)),
            "calls": calls,
            "cpu_us": _pct(cpu, 1),
            "wall_us": _pct(wall, 1),
            "terms_median": statistics.median(terms),
            "size_bytes_median": statistics.median(sizes),
            "size_bytes_max": max(sizes),
        }
    return result


@dataclass(frozen=True)
class Query:
    kind: str
    text: str
    source_id: int | None  # the logged generation it came from (paraphrase, verbatim)


def _queries(corpus: Corpus, rows: int, count: int, seed: int) -> list[Query]:
    """``count`` queries of each kind, interleaved; sources drawn from the ``rows`` logged texts."""
    rng = np.random.default_rng((corpus.spec.seed, seed))
    paraphrased = rng.choice(rows, size=count, replace=False)
    verbatim = rng.choice(rows, size=count, replace=False)
    out: list[Query] = []
    for number in range(count):
        out.append(Query("paraphrase", corpus.paraphrase(int(paraphrased[number])), int(paraphrased[number]) + 1))
        out.append(Query("unrelated", corpus.unrelated(seed * 100_000 + number), None))
        out.append(Query("verbatim", corpus.text(int(verbatim[number])), int(verbatim[number]) + 1))
    return out


def _provenance_search(
    session: Any, sketcher: Sketcher, settings: Settings, planner: PlannerStatistics
) -> ProvenanceSearch:
    """``ProvenanceSearch`` on the session's repository, as /trace builds it (``TracingService``:
    the process's cache of the planner's statistics)."""
    return ProvenanceSearch(ProvenanceRepository(session, planner), sketcher, TracePolicy.from_settings(settings))


async def _timed_searches(
    sessionmaker: Any, sketcher: Sketcher, settings: Settings, queries: list[Query], warmup: list[Query]
) -> dict[str, Any]:
    """Each query through ``ProvenanceSearch.search(query, top=20)`` in a session of its own."""
    per_kind: dict[str, dict[str, list[Any]]] = {k: {"ms": [], "sketch_ms": [], "leads": []} for k in QUERY_KINDS}
    planner = PlannerStatistics()  # one per gateway process, as in its resources
    for number, query in enumerate([*warmup, *queries]):
        async with sessionmaker() as session:
            search = _provenance_search(session, sketcher, settings, planner)
            started = time.perf_counter()
            sketch = search.sketch(query.text)
            sketched = time.perf_counter()
            leads = await search.search(sketch, top=TOP)
            searched = time.perf_counter()
        if number < len(warmup):
            continue
        entry = per_kind[query.kind]
        entry["sketch_ms"].append((sketched - started) * 1000)
        entry["ms"].append((searched - sketched) * 1000)
        entry["leads"].append((query, leads))
    lead_floor = settings.provenance_lead_similarity
    match_floor = settings.provenance_match_similarity
    result: dict[str, Any] = {}
    for kind, entry in per_kind.items():
        summary: dict[str, Any] = {
            "queries": len(entry["ms"]),
            "search_ms": _pct(entry["ms"]),
            "query_sketch_ms": _pct(entry["sketch_ms"]),
        }
        outcomes: list[tuple[Query, list[Any]]] = entry["leads"]
        best = [leads[0].similarity if leads else 0.0 for _, leads in outcomes]
        summary["top_similarity"] = _pct(best, 3)
        summary["no_lead"] = sum(1 for _, leads in outcomes if not leads)
        if kind == "unrelated":
            summary[f"with_lead_ge_{lead_floor}"] = sum(1 for b in best if b >= lead_floor)
            summary[f"with_lead_ge_{match_floor}"] = sum(1 for b in best if b >= match_floor)
        else:
            top1 = sum(1 for q, leads in outcomes if leads and leads[0].generation_id == q.source_id)
            top5 = sum(1 for q, leads in outcomes if any(lead.generation_id == q.source_id for lead in leads[:5]))
            top20 = sum(1 for q, leads in outcomes if any(lead.generation_id == q.source_id for lead in leads))
            source_sim = [
                next((lead.similarity for lead in leads if lead.generation_id == q.source_id), 0.0)
                for q, leads in outcomes
            ]
            other_sim = [
                max((lead.similarity for lead in leads if lead.generation_id != q.source_id), default=0.0)
                for q, leads in outcomes
            ]
            n = len(outcomes)
            summary.update(
                {
                    "recall_top1": round(top1 / n, 4),
                    "recall_top5": round(top5 / n, 4),
                    "recall_top20": round(top20 / n, 4),
                    "found_top1": top1,
                    "found_top5": top5,
                    "found_top20": top20,
                    "source_similarity": _pct(source_sim, 3),
                    "best_other_similarity": _pct(other_sim, 3),
                    f"source_ge_{match_floor}": sum(1 for s in source_sim if s >= match_floor),
                }
            )
        result[kind] = summary
    return result


_COUNT_OVERLAP = text("SELECT count(*) FROM generations WHERE sketch_terms && CAST(:terms AS int4[])")
_TERM_DF = text(
    "SELECT t, (SELECT count(*) FROM generations WHERE sketch_terms @> ARRAY[t]) "
    "FROM unnest(CAST(:terms AS int4[])) AS t"
)


async def _breakdown(sessionmaker: Any, sketcher: Sketcher, queries: list[Query], per_kind: int) -> dict[str, Any]:
    """The search's steps timed apart (the same calls ``ProvenanceSearch.search`` makes), with the
    rows the candidates query reads and, for a few paraphrases, the chosen terms' true frequencies."""
    taken = dict.fromkeys(QUERY_KINDS, 0)
    steps: dict[str, dict[str, list[float]]] = {
        k: {n: [] for n in ("term_stats_ms", "candidates_ms", "rank_ms", "chosen", "postings", "overlap", "returned")}
        for k in QUERY_KINDS
    }
    df_checks: list[dict[str, Any]] = []
    for query in queries:
        if taken[query.kind] >= per_kind:
            continue
        taken[query.kind] += 1
        sketch = sketcher.sketch(query.text, limit=QUERY_TERM_LIMIT)
        assert sketch is not None
        async with sessionmaker() as session:
            repo = ProvenanceRepository(session)
            t0 = time.perf_counter()
            stats = await repo.term_stats(sketch.terms)
            t1 = time.perf_counter()
            chosen = select_terms(sketch.terms, stats)
            candidates = await repo.candidates(chosen, CANDIDATES)
            t2 = time.perf_counter()
            rank(sketch, stats, candidates, top=TOP)
            t3 = time.perf_counter()
            overlap = await session.scalar(_COUNT_OVERLAP, {"terms": chosen}) if chosen else 0
            if query.kind == "paraphrase" and len(df_checks) < 5 and chosen:
                true_df = {int(t): int(c) for t, c in await session.execute(_TERM_DF, {"terms": chosen})}
                df_checks.append(
                    {
                        "chosen": len(chosen),
                        "estimated_df_sum": sum(stats.of(t) for t in chosen),
                        "true_df_sum": sum(true_df.values()),
                        "true_df_max": max(true_df.values()),
                        "overlapping_rows": int(overlap or 0),
                    }
                )
        entry = steps[query.kind]
        entry["term_stats_ms"].append((t1 - t0) * 1000)
        entry["candidates_ms"].append((t2 - t1) * 1000)
        entry["rank_ms"].append((t3 - t2) * 1000)
        entry["chosen"].append(len(chosen))
        entry["postings"].append(sum(stats.of(t) for t in chosen))
        entry["overlap"].append(int(overlap or 0))
        entry["returned"].append(len(candidates))
    out: dict[str, Any] = {
        kind: {
            "queries": len(entry["chosen"]),
            "term_stats_ms_p50": round(statistics.median(entry["term_stats_ms"]), 2),
            "candidates_ms_p50": round(statistics.median(entry["candidates_ms"]), 2),
            "candidates_ms_max": round(max(entry["candidates_ms"]), 2),
            "rank_ms_p50": round(statistics.median(entry["rank_ms"]), 2),
            "chosen_terms_p50": statistics.median(entry["chosen"]),
            "estimated_postings_p50": statistics.median(entry["postings"]),
            "overlapping_rows_p50": statistics.median(entry["overlap"]),
            "overlapping_rows_max": max(entry["overlap"]),
            "candidates_returned_p50": statistics.median(entry["returned"]),
        }
        for kind, entry in steps.items()
        if entry["chosen"]
    }
    out["paraphrase_df_checks"] = df_checks
    return out


async def _term_statistics(sessionmaker: Any) -> dict[str, Any]:
    """What ``pg_stats`` tells the search: the number of listed terms and the df of an unlisted one."""
    async with sessionmaker() as session:
        stats = await ProvenanceRepository(session).term_stats([])
        listed = await session.scalar(
            text(
                "SELECT cardinality(CAST(CAST(most_common_elems AS text) AS int4[])) FROM pg_stats "
                "WHERE schemaname = current_schema() AND tablename = 'generations' AND attname = 'sketch_terms'"
            )
        )
    return {"total": stats.total, "listed_terms": int(listed or 0), "unlisted_df": stats.unlisted_df}


async def _explain(sessionmaker: Any, sketcher: Sketcher, query: Query) -> list[str]:
    """EXPLAIN (ANALYZE, BUFFERS) of the candidates query the search runs for ``query``."""
    from service.repositories import provenance as repository

    sketch = sketcher.sketch(query.text, limit=QUERY_TERM_LIMIT)
    assert sketch is not None
    async with sessionmaker() as session:
        stats = await ProvenanceRepository(session).term_stats(sketch.terms)
        chosen = select_terms(sketch.terms, stats)
        statement = repository._PG_CANDIDATES.text.format(user_filter="")
        rows = await session.execute(
            text(f"EXPLAIN (ANALYZE, BUFFERS) {statement}"), {"terms": chosen, "limit": CANDIDATES}
        )
        return [f"chosen terms: {len(chosen)}, estimated postings: {sum(stats.of(t) for t in chosen)}"] + [
            str(r[0]) for r in rows
        ]


# -- the run ----------------------------------------------------------------------------------


async def _seed_registry(settings: Settings) -> tuple[list[int], int]:
    """One key version and a handful of users."""
    params = params_from_settings(settings)
    engine = create_engine(settings)
    try:
        async with session_scope(create_sessionmaker(engine)) as session:
            now = datetime.now(UTC)
            version = KeyVersion(
                name="bench1",
                bits=params.bits,
                block_bits=params.block_bits,
                num_keys=params.num_keys,
                delta=params.delta,
                scheme=params.scheme,
                fingerprint=hashlib.sha256(b"bench1").hexdigest(),
                status="active",
                created_at=now,
                activated_at=now,
            )
            session.add(version)
            users = [
                User(
                    name=f"bench-user-{n}",
                    role="user",
                    status="active",
                    message_id=format(n * 2_654_435_761 % (1 << params.bits), f"0{params.bits}b"),
                    created_at=now,
                    updated_at=now,
                )
                for n in range(USERS)
            ]
            session.add_all(users)
            await session.flush()
            return [u.id for u in users], version.id
    finally:
        await engine.dispose()


async def _postgres_version(dsn: str) -> str:
    connection = await asyncpg.connect(dsn)
    try:
        return str(await connection.fetchval("SELECT version()"))
    finally:
        await connection.close()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    spec = CorpusSpec()
    settings = Settings(
        database_url=args.database_url,
        var_dir=Path(args.var_dir),
        watermark_secrets=SecretStr("bench1:provenance-bench-watermark-secret-7c1e9a"),
        api_key_pepper=SecretStr("provenance-bench-api-key-pepper-3f8d2b6a"),
        keyring_refresh_seconds=0,
    )
    # the gateway's sketcher: keyed from the API-key pepper (service.resources.sketcher_for)
    sketch_key = derive_sketch_key(load_secrets(settings).api_key_pepper)
    sketcher = Sketcher(sketch_key)
    _log("building the corpus")
    corpus = Corpus(spec)
    _log(f"sketch cost: {args.sketch_calls} calls per length")
    sketch_cost = _sketch_cost(corpus, sketcher, args.sketch_calls)
    for label, cost in sketch_cost.items():
        _log(f"  {label}: p50 {cost['cpu_us']['p50']} us CPU, {cost['size_bytes_median']} bytes")

    dsn = _asyncpg_dsn(settings.database_url)
    _log(f"database {make_url(settings.database_url).database}: created and migrated")
    await create_database(settings.database_url, replace=True)
    scales: list[dict[str, Any]] = []
    explain: dict[str, list[str]] = {}
    workers = args.workers or len(os.sched_getaffinity(0))
    try:
        await asyncio.to_thread(upgrade_database, settings.database_url)
        version = await _postgres_version(dsn)
        user_ids, key_version_id = await _seed_registry(settings)
        engine = create_engine(settings)
        sessionmaker = create_sessionmaker(engine)
        loaded = 0
        with ProcessPoolExecutor(max_workers=workers, initializer=_init_worker, initargs=(spec, sketch_key)) as pool:
            for size in sizes:
                _log(f"loading rows {loaded + 1:,} to {size:,} ({workers} worker processes, COPY)")
                load = await _load(dsn, pool, workers, loaded, size, user_ids, key_version_id)
                loaded = size
                _log(f"  {load['rows']:,} rows in {load['seconds']} s; VACUUM and ANALYZE")
                maintenance = await _maintain(dsn)
                _log(f"  vacuum {maintenance['vacuum_s']} s, analyze {maintenance['analyze_s']} s; sizes")
                size_info = await _sizes(dsn)
                term_stats = await _term_statistics(sessionmaker)
                _log(f"  {term_stats}; preparing {args.queries} queries of each kind")
                queries = _queries(corpus, size, args.queries, seed=size)
                warmup = _queries(corpus, size, max(5, args.queries // 10), seed=size + 1)
                _log("  timed searches")
                lookup = await _timed_searches(sessionmaker, sketcher, settings, queries, warmup)
                _log(
                    "  "
                    + "; ".join(f"{k} p50 {v['search_ms']['p50']} ms" for k, v in lookup.items())
                    + f"; paraphrase recall@1 {lookup['paraphrase']['recall_top1']}"
                )
                _log("  breakdown")
                breakdown = await _breakdown(sessionmaker, sketcher, queries, min(args.queries, 50))
                explain[str(size)] = await _explain(sessionmaker, sketcher, queries[0])
                scales.append(
                    {
                        "generations": size,
                        "load": load,
                        "maintenance": maintenance,
                        "term_statistics": term_stats,
                        "size": size_info,
                        "lookup": lookup,
                        "breakdown": breakdown,
                    }
                )
        await engine.dispose()
    finally:
        if args.keep_db:
            _log(f"kept database {make_url(settings.database_url).database}")
        else:
            await drop_database(settings.database_url)
            _log("database dropped")
    return {
        "command": shlex.join([Path(sys.executable).name, "-m", "benchmarks.provenance_bench", *sys.argv[1:]]),
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)),
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(),
            "postgresql": version,
        },
        "corpus": {
            "background_words": corpus.background,
            "zipf_exponent": spec.exponent,
            "topics": spec.topics,
            "topic_words": spec.topic_words,
            "topic_share": spec.topic_share,
            "long_share": spec.long_share,
            "paraphrase_keep": spec.keep,
            "words_short_long": [SHORT_WORDS, LONG_WORDS],
        },
        "load_workers": workers,
        "top": TOP,
        "candidates": CANDIDATES,
        "sketch": sketch_cost,
        "scales": scales,
        "explain_candidates": explain,
    }


def _table(result: dict[str, Any]) -> str:
    lines = ["Sketch cost (Sketcher.sketch, one thread):"]
    lines.append(f"  {'length':<12} {'calls':>6} {'CPU p50 us':>11} {'CPU p99 us':>11} {'wall p50':>9} {'bytes':>6}")
    for label, cost in result["sketch"].items():
        lines.append(
            f"  {label:<12} {cost['calls']:>6} {cost['cpu_us']['p50']:>11} {cost['cpu_us']['p99']:>11} "
            f"{cost['wall_us']['p50']:>9} {cost['size_bytes_median']:>6}"
        )
    lines.append("")
    lines.append("Lookup (ProvenanceSearch.search, top=20), ms:")
    lines.append(
        f"  {'rows':>9} {'kind':<11} {'n':>4} {'p50':>8} {'p95':>8} {'p99':>8} {'top1':>13} {'top5':>13}"
        f" {'top sim p50':>11}"
    )
    for scale in result["scales"]:
        for kind, entry in scale["lookup"].items():
            ms = entry["search_ms"]
            if kind == "unrelated":
                top1 = top5 = "-"
            else:
                top1 = f"{entry['recall_top1']:.3f} ({entry['found_top1']})"
                top5 = f"{entry['recall_top5']:.3f} ({entry['found_top5']})"
            lines.append(
                f"  {scale['generations']:>9,} {kind:<11} {entry['queries']:>4} {ms['p50']:>8} {ms['p95']:>8} "
                f"{ms['p99']:>8} {top1:>13} {top5:>13} {entry['top_similarity']['p50']:>11}"
            )
    lines.append("")
    lines.append("Size per record (bytes):")
    lines.append(f"  {'rows':>9} {'sketch cols':>11} {'GIN index':>10} {'sketch total':>12} {'whole table':>12} goal")
    for scale in result["scales"]:
        per = scale["size"]["per_record"]
        lines.append(
            f"  {scale['generations']:>9,} {per['sketch_columns_bytes']:>11} {per['gin_index_bytes']:>10} "
            f"{per['sketch_total_bytes']:>12} {per['table_total_bytes']:>12} "
            f"{'<= 2 KB' if scale['size']['meets_goal'] else '> 2 KB'}"
        )
    lines.append("")
    lines.append("Load (COPY, process pool) and maintenance:")
    for scale in result["scales"]:
        load, m, stats = scale["load"], scale["maintenance"], scale["term_statistics"]
        lines.append(
            f"  {scale['generations']:>9,}: +{load['rows']:,} rows in {load['seconds']} s "
            f"({load['rows_per_s']:,} rows/s), vacuum {m['vacuum_s']} s, analyze {m['analyze_s']} s; "
            f"pg_stats lists {stats['listed_terms']} terms, unlisted df {stats['unlisted_df']}"
        )
    for size, plan in list(result["explain_candidates"].items())[-1:]:
        lines.append("")
        lines.append(f"EXPLAIN (ANALYZE, BUFFERS) of a paraphrase's candidates query at {int(size):,} rows:")
        lines.extend(f"  {line}" for line in plan)
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.provenance_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="the JSON object on one line (default: indented)")
    parser.add_argument("--sizes", default="100000,1000000", help="log sizes, grown in turn (default: %(default)s)")
    parser.add_argument("--queries", type=int, default=200, help="queries of each kind per size (default: %(default)s)")
    parser.add_argument(
        "--sketch-calls", type=int, default=2000, help="sketches timed per length (default: %(default)s)"
    )
    parser.add_argument("--workers", type=int, default=None, help="processes making the records (default: one per CPU)")
    parser.add_argument(
        "--database-url", default=DEFAULT_URL, help="database to create, use and drop (default: %(default)s)"
    )
    parser.add_argument("--var-dir", default="var", help="the settings' var dir (nothing is written there)")
    parser.add_argument("--keep-db", action="store_true", help="do not drop the database at the end (debugging)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    result = asyncio.run(run(args))
    print(_table(result))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
