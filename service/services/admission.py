"""Admission control: what a chat request must get past before the backend sees it.

Two kinds of limit, checked in this order when a request arrives:

* **the backend's queue** (``max_queued_requests``, per process): requests admitted to the
  backend and not finished yet, waiting or generating. One more is refused: a backlog longer
  than this would only make every caller wait past their patience.
* **the caller's limits** (``Principal`` overrides, else the ``user_*`` settings; 0 = unlimited):
  requests in progress at once, requests per minute and tokens per minute. Tokens are *reserved*
  up front (prompt tokens + ``n`` x ``max_tokens``, the most the request can cost) and the
  reservation is corrected to the tokens actually used when the request ends, so concurrent
  requests cannot overshoot the budget and a short answer costs only what it used.

Per-minute limits use a sliding window approximated from two fixed one-minute windows (the
previous window's count weighted by the part of it still inside the last 60 s, plus the current
one's): memory is two counters per user and limit, and a burst at a window boundary cannot double
the rate. Requests in progress are leases that expire ``request_timeout_s`` + a minute after they
were taken, so a slot of a replica that crashed, or one never released, frees itself.

With ``redis_url`` the caller's counters live in Redis and are shared by every replica (one Lua
script checks and takes all three atomically; keys carry the user in a hash tag so a user's keys
share a cluster slot). The queue bound stays per process: it protects this process's backend.
When Redis fails or answers slower than ``redis_timeout_s``, decisions fall back to this process's
own counters (limits then hold per replica), a warning is logged at most every
``REDIS_WARNING_INTERVAL_S`` and every such decision is counted; Redis is tried again after
``REDIS_RETRY_S``. A Redis outage never fails a request.

Refusals are ``RateLimitError`` (429, ``rate_limit_exceeded``, ``Retry-After``) whose message and
``param`` name the limit: ``queue``, ``max_parallel_requests``, ``requests_per_minute`` or
``tokens_per_minute``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from service.errors import RateLimitError

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from service.config import Settings
    from service.metrics import Metrics
    from service.schemas.common import Principal

logger = logging.getLogger("xmark.admission")

WINDOW_S = 60  # the per-minute limits' window
# a lease outlives its request's deadline by this much before it expires on its own
LEASE_GRACE_S = 60.0
# after a Redis failure, decide with the process's own counters for this long before trying again
REDIS_RETRY_S = 5.0
REDIS_WARNING_INTERVAL_S = 30.0
DEFAULT_KEY_PREFIX = "xmark:admission:"
# Retry-After when the wait cannot be computed (a slot frees when some request ends)
SLOT_RETRY_AFTER_S = 1.0

PARALLEL = "max_parallel_requests"
REQUESTS_PER_MINUTE = "requests_per_minute"
TOKENS_PER_MINUTE = "tokens_per_minute"
QUEUE = "queue"

# KEYS: leases, requests (current window, previous), tokens (current, previous)
# ARGV: now_ms, ticket, lease_until_ms, parallel, rpm, tpm, cost, elapsed fraction, window ttl s
# Returns {0} when admitted (and counted), else {limit number, current, previous}.
_ACQUIRE_LUA = """
local now = tonumber(ARGV[1])
local parallel = tonumber(ARGV[4])
local rpm = tonumber(ARGV[5])
local tpm = tonumber(ARGV[6])
local cost = tonumber(ARGV[7])
local f = tonumber(ARGV[8])
if parallel > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  local held = redis.call('ZCARD', KEYS[1])
  if held >= parallel then return {1, held, 0} end
end
if rpm > 0 then
  local cur = tonumber(redis.call('GET', KEYS[2]) or '0')
  local prev = tonumber(redis.call('GET', KEYS[3]) or '0')
  if prev * (1 - f) + cur + 1 > rpm then return {2, cur, prev} end
end
if tpm > 0 then
  local cur = tonumber(redis.call('GET', KEYS[4]) or '0')
  local prev = tonumber(redis.call('GET', KEYS[5]) or '0')
  if prev * (1 - f) + cur + cost > tpm then return {3, cur, prev} end
