"""The usage record of an embeddings request: one ``embedding_records`` row, committed before the
response is sent.

The row is written through a ``RowWriter`` of its own (on PostgreSQL a prepared INSERT over a
connection kept for these writes; concurrent requests share a commit), keyed by the request id,
so a write that timed out but did commit and is tried again adds nothing. A request whose row the
database does not take (within ``record_write_timeout_s``, one quick retry) is answered 503
``database_unavailable`` instead of its embeddings: every embedding served is counted once in the
caller's usage (the ``usage_daily`` triggers of migration 0011).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from service.db import RowWriter
from service.db.row_writer import refused
from service.db.spool import RETRY_PAUSE_S, record_write_timeout_s
from service.errors import DatabaseUnavailableError
from service.models import EmbeddingRecord

if TYPE_CHECKING:
    from sqlalchemy import Table
    from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

    from service.config import Settings
    from service.metrics import Metrics

logger = logging.getLogger("xmark.embeddings")

RECORD_KEY = ("request_id",)


@dataclass(frozen=True)
class EmbeddingUse:
    """What one embeddings request used (the row it writes)."""

    request_id: str
    user_id: int
    model: str
    inputs: int
    prompt_tokens: int
    created_at: datetime


class EmbeddingRecords:
    """Writes the rows of embeddings requests (see the module docstring)."""

    def __init__(self, writer: RowWriter, metrics: Metrics) -> None:
        self._writer = writer
        self._metrics = metrics

    async def write(self, use: EmbeddingUse) -> None:
        """Commit ``use``'s row; ``DatabaseUnavailableError`` (503) when the database does not take it."""
        row = {
            "request_id": use.request_id,
            "user_id": use.user_id,
            "model": use.model,
            "inputs": use.inputs,
            "prompt_tokens": use.prompt_tokens,
            "created_at": use.created_at,
        }
        try:
            try:
                await self._writer.write([row])
            except Exception as exc:
                if refused(exc) or isinstance(exc, TimeoutError):
                    raise
                await asyncio.sleep(RETRY_PAUSE_S)  # e.g. a connection the restarted server reset
                await self._writer.write([row])
        except Exception as exc:
            self._metrics.database_unavailable.inc()
            logger.error(
                "embedding record not written",
                extra={
                    "request_id": use.request_id,
                    "user_id": use.user_id,
                    "model": use.model,
                    "prompt_tokens": use.prompt_tokens,
                    "error_type": type(exc).__name__,
                },
            )
            raise DatabaseUnavailableError("The request could not be recorded; retry shortly") from None

    async def close(self) -> None:
        await self._writer.close()


@contextlib.asynccontextmanager
async def open_embedding_records(
    settings: Settings, sessionmaker: async_sessionmaker[AsyncSession], metrics: Metrics
) -> AsyncIterator[EmbeddingRecords]:
    """The embeddings requests' record writer; its connection is closed on exit."""
    table: Table = EmbeddingRecord.__table__  # type: ignore[assignment]  # a Table
    writer = RowWriter(sessionmaker, table, timeout_s=record_write_timeout_s(settings), conflict=RECORD_KEY)
    records = EmbeddingRecords(writer, metrics)
    try:
        yield records
    finally:
        await records.close()
