"""Retrieval over the generation log's sketches: which logged completions a suspect text resembles.
Pure computation; the repository fetches term statistics and candidate sketches.

Selection uses content only (the sketches), never the watermark key, so a watermark test restricted
to the users it returns stays a valid test (with the multiplicity of those users).

Search in two steps, both bounded:

1. ``select_terms``: the suspect text's rarest terms (by document frequency in the log), up to
   ``max_terms`` and until their postings would pass ``budget``; terms in more than ``max_share``
   of the log say nothing about a source and are skipped. A text of several parts (paragraphs;
   ``sketch.text_parts``) has each part's rarest terms chosen in turn (``select_terms_by_part``):
   a completion pasted between other paragraphs is found by its own words.
2. The store returns the logged sketches sharing most of those terms; ``rank`` scores each by
   ``similarity`` and keeps the best.

``similarity`` is the larger of two shares: the suspect text's content (each term weighted by its
BM25 inverse document frequency) that the logged completion holds, and the logged completion's
terms that the suspect text holds (for a completion wrapped in other text; only for completions of
at least ``MIN_CONTAINMENT_TERMS`` terms). A logged completion keeps a bottom-k sample of its
terms, so the first share counts only the suspect's terms that the sample could hold.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from service.parties import party_key
from service.provenance.sketch import TERM_LIMIT, Sketch, minhash_similarity

MIN_CONTAINMENT_TERMS = 16
DEFAULT_MAX_TERMS = 32
DEFAULT_BUDGET = 20_000
DEFAULT_MAX_SHARE = 0.02
# the budget never cuts the search below this many terms (an estimate of how often a term occurs
# may be a loose upper bound, which grows with the log)
DEFAULT_MIN_TERMS = 12
# below this many sketched completions every term counts as informative
MIN_TOTAL_FOR_SHARE = 1_000


@dataclass(frozen=True)
class LoggedSketch:
    """A logged completion's sketch and the metadata an auditor may see."""

    generation_id: int
    user_id: int
    request_id: str
    created_at: datetime
    model: str
    terms: tuple[int, ...]
    minhash: tuple[int, ...]
    # the account's end user it was generated for (None: the account itself)
    end_user_id: int | None = None

    @property
    def holder(self) -> int:
        """Whose message ID the completion carries, as the registry numbers them (``service.parties``)."""
        return party_key(self.user_id, self.end_user_id)


@dataclass(frozen=True)
class TermStats:
    """Document frequencies in the log: ``total`` sketched completions; ``df`` of some terms; a term
    not in ``df`` is assumed to occur in ``unlisted_df`` completions (0 where ``df`` is exact)."""

    total: int
    df: Mapping[int, int]
    unlisted_df: int = 0

    def of(self, term: int) -> int:
        return self.df.get(term, self.unlisted_df)

    def idf(self, term: int) -> float:
        df = self.of(term)
        total = max(self.total, df)
        return math.log(1.0 + (total - df + 0.5) / (df + 0.5))


@dataclass(frozen=True)
class Lead:
    """A logged completion like the suspect text: its metadata and similarities in [0, 1]."""

    generation_id: int
    user_id: int
    request_id: str
    created_at: datetime
    model: str
    similarity: float
    shingle_similarity: float
    end_user_id: int | None = None

    @property
    def holder(self) -> int:
        """Whose message ID the completion carries, as the registry numbers them (``service.parties``)."""
        return party_key(self.user_id, self.end_user_id)


def select_terms(
    terms: Iterable[int],
    stats: TermStats,
    *,
    max_terms: int = DEFAULT_MAX_TERMS,
    budget: int = DEFAULT_BUDGET,
    max_share: float = DEFAULT_MAX_SHARE,
    min_terms: int = DEFAULT_MIN_TERMS,
) -> list[int]:
    """The terms to look up: the rarest that occur in the log, until ``max_terms`` or ``budget``
    postings (but at least ``min_terms``); a term in more than ``max_share`` of a large log is
    skipped."""
    return select_terms_by_part(
        [terms], stats, max_terms=max_terms, budget=budget, max_share=max_share, min_terms=min_terms
    )


def select_terms_by_part(
    parts: Sequence[Iterable[int]],
    stats: TermStats,
    *,
    max_terms: int = DEFAULT_MAX_TERMS,
    budget: int = DEFAULT_BUDGET,
    max_share: float = DEFAULT_MAX_SHARE,
    min_terms: int = DEFAULT_MIN_TERMS,
) -> list[int]:
    """``select_terms`` over a text read in parts: each part's rarest terms in turn (its rarest,
    then every other part's rarest, then each one's next), under the same bounds, so a completion
    pasted between other paragraphs has its own words in the search even where the paragraphs
    around it hold rarer ones. A part whose terms are all taken or too common drops out."""
    share_cap = max_share * stats.total if stats.total >= MIN_TOTAL_FOR_SHARE else math.inf
    queues = [sorted(set(part), key=lambda t: (stats.of(t), t)) for part in parts]
    positions = [0] * len(queues)
    chosen: list[int] = []
    taken: set[int] = set()
    spent = 0
    live = [i for i, queue in enumerate(queues) if queue]
    while live:
        for i in list(live):
            queue = queues[i]
            while positions[i] < len(queue) and (
                queue[positions[i]] in taken or stats.of(queue[positions[i]]) == 0  # 0: in no logged completion
            ):
                positions[i] += 1
            if positions[i] >= len(queue):
                live.remove(i)
                continue
            term = queue[positions[i]]
            df = stats.of(term)
            if df > share_cap:  # this part's other terms are as common or more
                live.remove(i)
                continue
            if spent + df > budget and len(chosen) >= min_terms:
                return chosen
            chosen.append(term)
            taken.add(term)
            spent += df
            positions[i] += 1
            if len(chosen) >= max_terms:
                return chosen
    return chosen