end
if parallel > 0 then
  redis.call('ZADD', KEYS[1], tonumber(ARGV[3]), ARGV[2])
  redis.call('PEXPIREAT', KEYS[1], tonumber(ARGV[3]))
end
if rpm > 0 then
  redis.call('INCR', KEYS[2])
  redis.call('EXPIRE', KEYS[2], tonumber(ARGV[9]))
end
if tpm > 0 then
  redis.call('INCRBY', KEYS[4], cost)
  redis.call('EXPIRE', KEYS[4], tonumber(ARGV[9]))
end
return {0}
"""

# KEYS: leases, the tokens window that was charged; ARGV: ticket, token correction (may be < 0)
_RELEASE_LUA = """
redis.call('ZREM', KEYS[1], ARGV[1])
local delta = tonumber(ARGV[2])
if delta ~= 0 and redis.call('EXISTS', KEYS[2]) == 1 then
  if redis.call('INCRBY', KEYS[2], delta) < 0 then redis.call('SET', KEYS[2], 0, 'KEEPTTL') end
end
return 0
"""

_LIMIT_NAMES = {1: PARALLEL, 2: REQUESTS_PER_MINUTE, 3: TOKENS_PER_MINUTE}


@dataclass(frozen=True)
class UserLimits:
    """A caller's limits; 0 means unlimited."""

    parallel: int
    requests_per_minute: int
    tokens_per_minute: int

    @classmethod
    def of(cls, principal: Principal, settings: Settings) -> UserLimits:
        def pick(override: int | None, default: int) -> int:
            return default if override is None else override

        return cls(
            parallel=pick(principal.max_parallel_requests, settings.user_max_parallel_requests),
            requests_per_minute=pick(principal.requests_per_minute, settings.user_requests_per_minute),
            tokens_per_minute=pick(principal.tokens_per_minute, settings.user_tokens_per_minute),
        )


def window_wait_s(current: float, previous: float, elapsed: float, cost: float, limit: float) -> float:
    """Seconds until ``cost`` fits under ``limit`` in the sliding window (nothing else arriving).

    ``elapsed`` is the fraction of the current fixed window gone by; the window's estimate is
    ``previous * (1 - elapsed) + current``.
    """
    if cost > limit:
        return float(WINDOW_S)  # never fits: the message says so; retrying later is pointless
    if current + cost <= limit:  # only the previous window's tail is in the way: it slides out
        if previous <= 0:
            return 0.0
        needed = 1 - (limit - current - cost) / previous
        return max(0.0, (needed - elapsed) * WINDOW_S)
    # the current window itself is too full: after it rolls over it becomes the previous one
    needed = 1 - (limit - cost) / current if current > 0 else 0.0
    return (1 - elapsed) * WINDOW_S + max(0.0, needed) * WINDOW_S


def _refusal(limit: str, limits: UserLimits, cost: int, held: float, wait_s: float) -> RateLimitError:
    if limit == PARALLEL:
        message = (
            f"Too many requests in progress: your account may have {limits.parallel} parallel requests "
            "at once; retry when one has finished"
        )
    elif limit == REQUESTS_PER_MINUTE:
        message = f"Rate limit reached: {limits.requests_per_minute} requests per minute; retry after the wait"
    elif cost > limits.tokens_per_minute:
        message = (
            f"This request may use {cost} tokens (prompt plus n x max_tokens), more than your limit of "
            f"{limits.tokens_per_minute} tokens per minute; lower max_tokens or the prompt"
        )
    else:
        message = (
            f"Rate limit reached: {limits.tokens_per_minute} tokens per minute (about {int(held)} in use, "
            f"this request reserves {cost}); retry after the wait"
        )
    return RateLimitError(message, retry_after_s=max(wait_s, SLOT_RETRY_AFTER_S), param=limit)


