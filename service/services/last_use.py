"""When each API key was last used (``api_keys.last_used_at``), written after the requests, in batches.

A key's use is bookkeeping that no answer depends on, so no request waits for it: the
authenticator notes the use in memory (:meth:`LastUseRecorder.note`, a dictionary assignment) and
a background task of the process writes the uses noted during the last ``interval_s`` in one
statement (one row per key, the latest use of each). ``last_used_at`` keeps its resolution of a
minute (``service.services.keys.touch_due``): a busy key is noted once a minute, not per request.

Reads of ``last_used_at`` through the admin API (a user's keys, the key search) write the pending
uses of their process first, so they show every use that process has answered; another replica's
uses show within its ``interval_s``. A database fault during a write keeps the uses for the next
one (a warning is logged; nothing is raised into a request); the uses still pending when the
process stops are written once more, within ``timeout_s``, and otherwise lost with a warning (a
lost use is written again at the key's next use).

When the sessionmaker is bound to a connection whose outer transaction owns the work (the test
suite's rolled-back transactions), the background task leaves the uses alone: such a connection
runs one statement at a time, and the reads above and :meth:`flush` write them on it in turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import datetime

from sqlalchemy import bindparam, or_, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from service.db import execute_committed, is_database_fault
from service.models import ApiKey

logger = logging.getLogger("xmark.auth")

# one row per key; a later use than the stored one only (two replicas' batches may cross)
_TOUCH = (
    update(ApiKey.__table__)  # type: ignore[arg-type]  # a Table
    .where(
        ApiKey.__table__.c.id == bindparam("key_id"),
        or_(ApiKey.__table__.c.last_used_at.is_(None), ApiKey.__table__.c.last_used_at < bindparam("used_at")),
    )
    .values(last_used_at=bindparam("used_at"))
)


class LastUseRecorder:
    """Notes key uses in memory and writes them in batches (see the module's docstring)."""

    def __init__(
        self, sessionmaker: async_sessionmaker[AsyncSession], *, interval_s: float = 1.0, timeout_s: float = 10.0
    ) -> None:
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError("interval_s and timeout_s must be positive")
        self._sessionmaker = sessionmaker
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._pending: dict[int, datetime] = {}  # api key id -> its latest unwritten use
        self._in_flight: dict[int, datetime] = {}  # the batch being written
        self._writing = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self.written = 0  # uses written since the start (rows sent)
        self._failing = False  # the last background write failed (its warning is logged once)

    @property
    def pending(self) -> int:
        """How many keys have a use not written yet (the batch being written included)."""
        return len(self._pending.keys() | self._in_flight.keys())

    def note(self, api_key_id: int, used_at: datetime) -> None:
        """Record a use of the key at ``used_at``; written by the next batch."""
        known = self._pending.get(api_key_id)
        if known is None or used_at > known:
            self._pending[api_key_id] = used_at

    async def flush(self) -> None:
        """Write every pending use now (one statement). A database fault keeps them pending and is
        raised to the caller; uses noted meanwhile wait for the next flush."""
        async with self._writing:
            if not self._pending:
                return
            batch = self._in_flight = self._pending
            self._pending = {}
            rows = [{"key_id": key_id, "used_at": used_at} for key_id, used_at in batch.items()]
            try:
                await asyncio.wait_for(execute_committed(self._sessionmaker, _TOUCH, rows), self.timeout_s)
            except BaseException:
                for key_id, used_at in batch.items():  # kept for the next flush, unless a later use was noted
                    self.note(key_id, used_at)
                raise
            finally:
                self._in_flight = {}
            self.written += len(rows)

    async def flush_quietly(self) -> None:
        """:meth:`flush`, with a database fault or a timeout logged instead of raised (the uses stay pending)."""
        try:
            await self.flush()
        except (SQLAlchemyError, OSError, TimeoutError) as exc:
            if isinstance(exc, SQLAlchemyError) and not is_database_fault(exc):
                raise
            if not self._failing:  # once per outage, not once per interval
                logger.warning(
                    "key uses not written yet", extra={"keys": self.pending, "error_type": type(exc).__name__}
                )
            self._failing = True
            return
        if self._failing:
            logger.info("key uses written again", extra={"keys_written": self.written})
        self._failing = False

    def start(self) -> None:
        """Start the background writer (in a running event loop)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="last-use-writer")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if self._pending and isinstance(self._sessionmaker.kw.get("bind"), AsyncEngine):
                try:
                    await self.flush_quietly()
                except Exception:  # a bug, not the database: logged, and the writer goes on
                    logger.exception("key uses not written")

    async def close(self) -> None:
        """Stop the background writer and write what is pending once more (logged when it cannot)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._pending:
            try:
                await self.flush_quietly()
            except Exception:
                logger.exception("key uses not written")
            if self._pending:
                logger.warning("key uses lost at shutdown", extra={"keys": self.pending})
