"""The PostgreSQL planner's statistics of the content sketches' terms column, cached per process
(the provenance search weighs its query terms by them)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

_PG_STATS = text(
    """
    SELECT CAST(CAST(s.most_common_elems AS text) AS int4[]) AS elems, s.most_common_elem_freqs AS freqs,
           s.null_frac, c.reltuples
    FROM pg_stats s JOIN pg_class c ON c.relname = s.tablename
    JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = s.schemaname
    WHERE s.schemaname = current_schema() AND s.tablename = 'generations' AND s.attname = 'sketch_terms'
    """
)


@dataclass(frozen=True)
class PlannerTerms:
    total: int
    listed: dict[int, float]  # term -> share of the sketched rows holding it
    rarest: float


class PlannerStatistics:
    """The planner's statistics of the terms column, read at most every ``ttl_s`` seconds per
    process (ANALYZE refreshes them far less often; reading them costs a 10,000-element array)."""

    def __init__(self, ttl_s: float = 60.0) -> None:
        self.ttl_s = ttl_s
        self._cached: PlannerTerms | None = None
        self._read_at = float("-inf")

    async def get(self, session: AsyncSession) -> PlannerTerms | None:
        if self._cached is not None and time.monotonic() - self._read_at < self.ttl_s:
            return self._cached
        row = (await session.execute(_PG_STATS)).first()
        if row is None or row.elems is None or row.reltuples is None or row.reltuples <= 0:
            return None  # not analysed yet: read again next time
        total = max(1, round(float(row.reltuples) * (1.0 - float(row.null_frac or 0.0))))
        freqs = list(row.freqs or ())
        elems = list(row.elems)
        # most_common_elem_freqs: one frequency per element, then the minimum, the maximum and the
        # frequency of NULL elements
        listed = dict(zip((int(e) for e in elems), freqs[: len(elems)], strict=True))
        self._cached = PlannerTerms(total, listed, min(freqs[: len(elems)], default=0.0))
        self._read_at = time.monotonic()
        return self._cached