@dataclass
class _LocalUser:
    """A user's counters in this process: leases (ticket -> expiry, monotonic) and window counts."""

    leases: dict[str, float] = field(default_factory=dict)
    windows: dict[tuple[str, int], int] = field(default_factory=dict)
    window: int = -1  # the window the counts were last pruned for

    def count(self, kind: str, window: int) -> int:
        return self.windows.get((kind, window), 0)

    def prune_leases(self, now: float) -> None:
        self.leases = {ticket: until for ticket, until in self.leases.items() if until > now}

    def prune_windows(self, window: int) -> None:
        self.windows = {key: n for key, n in self.windows.items() if key[1] >= window - 1}
        self.window = window

    def prune(self, now: float, window: int) -> None:
        self.prune_leases(now)
        self.prune_windows(window)

    @property
    def idle(self) -> bool:
        return not self.leases and not self.windows


@dataclass(eq=False)
class Ticket:
    """An admitted request's hold on the queue and its caller's limits; ``release`` gives it back."""

    admission: Admission
    id: str
    user_id: int
    reserved_tokens: int
    window: int  # the tokens window the reservation was charged to
    shared: bool  # the caller's counters are in Redis (else in this process)
    queue: str = ""  # the served model's queue it holds a slot of
    released: bool = False

    def release(self, used_tokens: int | None = None) -> None:
        """Free the queue and parallel slots and correct the token reservation to ``used_tokens``
        (None: keep it all charged). Idempotent; never raises; any Redis work runs in the background."""
        if self.released:
            return
        self.released = True
        self.admission.release(self, used_tokens)


