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
* **the end user's limits**, for a request that names one of the account's end users: requests
  and tokens per minute, counted per end user on top of the account's (the end user's own
  override, else the account's end-user override, else the ``end_user_*`` settings; 0 =
  unlimited). One end user at its limit holds back none of the account's other end users.

Per-minute limits use a sliding window approximated from two fixed one-minute windows (the
previous window's count weighted by the part of it still inside the last 60 s, plus the current
one's): memory is two counters per user (and end user) and limit, and a burst at a window boundary
cannot double the rate. Requests in progress are leases that expire ``request_timeout_s`` + a
minute after they were taken, so a slot of a replica that crashed, or one never released, frees
itself.

With ``redis_url`` the caller's counters live in Redis and are shared by every replica (one Lua
script checks and takes the account's and the end user's atomically; keys carry the account in a
hash tag, its end users' keys too, so they share a cluster slot). The queue bound stays per
process: it protects this process's backend. When Redis fails or answers slower than
``redis_timeout_s``, decisions fall back to this process's own counters (limits then hold per
replica), a warning is logged at most every ``REDIS_WARNING_INTERVAL_S`` and every such decision
is counted; Redis is tried again after ``REDIS_RETRY_S``. A Redis outage never fails a request.

Refusals are ``RateLimitError`` (429, ``rate_limit_exceeded``, ``Retry-After``) whose message and
``param`` name the limit: ``queue``, ``max_parallel_requests``, ``requests_per_minute`` or
``tokens_per_minute``; an end user's are 429 ``end_user_rate_limit_exceeded`` with ``param``
``end_user_requests_per_minute`` or ``end_user_tokens_per_minute``. Their messages say "this end
user" and never repeat its identifier (the caller sent it; logs and proxies keep error bodies).
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
END_USER_REQUESTS_PER_MINUTE = "end_user_requests_per_minute"
END_USER_TOKENS_PER_MINUTE = "end_user_tokens_per_minute"
QUEUE = "queue"
END_USER_LIMIT_CODE = "end_user_rate_limit_exceeded"

# KEYS: leases, requests (current window, previous), tokens (current, previous); with an end user,
# its requests (current, previous) and tokens (current, previous)
# ARGV: now_ms, ticket, lease_until_ms, parallel, rpm, tpm, cost, elapsed fraction, window ttl s,
# the end user's rpm and tpm (0 without an end user)
# Returns {0} when admitted (and counted), else {limit number, current, previous}.
_ACQUIRE_LUA = """
local now = tonumber(ARGV[1])
local parallel = tonumber(ARGV[4])
local rpm = tonumber(ARGV[5])
local tpm = tonumber(ARGV[6])
local cost = tonumber(ARGV[7])
local f = tonumber(ARGV[8])
local eurpm = tonumber(ARGV[10])
local eutpm = tonumber(ARGV[11])
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
if eurpm > 0 then
  local cur = tonumber(redis.call('GET', KEYS[6]) or '0')
  local prev = tonumber(redis.call('GET', KEYS[7]) or '0')
  if prev * (1 - f) + cur + 1 > eurpm then return {4, cur, prev} end
end
if eutpm > 0 then
  local cur = tonumber(redis.call('GET', KEYS[8]) or '0')
  local prev = tonumber(redis.call('GET', KEYS[9]) or '0')
  if prev * (1 - f) + cur + cost > eutpm then return {5, cur, prev} end
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
if eurpm > 0 then
  redis.call('INCR', KEYS[6])
  redis.call('EXPIRE', KEYS[6], tonumber(ARGV[9]))
end
if eutpm > 0 then
  redis.call('INCRBY', KEYS[8], cost)
  redis.call('EXPIRE', KEYS[8], tonumber(ARGV[9]))
end
return {0}
"""

# KEYS: leases, then the tokens windows that were charged (the account's, the end user's);
# ARGV: ticket, token correction (may be < 0)
_RELEASE_LUA = """
redis.call('ZREM', KEYS[1], ARGV[1])
local delta = tonumber(ARGV[2])
if delta ~= 0 then
  for i = 2, #KEYS do
    if redis.call('EXISTS', KEYS[i]) == 1 then
      if redis.call('INCRBY', KEYS[i], delta) < 0 then redis.call('SET', KEYS[i], 0, 'KEEPTTL') end
    end
  end
end
return 0
"""

