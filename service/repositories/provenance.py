"""Queries over the generation log's content sketches (``generations.sketch_terms`` / ``sketch_minhash``).

PostgreSQL: the terms are an int4[] with a GIN index (``gin__int_ops``, contrib ``intarray``);
candidates are the rows overlapping the chosen terms, ranked by the overlap count
(``icount(a & b)``) in the database. Document frequencies come from the planner's own statistics
(``pg_stats.most_common_elems`` of the terms column, refreshed by ANALYZE/autovacuum): a term
listed there has its frequency; a term not listed is rarer than the rarest listed one.

SQLite: a postings table (term, generation) kept by triggers gives candidates and exact document
frequencies.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Integer, String, func, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession

from service.models import Generation, IntArray, UTCDateTime
from service.parties import end_user_of
from service.provenance.retrieval import LoggedSketch, TermStats
from service.repositories.planner import PlannerStatistics

_PG_CANDIDATES = text(
    """
    SELECT id, user_id, end_user_id, request_id, created_at, model, sketch_terms, sketch_minhash
    FROM generations
    WHERE sketch_terms && CAST(:terms AS int4[]) {user_filter}
    ORDER BY icount(sketch_terms & CAST(:terms AS int4[])) DESC, id DESC
    LIMIT :limit
    """
)
_SQLITE_CANDIDATES = """
    SELECT g.id, g.user_id, g.end_user_id, g.request_id, g.created_at, g.model, g.sketch_terms, g.sketch_minhash
    FROM (
        SELECT p.generation_id, count(*) AS hits FROM provenance_postings p
        {user_join}
        WHERE p.term IN ({terms})
        GROUP BY p.generation_id ORDER BY hits DESC, p.generation_id DESC LIMIT :limit
    ) AS found JOIN generations g ON g.id = found.generation_id
    ORDER BY found.hits DESC, g.id DESC
    """


class ProvenanceRepository:
    def __init__(self, session: AsyncSession, planner: PlannerStatistics | None = None) -> None:
        self._session = session
        self._dialect = session.get_bind().dialect
        # PostgreSQL: the process's cache of the planner's statistics (None: read them each time)
        self._planner = planner if planner is not None else PlannerStatistics(ttl_s=0.0)

    async def term_stats(self, terms: Sequence[int]) -> TermStats:
        """The log's document frequencies of ``terms`` and the number of sketched completions."""
        if self._dialect.name == "postgresql":
            return await self._pg_term_stats(terms)
        total = await self._session.scalar(
            select(func.count()).select_from(Generation).where(Generation.sketch_terms.is_not(None))
        )
        df: dict[int, int] = {}
        if terms:
            rows = await self._session.execute(
                text(
                    "SELECT term, count(*) FROM provenance_postings WHERE term IN "
                    f"({', '.join(str(int(t)) for t in terms)}) GROUP BY term"
                )
            )
            df = {int(term): int(count) for term, count in rows}
        return TermStats(int(total or 0), df)

    async def _pg_term_stats(self, terms: Sequence[int]) -> TermStats:
        planner = await self._planner.get(self._session)
        if planner is None:
            # not analysed yet: count the sketched rows; every term counts as rare
            total = await self._session.scalar(
                select(func.count()).select_from(Generation).where(Generation.sketch_terms.is_not(None))
            )
            return TermStats(int(total or 0), {}, unlisted_df=1)
        total = planner.total
        df = {t: max(1, round(planner.listed[t] * total)) for t in terms if t in planner.listed}
        return TermStats(total, df, unlisted_df=max(1, round(planner.rarest * total)))

    async def candidates(self, terms: Sequence[int], limit: int, user_id: int | None = None) -> list[LoggedSketch]:
        """The logged sketches sharing the most of ``terms`` (of the holder ``user_id`` only, when
        given: an account's own completions, or an end user's, numbered as ``service.parties``)."""
        if not terms:
            return []
        params: dict[str, Any] = {"limit": limit}
        holder = ""
        if user_id is not None:
            end_user_id = end_user_of(user_id)
            if end_user_id is None:
                holder, params["user_id"] = "{t}.user_id = :user_id AND {t}.end_user_id IS NULL", user_id
            else:
                holder, params["end_user_id"] = "{t}.end_user_id = :end_user_id", end_user_id
        if self._dialect.name == "postgresql":
            params["terms"] = [int(t) for t in terms]
            user_filter = "AND " + holder.format(t="generations") if holder else ""
            statement = text(_PG_CANDIDATES.text.format(user_filter=user_filter))
        else:
            user_join = ""
            if holder:
                user_join = "JOIN generations u ON u.id = p.generation_id AND " + holder.format(t="u")
            statement = text(
                _SQLITE_CANDIDATES.format(user_join=user_join, terms=", ".join(str(int(t)) for t in terms))
            )
        typed = statement.columns(
            id=Integer(),
            user_id=Integer(),
            end_user_id=Integer(),
            request_id=String(),
            created_at=UTCDateTime(),
            model=String(),
            sketch_terms=IntArray(),
            sketch_minhash=IntArray(),
        )
        rows = await self._session.execute(typed, params)
        return [self._logged(row) for row in rows]

    @staticmethod
    def _logged(row: Any) -> LoggedSketch:
        return LoggedSketch(
            generation_id=int(row.id),
            user_id=int(row.user_id),
            request_id=str(row.request_id),
            created_at=row.created_at,
            model=str(row.model),
            terms=tuple(row.sketch_terms or ()),
            minhash=tuple(row.sketch_minhash or ()),
            end_user_id=None if row.end_user_id is None else int(row.end_user_id),
        )

    async def purge_before(self, cutoff: datetime, batch: int = 5_000) -> int:
        """Drop the sketches of completions created before ``cutoff`` (at most ``batch`` rows);
        returns how many. The records themselves stay."""
        ids = (
            (
                await self._session.execute(
                    select(Generation.id)
                    .where(Generation.created_at < cutoff, Generation.sketch_terms.is_not(None))
                    .limit(batch)
                )
            )
            .scalars()
            .all()
        )
        if ids:
            await self._session.execute(
                update(Generation).where(Generation.id.in_(ids)).values(sketch_terms=None, sketch_minhash=None)
            )
        return len(ids)
