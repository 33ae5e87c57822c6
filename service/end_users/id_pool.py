"""Message IDs drawn ahead for end users' first sights.

A first sight needs one new message ID per length in use, drawn by the registry's allocation rule
(``services/users.choose_message_ids``): below ``SPREAD_ALLOCATION_LIMIT`` registered IDs that
reads every ID of the length and scores random candidates against them, which costs a first sight
more than all its other work together, and grows with the registry. ``IdPool`` draws them ahead,
``POOL_SIZE`` per length, in the background (one read of the registry per refill, the scoring in
a worker thread), against the registered IDs and the ones it already holds; a first sight takes
one per length without a statement or a draw. When the pool runs low (``LOW_WATER``) it refills;
when it is empty (the first first sight of a process, a burst) the first sight draws as before.

A drawn ID is only a candidate: nothing is written until a first sight inserts it, where the
unique constraint on ``message_ids`` refuses one another replica (or an account created
meanwhile) took, and the first sight draws again. The pool forgets its IDs when the lengths in
use change (``clear``), and IDs older than ``MAX_AGE_S`` (drawn far from the registry as it was;
IDs registered since were not scored against them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from service.db import session_scope
from service.repositories.message_ids import MessageIdRepository
from service.services.message_ids import MessageLength, length_of
from service.services.users import SPREAD_ALLOCATION_LIMIT, SPREAD_MIN_BITS, Allocator
from xmark_core import Message, WatermarkParams
from xmark_core.errors import MessageSpaceExhausted

logger = logging.getLogger("xmark.end_users")

POOL_SIZE = 16  # IDs drawn ahead per length
LOW_WATER = 4  # a refill starts when a length holds this many or fewer
MAX_AGE_S = 60.0  # drawn IDs older than this are dropped unused


class IdPool:
    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        allocator: Allocator,
        *,
        size: int = POOL_SIZE,
        low_water: int = LOW_WATER,
        max_age_s: float = MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sessionmaker = sessionmaker
        self._allocator = allocator
        self.size = size
        self.low_water = low_water
        self.max_age_s = max_age_s
        self._clock = clock
        self._ready: dict[MessageLength, deque[Message]] = {}
        self._drawn_at: float | None = None
        self._generation = 0  # bumped by ``clear``: a refill under way then keeps nothing
        self._refill: asyncio.Task[None] | None = None
        # the IDs taken lately: a refill draws away from them too (the first sight that took one may
        # not have committed it when the refill reads the registry)
        self._taken: deque[str] = deque(maxlen=4 * size + 64)

    def held(self, length: MessageLength) -> int:
        return len(self._ready.get(length, ()))

    def take(self, lengths: Sequence[WatermarkParams]) -> list[Message] | None:
        """One drawn ID per length in ``lengths``, or None (all or nothing: a first sight then draws
        them itself); starts a refill when a length runs low."""
        if self._drawn_at is not None and self._clock() - self._drawn_at > self.max_age_s:
            self.clear()
        queues = [self._ready.get(length_of(p)) for p in lengths]
        taken: list[Message] | None = None
        if all(queues):
            taken = [q.popleft() for q in queues if q]
            self._taken.extend(m.bits for m in taken)
        if any(len(q or ()) <= self.low_water for q in queues):
            self.refill(lengths)
        return taken

    def clear(self) -> None:
        """Forget every drawn ID (the lengths in use changed, or the IDs are old)."""
        self._generation += 1
        self._ready.clear()
        self._drawn_at = None

    def refill(self, lengths: Sequence[WatermarkParams]) -> asyncio.Task[None] | None:
        """Top the pool up to ``size`` per length in the background (one refill at a time)."""
        if self._refill is not None and not self._refill.done():
            return self._refill
        if self.size <= 0:
            return None
        self._refill = asyncio.create_task(self._draw(tuple(lengths)))
        return self._refill

    async def _draw(self, lengths: tuple[WatermarkParams, ...]) -> None:
        generation = self._generation
        try:
            async with session_scope(self._sessionmaker) as session:
                ids = MessageIdRepository(session)
                large = await ids.newest_row() >= SPREAD_ALLOCATION_LIMIT
                registered: list[list[str]] = []
                for params in lengths:
                    if large and params.bits >= SPREAD_MIN_BITS:
                        registered.append([])  # drawn at random: the unique constraint checks it
                    else:
                        registered.append(await ids.existing(params.bits, params.block_bits))
            held = [list(self._ready.get(length_of(p), ())) for p in lengths]
            taken = list(self._taken)
            drawn = await asyncio.to_thread(self._draw_all, lengths, registered, held, taken)
        except (SQLAlchemyError, OSError, TimeoutError, MessageSpaceExhausted) as exc:
            logger.warning(
                "message IDs were not drawn ahead; first sights draw their own", extra={"error": type(exc).__name__}
            )
            return
        if generation != self._generation:
            return  # cleared meanwhile: the lengths in use changed
        for params, more in zip(lengths, drawn, strict=True):
            self._ready.setdefault(length_of(params), deque()).extend(more)
        if self._drawn_at is None:
            self._drawn_at = self._clock()

    def _draw_all(
        self,
        lengths: Sequence[WatermarkParams],
        registered: list[list[str]],
        held: list[list[Message]],
        taken_lately: list[str],
    ) -> list[list[Message]]:
        drawn: list[list[Message]] = []
        for params, existing, mine in zip(lengths, registered, held, strict=True):
            lately = [bits for bits in taken_lately if len(bits) == params.bits]
            taken = existing + [m.bits for m in mine] + lately
            more: list[Message] = []
            for _ in range(max(0, self.size - len(mine))):
                message = self._allocator(taken, params)
                taken.append(message.bits)
                more.append(message)
            drawn.append(more)
        return drawn

    async def aclose(self) -> None:
        if self._refill is not None and not self._refill.done():
            self._refill.cancel()
            await asyncio.gather(self._refill, return_exceptions=True)