class _WeightedQuery:
    """A suspect text's terms with their weights, prepared once for scoring many candidates."""

    def __init__(self, query: Sketch, weights: Mapping[int, float]) -> None:
        self.terms = query.terms  # sorted
        self.weights = weights
        self.cumulative = list(itertools.accumulate(weights[t] for t in query.terms))  # [Q]

    def weight_up_to(self, bound: int | None) -> float:
        """The total weight of the query's terms (those <= ``bound`` only, when given)."""
        if not self.cumulative:
            return 0.0
        if bound is None:
            return self.cumulative[-1]
        count = bisect.bisect_right(self.terms, bound)
        return self.cumulative[count - 1] if count else 0.0

    def similarity(self, logged: LoggedSketch) -> float:
        if not self.terms or not logged.terms:
            return 0.0
        weights = self.weights
        shared = [t for t in logged.terms if t in weights]
        # a full bottom-k sample holds only terms up to its largest hash
        bound = logged.terms[-1] if len(logged.terms) >= TERM_LIMIT else None
        total = self.weight_up_to(bound)
        coverage = sum(weights[t] for t in shared) / total if total > 0 else 0.0
        containment = len(shared) / len(logged.terms) if len(logged.terms) >= MIN_CONTAINMENT_TERMS else 0.0
        return max(coverage, containment)


def similarity(query: Sketch, weights: Mapping[int, float], logged: LoggedSketch) -> float:
    """How much of the suspect text the logged completion explains, or the reverse (module doc)."""
    return _WeightedQuery(query, weights).similarity(logged)


def rank(query: Sketch, stats: TermStats, candidates: Iterable[LoggedSketch], *, top: int) -> list[Lead]:
    """The ``top`` candidates by similarity (then shingle similarity, then the newer)."""
    weighted = _WeightedQuery(query, {t: stats.idf(t) for t in query.terms})
    leads = [
        Lead(
            generation_id=c.generation_id,
            user_id=c.user_id,
            request_id=c.request_id,
            created_at=c.created_at,
            model=c.model,
            similarity=round(weighted.similarity(c), 4),
            shingle_similarity=round(minhash_similarity(query.minhash, c.minhash), 4),
            end_user_id=c.end_user_id,
        )
        for c in candidates
    ]
    leads.sort(key=lambda lead: (-lead.similarity, -lead.shingle_similarity, -lead.generation_id))
    return leads[:top]


@dataclass(frozen=True)
class Retrieved:
    """What a content search of the log gives /trace's fan-out: the users of the leads, best first,
    and ``copy_holder``, the one user whose logged completions hold a near-copy of the text (None
    when no user's do, or when several users' do)."""

    users: tuple[int, ...] = ()
    copy_holder: int | None = None


class MemoryIndex:
    """The log's sketches held in memory, searched as the database searches them (tests, evaluation)."""

    def __init__(self) -> None:
        self._logged: dict[int, LoggedSketch] = {}
        self._postings: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self._logged)

    def add(self, logged: LoggedSketch) -> None:
        self._logged[logged.generation_id] = logged
        for term in logged.terms:
            self._postings.setdefault(term, []).append(logged.generation_id)

    def stats(self, terms: Iterable[int]) -> TermStats:
        """Exact document frequencies of ``terms`` (as the SQLite postings give them)."""
        return TermStats(len(self._logged), {t: len(self._postings[t]) for t in terms if t in self._postings})

    def matching(
        self, terms: Sequence[int], limit: int, user_id: int | None = None, exclude: Container[int] = ()
    ) -> list[LoggedSketch]:
        """The sketches sharing the most of ``terms``, most first (then the newest); ``exclude``:
        generation ids left out (e.g. an evaluation's "not in the log")."""
        hits: dict[int, int] = {}
        for term in terms:
            for generation_id in self._postings.get(term, ()):
                hits[generation_id] = hits.get(generation_id, 0) + 1
        found = [
            self._logged[g] for g in hits if g not in exclude and (user_id is None or self._logged[g].holder == user_id)
        ]
        found.sort(key=lambda c: (-hits[c.generation_id], -c.generation_id))
        return found[:limit]

    # the store interface of service.provenance.search.ProvenanceSearch
    async def term_stats(self, terms: Sequence[int]) -> TermStats:
        return self.stats(terms)

    async def candidates(self, terms: Sequence[int], limit: int, user_id: int | None = None) -> list[LoggedSketch]:
        return self.matching(terms, limit, user_id)

    def search(
        self,
        query: Sketch,
        *,
        top: int,
        candidates: int = 200,
        user_id: int | None = None,
        exclude: Container[int] = (),
    ) -> list[Lead]:
        """``ProvenanceSearch.search`` in memory (synchronous)."""
        stats = self.stats(query.terms)
        chosen = select_terms_by_part(query.parts, stats) if query.parts else select_terms(query.terms, stats)
        return rank(query, stats, self.matching(chosen, candidates, user_id, exclude), top=top)