_LIMIT_NAMES = {
    1: PARALLEL,
    2: REQUESTS_PER_MINUTE,
    3: TOKENS_PER_MINUTE,
    4: END_USER_REQUESTS_PER_MINUTE,
    5: END_USER_TOKENS_PER_MINUTE,
}
# the per-minute limits that count requests (the others count tokens)
_REQUEST_COUNTS = (REQUESTS_PER_MINUTE, END_USER_REQUESTS_PER_MINUTE)


def limit_of(*overrides: int | None, default: int) -> int:
    """The first override that is set (not None), else ``default``; 0 means unlimited."""
    return next((value for value in overrides if value is not None), default)


@dataclass(frozen=True)
class UserLimits:
    """A request's limits; 0 means unlimited. The end user's apply to a request that names one of
    the account's end users (0 for any other), on top of the account's."""

    parallel: int
    requests_per_minute: int
    tokens_per_minute: int
    end_user_requests_per_minute: int = 0
    end_user_tokens_per_minute: int = 0

    @classmethod
    def of(cls, principal: Principal, settings: Settings) -> UserLimits:
        end_user = principal.end_user
        return cls(
            parallel=limit_of(principal.max_parallel_requests, default=settings.user_max_parallel_requests),
            requests_per_minute=limit_of(principal.requests_per_minute, default=settings.user_requests_per_minute),
            tokens_per_minute=limit_of(principal.tokens_per_minute, default=settings.user_tokens_per_minute),
            end_user_requests_per_minute=0
            if end_user is None
            else limit_of(
                end_user.requests_per_minute,
                principal.end_user_requests_per_minute,
                default=settings.end_user_requests_per_minute,
            ),
            end_user_tokens_per_minute=0
            if end_user is None
            else limit_of(
                end_user.tokens_per_minute,
                principal.end_user_tokens_per_minute,
                default=settings.end_user_tokens_per_minute,
            ),
        )

    @property
    def tightest_tokens_per_minute(self) -> int:
        """The smallest tokens-per-minute limit the request is under (0: none)."""
        return min((n for n in (self.tokens_per_minute, self.end_user_tokens_per_minute) if n), default=0)

    def value(self, limit: str) -> int:
        """The value of the limit named ``limit`` (a ``param`` of a refusal)."""
        return {
            PARALLEL: self.parallel,
            REQUESTS_PER_MINUTE: self.requests_per_minute,
            TOKENS_PER_MINUTE: self.tokens_per_minute,
            END_USER_REQUESTS_PER_MINUTE: self.end_user_requests_per_minute,
            END_USER_TOKENS_PER_MINUTE: self.end_user_tokens_per_minute,
        }[limit]


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
    if limit in (END_USER_REQUESTS_PER_MINUTE, END_USER_TOKENS_PER_MINUTE):
        return _end_user_refusal(limit, limits, cost, held, wait_s)
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


def _end_user_refusal(limit: str, limits: UserLimits, cost: int, held: float, wait_s: float) -> RateLimitError:
    """An end user's limit: "this end user", never its identifier."""
    allowed = limits.value(limit)
    if limit == END_USER_REQUESTS_PER_MINUTE:
        message = (
            f"Rate limit reached for this end user: {allowed} requests per minute; the account's other end "
            "users are not held back; retry after the wait"
        )
    elif cost > allowed:
        message = (
            f"This request may use {cost} tokens (prompt plus n x max_tokens), more than this end user's limit "
            f"of {allowed} tokens per minute; lower max_tokens or the prompt"
        )
    else:
        message = (
            f"Rate limit reached for this end user: {allowed} tokens per minute (about {int(held)} in use, this "
            f"request reserves {cost}); the account's other end users are not held back; retry after the wait"
        )
    return RateLimitError(message, retry_after_s=max(wait_s, SLOT_RETRY_AFTER_S), code=END_USER_LIMIT_CODE, param=limit)


