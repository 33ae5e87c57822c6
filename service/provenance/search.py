"""The generation log as a second witness: sketches written with the records, retrieval for /trace,
corroboration of a naming, and the retention purge.

Retrieval reads content only (the keyed sketches, never the watermark key). It never names anyone:
it gives leads (the users whose message IDs /trace may then test, with a multiplicity of a handful
instead of the whole registry) and corroboration (does the named user's log hold a completion like
the text?).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Protocol

from service.models import utcnow
from service.provenance.retrieval import (
    Lead,
    LoggedSketch,
    Retrieved,
    TermStats,
    rank,
    select_terms,
    select_terms_by_part,
)
from service.provenance.sketch import QUERY_TERM_LIMIT, Sketch, Sketcher
from service.repositories.provenance import ProvenanceRepository
from service.services.reports import iso_utc
from service.trace.analysis import TraceOutcome
from service.trace.fanout import CandidateScope, FanoutOutcome
from service.trace.schemas import Corroboration, CorroborationMatch

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

    from service.trace.policy import TracePolicy


logger = logging.getLogger("xmark.provenance")

MATCHES_SHOWN = 5
# candidates fetched and ranked per search (the database orders them by shared terms)
CANDIDATES = 200
NOT_FOUND_NOTE = (
    "watermark only — no matching generation in this user's log: possible forgery or a generation "
    "older than the retention"
)
# nobody named: a registry-wide naming was withdrawn (``TracePolicy.lead_identity_stands``)
NEIGHBOUR_NOTE = (
    "not named: the watermark fits best a user whose log holds nothing like the text, but it cannot "
    "rule out a user whose log does (a match): an edited text's watermark can fit a registry "
    "neighbour of its author's message ID better than the author's own"
)
# not found, and another user's logged completion resembles the text at least as much as a match
# must: the better explanation an auditor should see first
RIVAL_NOTE = (
    "watermark only — no matching generation in this user's log, but another user's logged generation "
    "matches the text (the first match): the text may be theirs, carrying a forged or mistaken watermark"
)


def _match(lead: Lead) -> CorroborationMatch:
    match = CorroborationMatch(
        user_id=lead.user_id,
        request_id=lead.request_id,
        created_at=iso_utc(lead.created_at),
        similarity=lead.similarity,
    )
    if lead.end_user_id is not None:  # set only then: the signed payload holds it only then
        match.end_user_id = lead.end_user_id
    return match


class SketchStore(Protocol):
    """Where the log's sketches are searched: the database (``ProvenanceRepository``) or memory
    (``MemoryIndex``: tests and evaluations)."""

    async def term_stats(self, terms: Sequence[int]) -> TermStats: ...

    async def candidates(self, terms: Sequence[int], limit: int, user_id: int | None = None) -> list[LoggedSketch]: ...


class ProvenanceSearch:
    """Retrieval over the generation log for one trace (``store``: the request's session's
    ``ProvenanceRepository``, or a ``MemoryIndex``)."""

    def __init__(self, store: SketchStore, sketcher: Sketcher | None, policy: TracePolicy) -> None:
        self._repo = store
        self._sketcher = sketcher
        self._policy = policy

    @property
    def enabled(self) -> bool:
        return self._sketcher is not None

    def sketch(self, text: str) -> Sketch | None:
        return None if self._sketcher is None else self._sketcher.sketch(text, limit=QUERY_TERM_LIMIT, parts=True)

    async def search(self, query: Sketch | None, *, top: int, user_id: int | None = None) -> list[Lead]:
        """The ``top`` logged completions most like the text (of ``user_id`` only, when given)."""
        if query is None or not query.terms:
            return []
        stats = await self._repo.term_stats(query.terms)
        chosen = select_terms_by_part(query.parts, stats) if query.parts else select_terms(query.terms, stats)
        candidates = await self._repo.candidates(chosen, CANDIDATES, user_id=user_id)
        return rank(query, stats, candidates, top=top)

    def retrieved(self, leads: Sequence[Lead]) -> Retrieved:
        """The lead users and the copy holder the fan-out plans with (rules 5 and 7 of the policy)."""
        return Retrieved(tuple(self._policy.lead_users(leads)), self._policy.copy_holder(leads))

    async def witness(
        self, text: str, analyze: Callable[[Retrieved], Awaitable[FanoutOutcome]], *, inline: bool = True
    ) -> TraceOutcome:
        """A trace with the log as second witness: the leads (content only) are found first, so the
        fan-out's plan may include the users they point to; ``analyze`` runs the plan given those
        users (and the copy holder); the outcome's report gains ``named_by`` and ``corroboration``.
        ``inline``: sketch the text on the event loop (short texts), else on a worker thread."""
        query = self.sketch(text) if inline else await asyncio.to_thread(self.sketch, text)
        leads = await self.search(query, top=max(self._policy.max_leads, MATCHES_SHOWN))
        fanout = await analyze(self.retrieved(leads))
        outcome = fanout.outcome
        corroboration = await self.corroborate(query, leads, outcome.attributed_user_id)
        if fanout.withdrawn is not None and outcome.attributed_user_id is None:
            corroboration = corroboration.model_copy(update={"note": NEIGHBOUR_NOTE})
        named_by = None
        if fanout.named_in is not None:
            named_by = "watermark+retrieval" if fanout.named_in == CandidateScope.RETRIEVED else "watermark"
        shows = outcome.report.watermarked or outcome.report.attribution is not None
        model = fanout.model if shows and fanout.model else None
        report = outcome.report.model_copy(
            update={"named_by": named_by, "corroboration": corroboration, "model": model}
        )
        return replace(outcome, report=report)

    async def corroborate(self, query: Sketch | None, leads: Sequence[Lead], named: int | None) -> Corroboration:
        """Whether the named user's log holds a completion like the text; the top matches.

        Corroborated: the named user's best match is at least ``provenance_match_similarity``
        and no other user's logged completion is more similar (many users write on the same
        topics: a same-topic completion of the named user behind someone else's closer one does
        not back the naming)."""
        if not self.enabled:
            return Corroboration(status="disabled")
        threshold = self._policy.match_similarity
        shown = [lead for lead in leads if lead.similarity >= self._policy.lead_similarity]
        shown = shown[:MATCHES_SHOWN]
        if named is None:
            matches = [_match(lead) for lead in shown]
            return Corroboration(status="leads", matches=matches) if shown else Corroboration(status="not_found")
        own = [lead for lead in leads if lead.holder == named]
        if not own or own[0].similarity < threshold:
            # the leads are the whole log's best; the named user's own log may hold a weaker match
            own = await self.search(query, top=1, user_id=named)
        rival = max((lead.similarity for lead in leads if lead.holder != named), default=0.0)
        found = [lead for lead in own if lead.similarity >= max(threshold, rival)]
        if found and all(lead.generation_id != found[0].generation_id for lead in shown):
            shown = [found[0], *shown[: MATCHES_SHOWN - 1]]
        if found:
            return Corroboration(status="corroborated", matches=[_match(lead) for lead in shown])
        note = RIVAL_NOTE if rival >= threshold else NOT_FOUND_NOTE
        return Corroboration(status="not_found", matches=[_match(lead) for lead in shown], note=note)


async def purge_sketches(
    sessionmaker: async_sessionmaker[AsyncSession], retention_days: int, *, now: datetime | None = None
) -> int:
    """Drop the sketches older than ``retention_days`` (the records stay), in batches, each its own
    transaction; returns how many were dropped. ``retention_days`` 0 keeps every sketch."""
    if retention_days <= 0:
        return 0
    cutoff = (now or utcnow()) - timedelta(days=retention_days)
    total = 0
    while True:
        async with sessionmaker() as session, session.begin():
            purged = await ProvenanceRepository(session).purge_before(cutoff)
        total += purged
        if purged == 0:
            return total