class Admission:
    """The gateway's admission point in front of the backend (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        redis: Redis | None = None,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._redis = redis
        self._prefix = key_prefix
        # each served model's queue: ticket -> lease expiry (monotonic)
        self._queues: dict[str, dict[str, float]] = {}
        self._users: dict[int, _LocalUser] = {}
        self._redis_skip_until = 0.0
        self._last_warning = -math.inf
        self._background: set[asyncio.Task[None]] = set()
        self._acquire_script = redis.register_script(_ACQUIRE_LUA) if redis is not None else None
        self._release_script = redis.register_script(_RELEASE_LUA) if redis is not None else None
        self._admitted = 0

    @property
    def lease_s(self) -> float:
        return self._settings.request_timeout_s + LEASE_GRACE_S

    @property
    def queued(self) -> int:
        """Requests admitted to a backend by this process and not finished (leases not expired)."""
        now = time.monotonic()
        return sum(1 for queue in self._queues.values() for until in queue.values() if until > now)

    # -- admission ---------------------------------------------------------------------------

    async def admit(
        self, principal: Principal, cost_tokens: int, *, queue: str = "", max_queued: int | None = None
    ) -> Ticket:
        """Take a slot of ``queue`` (a served model's: at most ``max_queued``, default
        ``max_queued_requests``) and the caller's allowances for a request reserving
        ``cost_tokens``; raises ``RateLimitError`` (and takes nothing) when a limit is reached.
        The caller's allowances are the same whichever model the request goes to."""
        ticket_id = uuid.uuid4().hex
        now = time.monotonic()
        bound = self._settings.max_queued_requests if max_queued is None else max_queued
        slots = self._queues.setdefault(queue, {})
        if len(slots) >= bound:  # full: leases that outlived their request (expired) make room first
            slots = self._queues[queue] = {t: until for t, until in slots.items() if until > now}
        if len(slots) >= bound:
            self._metrics.admission_refusals.labels(limit=QUEUE).inc()
            raise RateLimitError(
                f"The model is busy: {bound} requests are already queued or generating; retry shortly",
                retry_after_s=SLOT_RETRY_AFTER_S,
                param=QUEUE,
            )
        slots[ticket_id] = now + self.lease_s
        wall = time.time()
        try:
            limits = UserLimits.of(principal, self._settings)
            shared = await self._take_user_allowance(ticket_id, principal.user_id, limits, cost_tokens, wall)
        except BaseException:
            slots.pop(ticket_id, None)
            raise
        return Ticket(self, ticket_id, principal.user_id, cost_tokens, int(wall // WINDOW_S), shared, queue)

    async def _take_user_allowance(
        self, ticket_id: str, user_id: int, limits: UserLimits, cost: int, wall: float
    ) -> bool:
        """Check and take the caller's allowances; True when counted in Redis."""
        if not (limits.parallel or limits.requests_per_minute or limits.tokens_per_minute):
            return False
        if self._redis_usable():
            try:
                result = await self._redis_acquire(ticket_id, user_id, limits, cost, wall)
                self._take_redis_result(result, limits, cost, wall)
                return True
            except RateLimitError:
                raise
            except Exception as exc:
                self._redis_failed(exc)
        if self._redis is not None:
            self._metrics.admission_redis_fallbacks.inc()
        self._take_local(ticket_id, user_id, limits, cost, wall)
        return False

    def _refuse(
        self, limit: str, limits: UserLimits, cost: int, current: float, previous: float, wall: float
    ) -> RateLimitError:
        elapsed = (wall % WINDOW_S) / WINDOW_S
        if limit == PARALLEL:
            wait, held = SLOT_RETRY_AFTER_S, current
        elif limit == REQUESTS_PER_MINUTE:
            wait = window_wait_s(current, previous, elapsed, 1, limits.requests_per_minute)
            held = previous * (1 - elapsed) + current
        else:
            wait = window_wait_s(current, previous, elapsed, cost, limits.tokens_per_minute)
            held = previous * (1 - elapsed) + current
        self._metrics.admission_refusals.labels(limit=limit).inc()
        return _refusal(limit, limits, cost, held, wait)

    # -- this process's counters ---------------------------------------------------------------

    def _take_local(self, ticket_id: str, user_id: int, limits: UserLimits, cost: int, wall: float) -> None:
        now = time.monotonic()
        window, elapsed = int(wall // WINDOW_S), (wall % WINDOW_S) / WINDOW_S
        self._admitted += 1
        if self._admitted % 1024 == 0:  # forget users with nothing counted any more
            for uid, counted in list(self._users.items()):
                counted.prune(now, window)
                if counted.idle:
                    del self._users[uid]
        user = self._users.setdefault(user_id, _LocalUser())
        # pruned only where it can change the outcome: windows once a new one begins, leases (each
        # released with its request; expired only if one outlived it) when they are at the limit
        if user.window != window:
            user.prune_windows(window)
        if limits.parallel and len(user.leases) >= limits.parallel:
            user.prune_leases(now)
        if limits.parallel and len(user.leases) >= limits.parallel:
            raise self._refuse(PARALLEL, limits, cost, len(user.leases), 0, wall)
        for kind, limit, amount, name in (
            ("r", limits.requests_per_minute, 1, REQUESTS_PER_MINUTE),
            ("t", limits.tokens_per_minute, cost, TOKENS_PER_MINUTE),
        ):
            current, previous = user.count(kind, window), user.count(kind, window - 1)
            if limit and previous * (1 - elapsed) + current + amount > limit:
                raise self._refuse(name, limits, cost, current, previous, wall)
        if limits.parallel:
            user.leases[ticket_id] = now + self.lease_s
        if limits.requests_per_minute:
            user.windows[("r", window)] = user.count("r", window) + 1
        if limits.tokens_per_minute:
            user.windows[("t", window)] = user.count("t", window) + cost

    def _release_local(self, ticket: Ticket, correction: int) -> None:
        user = self._users.get(ticket.user_id)
        if user is None:
            return
        user.leases.pop(ticket.id, None)
        key = ("t", ticket.window)
        if correction and key in user.windows:
            user.windows[key] = max(0, user.windows[key] + correction)

    # -- Redis ---------------------------------------------------------------------------------

    def _keys(self, user_id: int, window: int) -> list[str]:
        base = f"{self._prefix}{{{user_id}}}"  # hash tag: a user's keys share a cluster slot
        return [
            f"{base}:leases",
            f"{base}:r:{window}",
            f"{base}:r:{window - 1}",
            f"{base}:t:{window}",
            f"{base}:t:{window - 1}",
        ]

    @property
    def redis(self) -> Redis | None:
        """The Redis connection the limits are shared through (None: counted in this process)."""
        return self._redis

    def _redis_usable(self) -> bool:
        return self._redis is not None and time.monotonic() >= self._redis_skip_until

    async def _redis_acquire(
        self, ticket_id: str, user_id: int, limits: UserLimits, cost: int, wall: float
    ) -> list[Any]:
        assert self._acquire_script is not None
        window, elapsed = int(wall // WINDOW_S), (wall % WINDOW_S) / WINDOW_S
        now_ms = int(wall * 1000)
        args: list[int | float | str] = [
            now_ms,
            ticket_id,
            now_ms + int(self.lease_s * 1000),
            limits.parallel,
            limits.requests_per_minute,
            limits.tokens_per_minute,
            cost,
            repr(elapsed),
            2 * WINDOW_S + 10,
        ]
        async with asyncio.timeout(self._settings.redis_timeout_s):
            result = await self._acquire_script(keys=self._keys(user_id, window), args=args)
        return list(result)

    def _take_redis_result(self, result: list[Any], limits: UserLimits, cost: int, wall: float) -> None:
        code = int(result[0])
        if code:
            raise self._refuse(_LIMIT_NAMES[code], limits, cost, float(result[1]), float(result[2]), wall)

    async def _redis_release(self, ticket: Ticket, correction: int) -> None:
        assert self._release_script is not None
        keys = self._keys(ticket.user_id, ticket.window)
        try:
            async with asyncio.timeout(self._settings.redis_timeout_s):
                await self._release_script(keys=[keys[0], keys[3]], args=[ticket.id, correction])
        except Exception as exc:  # the lease expires on its own; the tokens stay charged
            self._redis_failed(exc)

    def _redis_failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        self._redis_skip_until = now + REDIS_RETRY_S
        self._metrics.admission_redis_errors.inc()
        if now - self._last_warning >= REDIS_WARNING_INTERVAL_S:
            self._last_warning = now
            logger.warning(
                "Redis unavailable: admission limits are counted per process",
                extra={"error_type": type(exc).__name__, "retry_in_s": REDIS_RETRY_S},
            )

    # -- release -------------------------------------------------------------------------------

    def release(self, ticket: Ticket, used_tokens: int | None) -> None:
        """``Ticket.release``: the local part at once, the Redis part in the background."""
        self._queues.get(ticket.queue, {}).pop(ticket.id, None)
        correction = 0 if used_tokens is None else used_tokens - ticket.reserved_tokens
        if not ticket.shared:
            self._release_local(ticket, correction)
            return
        try:
            task = asyncio.get_running_loop().create_task(self._redis_release(ticket, correction))
        except RuntimeError:  # no loop any more (shutting down): the lease expires on its own
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def flush(self) -> None:
        """Wait until every release on its way to Redis has been applied (or has failed)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    async def close(self) -> None:
        """Wait for releases still on their way to Redis, then close the connection pool."""
        await self.flush()
        if self._redis is not None:
            with contextlib.suppress(Exception):
                await self._redis.aclose()


def redis_client(url: str, timeout_s: float) -> Redis:
    """A Redis client that fails fast: no retries, connect and socket timeouts of ``timeout_s``."""
    from redis.asyncio import Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    return Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        decode_responses=False,
    )


@contextlib.asynccontextmanager
async def open_admission(settings: Settings, metrics: Metrics) -> AsyncIterator[Admission]:
    """The process's admission point; with ``redis_url`` its counters are shared through Redis
    (connected lazily: a Redis that is down at start-up only means per-process limits for now)."""
    redis = None
    if settings.redis_url is not None:
        redis = redis_client(settings.redis_url.get_secret_value(), settings.redis_timeout_s)
    admission = Admission(settings, metrics, redis)
    try:
        yield admission
    finally:
        await admission.close()