@dataclass
class _LocalUser:
    """A user's (or an end user's) counters in this process: leases (ticket -> expiry, monotonic)
    and window counts."""

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


def _forget_idle(counters: dict[Any, _LocalUser], now: float, window: int) -> None:
    for key, counted in list(counters.items()):
        counted.prune(now, window)
        if counted.idle:
            del counters[key]


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
    end_user_id: int | None = None  # the account's end user it was admitted for
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
        self._end_users: dict[tuple[int, int], _LocalUser] = {}  # (account, end user)
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
        ``max_queued_requests``) and the caller's allowances (the account's, and its end user's
        when the request names one) for a request reserving ``cost_tokens``; raises
        ``RateLimitError`` (and takes nothing) when a limit is reached. The caller's allowances
        are the same whichever model the request goes to."""
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
        end_user_id = None if principal.end_user is None else principal.end_user.id
        try:
            limits = UserLimits.of(principal, self._settings)
            shared = await self._take_user_allowance(
                ticket_id, principal.user_id, end_user_id, limits, cost_tokens, wall
            )
        except BaseException:
            slots.pop(ticket_id, None)
            raise
        window = int(wall // WINDOW_S)
        return Ticket(self, ticket_id, principal.user_id, cost_tokens, window, shared, queue, end_user_id)

    async def _take_user_allowance(
        self, ticket_id: str, user_id: int, end_user_id: int | None, limits: UserLimits, cost: int, wall: float
    ) -> bool:
        """Check and take the caller's allowances; True when counted in Redis."""
        if not (
            limits.parallel
            or limits.requests_per_minute
            or limits.tokens_per_minute
            or limits.end_user_requests_per_minute
            or limits.end_user_tokens_per_minute
        ):
            return False
        if self._redis_usable():
            try:
                result = await self._redis_acquire(ticket_id, user_id, end_user_id, limits, cost, wall)
                self._take_redis_result(result, limits, cost, wall)
                return True
            except RateLimitError:
                raise
            except Exception as exc:
                self._redis_failed(exc)
        if self._redis is not None:
            self._metrics.admission_redis_fallbacks.inc()
        self._take_local(ticket_id, user_id, end_user_id, limits, cost, wall)
        return False

    def _refuse(
        self, limit: str, limits: UserLimits, cost: int, current: float, previous: float, wall: float
    ) -> RateLimitError:
        elapsed = (wall % WINDOW_S) / WINDOW_S
        if limit == PARALLEL:
            wait, held = SLOT_RETRY_AFTER_S, current
        else:
            amount = 1 if limit in _REQUEST_COUNTS else cost
            wait = window_wait_s(current, previous, elapsed, amount, limits.value(limit))
            held = previous * (1 - elapsed) + current
        self._metrics.admission_refusals.labels(limit=limit).inc()
        return _refusal(limit, limits, cost, held, wait)

    # -- this process's counters ---------------------------------------------------------------

    def _take_local(
        self, ticket_id: str, user_id: int, end_user_id: int | None, limits: UserLimits, cost: int, wall: float
    ) -> None:
        now = time.monotonic()
        window, elapsed = int(wall // WINDOW_S), (wall % WINDOW_S) / WINDOW_S
        self._admitted += 1
        if self._admitted % 1024 == 0:  # forget users and end users with nothing counted any more
            _forget_idle(self._users, now, window)
            _forget_idle(self._end_users, now, window)
        user = self._users.setdefault(user_id, _LocalUser())
        # pruned only where it can change the outcome: windows once a new one begins, leases (each
        # released with its request; expired only if one outlived it) when they are at the limit
        if user.window != window:
            user.prune_windows(window)
        if limits.parallel and len(user.leases) >= limits.parallel:
            user.prune_leases(now)
        if limits.parallel and len(user.leases) >= limits.parallel:
            raise self._refuse(PARALLEL, limits, cost, len(user.leases), 0, wall)
        windows = [
            (user, "r", limits.requests_per_minute, 1, REQUESTS_PER_MINUTE),
            (user, "t", limits.tokens_per_minute, cost, TOKENS_PER_MINUTE),
        ]
        if end_user_id is not None and (limits.end_user_requests_per_minute or limits.end_user_tokens_per_minute):
            end_user = self._end_users.setdefault((user_id, end_user_id), _LocalUser())
            if end_user.window != window:
                end_user.prune_windows(window)
            windows += [
                (end_user, "r", limits.end_user_requests_per_minute, 1, END_USER_REQUESTS_PER_MINUTE),
                (end_user, "t", limits.end_user_tokens_per_minute, cost, END_USER_TOKENS_PER_MINUTE),
            ]
        for counted, kind, limit, amount, name in windows:
            current, previous = counted.count(kind, window), counted.count(kind, window - 1)
            if limit and previous * (1 - elapsed) + current + amount > limit:
                raise self._refuse(name, limits, cost, current, previous, wall)
        if limits.parallel:
            user.leases[ticket_id] = now + self.lease_s
        for counted, kind, limit, amount, _ in windows:
            if limit:
                counted.windows[(kind, window)] = counted.count(kind, window) + amount

    def _release_local(self, ticket: Ticket, correction: int) -> None:
        user = self._users.get(ticket.user_id)
        if user is not None:
            user.leases.pop(ticket.id, None)
        end_user = None if ticket.end_user_id is None else self._end_users.get((ticket.user_id, ticket.end_user_id))
        key = ("t", ticket.window)
        for counted in (user, end_user):
            if counted is not None and correction and key in counted.windows:
                counted.windows[key] = max(0, counted.windows[key] + correction)

    # -- Redis ---------------------------------------------------------------------------------

    def _keys(self, user_id: int, window: int, end_user_id: int | None = None) -> list[str]:
        """The account's keys (leases, requests and tokens of this window and the previous one),
        then, with an end user, the end user's requests and tokens windows."""
        base = f"{self._prefix}{{{user_id}}}"  # hash tag: an account's keys share a cluster slot
        keys = [
            f"{base}:leases",
            f"{base}:r:{window}",
            f"{base}:r:{window - 1}",
            f"{base}:t:{window}",
            f"{base}:t:{window - 1}",
        ]
        if end_user_id is not None:  # under the account's hash tag: one script takes both
            end_user = f"{base}:eu:{end_user_id}"
            keys += [
                f"{end_user}:r:{window}",
                f"{end_user}:r:{window - 1}",
                f"{end_user}:t:{window}",
                f"{end_user}:t:{window - 1}",
            ]
        return keys

    @property
    def redis(self) -> Redis | None:
        """The Redis connection the limits are shared through (None: counted in this process)."""
        return self._redis

    def _redis_usable(self) -> bool:
        return self._redis is not None and time.monotonic() >= self._redis_skip_until

    async def _redis_acquire(
        self, ticket_id: str, user_id: int, end_user_id: int | None, limits: UserLimits, cost: int, wall: float
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
            0 if end_user_id is None else limits.end_user_requests_per_minute,
            0 if end_user_id is None else limits.end_user_tokens_per_minute,
        ]
        keys = self._keys(user_id, window, end_user_id)
        async with asyncio.timeout(self._settings.redis_timeout_s):
            result = await self._acquire_script(keys=keys, args=args)
        return list(result)

    def _take_redis_result(self, result: list[Any], limits: UserLimits, cost: int, wall: float) -> None:
        code = int(result[0])
        if code:
            raise self._refuse(_LIMIT_NAMES[code], limits, cost, float(result[1]), float(result[2]), wall)

    async def _redis_release(self, ticket: Ticket, correction: int) -> None:
        assert self._release_script is not None
        keys = self._keys(ticket.user_id, ticket.window, ticket.end_user_id)
        charged = [keys[0], keys[3], *keys[7:8]]  # leases, the tokens windows (account, end user)
        try:
            async with asyncio.timeout(self._settings.redis_timeout_s):
                await self._release_script(keys=charged, args=[ticket.id, correction])
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
