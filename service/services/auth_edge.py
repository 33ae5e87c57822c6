"""Failed authentication per client address: a budget, then refusals without a database read.

A key that is not cached costs one database read (``service.services.auth``); a client sending
distinct, well-formed random keys would otherwise set the database's pace. So each client address
(``service.client_address``: the peer, or a trusted proxy's ``X-Forwarded-For``; IPv6 by its /64)
has a budget:

* ``auth_edge_failures`` refused reads within ``auth_edge_window_s`` start a **back-off** of
  ``auth_edge_backoff_s``. The address stays *penalised* until a whole window has passed after its
  last back-off ended: a refused read after a back-off ended starts the next one, twice as long,
  up to ``auth_edge_backoff_max_s``; a refused read during a back-off does not lengthen it.
* While an address is penalised, a key not known to be valid is refused with the same 401 as any
  unknown key (``Invalid API key``), without a database read; except that **one read per**
  ``auth_edge_probe_interval_s`` is still made (the first request after the interval), so that a
  valid key never seen before, sent from that address, is served on a retry: the flood costs at
  most one query per interval per address. (Reads already under way when the budget runs out,
  at most one per connection, still finish.)
* A refusal at the edge is answered ``auth_edge_refusal_delay_s`` late (at most
  ``auth_edge_max_delayed`` at once per process; beyond that at once): a client that floods on a
  few connections then sends a few requests per second instead of thousands, and leaves the
  event loop to the other clients. The 401 itself is the one any unknown key gets; its lateness
  tells a client it is backed off, which is what a 429 would have told it.
* A key known to be valid is never held back: one in the authentication cache (answered before
  this is asked), one that was accepted within ``auth_edge_known_key_ttl_s``, or one issued by
  this process within that time (remembered here by a prefix of its HMAC, at most
  ``auth_edge_known_keys`` of them). A key issued through another replica and never used yet is
  what the probe is for.

With ``redis_url`` an address's counts and back-off live in Redis (one hash per address, a Lua
script each for the check and the failure), so failures count across replicas; a back-off learnt
from Redis is remembered here, so that refusals during it need no Redis call either. Redis failing
or slower than ``redis_timeout_s`` means this process's own counts for ``REDIS_RETRY_S``; never an
error. In-process, at most ``auth_edge_max_addresses`` addresses are tracked (least recently seen
leave first).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import event

from service.client_address import ClientAddressResolver, parse_networks
from service.errors import AuthenticationError
from service.models import ApiKey

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from service.config import Settings
    from service.metrics import Metrics

logger = logging.getLogger("xmark.auth")

DEFAULT_KEY_PREFIX = "xmark:auth-edge:"
# after a Redis failure, count in this process for this long before trying Redis again
REDIS_RETRY_S = 5.0
REDIS_WARNING_INTERVAL_S = 30.0
_KNOWN_HASH_CHARS = 32  # 128 bits of the key's HMAC identify it among the keys remembered
_MAX_LEVEL = 30  # the back-off doubles at most this often (the cap is reached long before)

# KEYS: the address's hash. ARGV: now_ms, probe_interval_ms, window_ms.
# Returns {allowed, blocked_until_ms, probe_at_ms, level}; takes the probe when it is due.
_CHECK_LUA = """
local now = tonumber(ARGV[1])
local s = redis.call('HMGET', KEYS[1], 'until', 'probe', 'level')
local blocked = tonumber(s[1]) or 0
local probe = tonumber(s[2]) or 0
local level = tonumber(s[3]) or 0
if level == 0 or now >= blocked + tonumber(ARGV[3]) then return {1, blocked, probe, 0} end
if now >= probe then
  probe = now + tonumber(ARGV[2])
  redis.call('HSET', KEYS[1], 'probe', probe)
  return {1, blocked, probe, level}
end
return {0, blocked, probe, level}
"""

# KEYS: the address's hash. ARGV: now_ms, budget, window_ms, backoff_ms, backoff_max_ms,
# probe_interval_ms, max_level. Returns {started, blocked_until_ms, probe_at_ms, level}.
_FAIL_LUA = """
local now = tonumber(ARGV[1])
local window = tonumber(ARGV[3])
local s = redis.call('HMGET', KEYS[1], 'n', 'start', 'level', 'until', 'probe')
local n = tonumber(s[1]) or 0
local start = tonumber(s[2]) or 0
local level = tonumber(s[3]) or 0
local blocked = tonumber(s[4]) or 0
local probe = tonumber(s[5]) or 0
if level > 0 and now >= blocked + window then level = 0 end
if now - start >= window then
  n = 0
  start = now
end
n = n + 1
local started = 0
if now >= blocked and (level > 0 or n >= tonumber(ARGV[2])) then
  local exponent = math.min(level, tonumber(ARGV[7]))
  blocked = now + math.floor(math.min(tonumber(ARGV[4]) * 2 ^ exponent, tonumber(ARGV[5])))
  probe = now + tonumber(ARGV[6])
  level = level + 1
  n = 0
  started = 1
end
redis.call('HSET', KEYS[1], 'n', n, 'start', start, 'level', level, 'until', blocked, 'probe', probe)
redis.call('PEXPIRE', KEYS[1], math.max(blocked - now, 0) + 2 * window)
return {started, blocked, probe, level}
"""


def edge_refusal() -> AuthenticationError:
    """The answer to a key refused at the edge: the very 401 an unknown key gets from the database."""
    return AuthenticationError("Invalid API key", headers={"WWW-Authenticate": "Bearer"})


@dataclass(frozen=True, slots=True)
class EdgePolicy:
    """The budget and back-off of failed authentications per address (seconds)."""

    failures: int = 20
    window_s: float = 60.0
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    probe_interval_s: float = 1.0
    refusal_delay_s: float = 1.0
    max_delayed: int = 256

    @classmethod
    def from_settings(cls, settings: Settings) -> EdgePolicy:
        return cls(
            failures=settings.auth_edge_failures,
            window_s=settings.auth_edge_window_s,
            backoff_s=settings.auth_edge_backoff_s,
            backoff_max_s=settings.auth_edge_backoff_max_s,
            probe_interval_s=settings.auth_edge_probe_interval_s,
            refusal_delay_s=settings.auth_edge_refusal_delay_s,
            max_delayed=settings.auth_edge_max_delayed,
        )

    def backoff(self, level: int) -> float:
        """The length of back-off number ``level`` (0 the first)."""
        return min(self.backoff_s * 2.0 ** min(level, _MAX_LEVEL), self.backoff_max_s)


@dataclass(slots=True)
class AddressState:
    """One address: refused reads in the current window, its back-off (wall-clock seconds)."""

    failures: int = 0
    window_start: float = 0.0
    level: int = 0  # back-offs since the address was last quiet for a window
    blocked_until: float = 0.0
    probe_at: float = 0.0

    def backed_off(self, now: float) -> bool:
        return now < self.blocked_until

    def penalised(self, now: float, window_s: float) -> bool:
        """Backed off, or a back-off ended less than a window ago: reads are probes."""
        return self.level > 0 and now < self.blocked_until + window_s


class AuthEdge:
    """The per-address budget of failed authentications (see the module docstring)."""

    def __init__(
        self,
        policy: EdgePolicy,
        metrics: Metrics,
        *,
        resolver: ClientAddressResolver | None = None,
        redis: Redis | None = None,
        redis_timeout_s: float = 0.25,
        max_addresses: int = 100_000,
        known_keys: int = 100_000,
        known_key_ttl_s: float = 86_400.0,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if max_addresses <= 0 or known_keys <= 0:
            raise ValueError("max_addresses and known_keys must be positive")
        self.policy = policy
        self.resolver = resolver or ClientAddressResolver()
        self._metrics = metrics
        self._redis = redis
        self._redis_timeout_s = redis_timeout_s
        self._prefix = key_prefix
        self._clock = clock
        self.max_addresses = max_addresses
        self.known_keys = known_keys
        self.known_key_ttl_s = known_key_ttl_s
        self._addresses: OrderedDict[str, AddressState] = OrderedDict()
        self._known: OrderedDict[str, float] = OrderedDict()  # key HMAC prefix -> remembered until
        self._check = redis.register_script(_CHECK_LUA) if redis is not None else None
        self._fail = redis.register_script(_FAIL_LUA) if redis is not None else None
        self._redis_skip_until = 0.0
        self._last_warning = -math.inf
        self._delayed = 0  # refusals waiting out their delay

    @classmethod
    def from_settings(cls, settings: Settings, metrics: Metrics, redis: Redis | None = None) -> AuthEdge:
        """The edge of a gateway process; it remembers the keys the process issues as valid."""
        edge = cls(
            EdgePolicy.from_settings(settings),
            metrics,
            resolver=ClientAddressResolver(
                parse_networks(settings.trusted_proxies),
                settings.auth_edge_ipv6_prefix,
                parse_networks(settings.auth_edge_exempt),
            ),
            redis=redis,
            redis_timeout_s=settings.redis_timeout_s,
            max_addresses=settings.auth_edge_max_addresses,
            known_keys=settings.auth_edge_known_keys,
            known_key_ttl_s=settings.auth_edge_known_key_ttl_s,
        )
        edge.remember_issued_keys()
        return edge

    def remember_issued_keys(self) -> None:
        """Remember every API key inserted by this process from now on as valid (a key issued a
        moment ago is used from a backed-off address without waiting for a probe)."""
        edge = weakref.ref(self)  # the listener outlives no edge: it holds none

        def inserted(_mapper: object, _connection: object, key: ApiKey) -> None:
            live = edge()
            if live is not None:
                live._remember_valid(key.key_hash)

        event.listen(ApiKey, "after_insert", inserted)

    @property
    def enabled(self) -> bool:
        return self.policy.failures > 0

    def address(self, peer: str | None, forwarded_for: Sequence[str] = ()) -> str | None:
        """The address bucket a request is counted in (None: an exempt address, not counted)."""
        return self.resolver.bucket(peer, forwarded_for)

    def __len__(self) -> int:
        return len(self._addresses)

    def state(self, address: str) -> AddressState | None:
        """What this process knows of ``address`` (for inspection)."""
        return self._addresses.get(address)

    # -- keys known to be valid --------------------------------------------------------------

    def known_valid(self, key_hash: str) -> bool:
        """Whether the key of ``key_hash`` was accepted less than ``known_key_ttl_s`` ago."""
        until = self._known.get(key_hash[:_KNOWN_HASH_CHARS])
        return until is not None and self._clock() < until

    def _remember_valid(self, key_hash: str) -> None:
        if self.known_key_ttl_s <= 0:
            return
        short = key_hash[:_KNOWN_HASH_CHARS]
        self._known[short] = self._clock() + self.known_key_ttl_s
        self._known.move_to_end(short)
        while len(self._known) > self.known_keys:
            self._known.popitem(last=False)

    # -- the budget --------------------------------------------------------------------------

    def _state(self, address: str) -> AddressState:
        state = self._addresses.get(address)
        if state is None:
            state = self._addresses[address] = AddressState()
            while len(self._addresses) > self.max_addresses:
                self._addresses.popitem(last=False)
        else:
            self._addresses.move_to_end(address)
        return state

    async def allow_read(self, address: str) -> bool:
        """Whether a key from ``address`` that is not known to be valid may be read from the
        database now; False (counted) means: answer :func:`edge_refusal` without reading."""
        now = self._clock()
        state = self._state(address)
        if state.penalised(now, self.policy.window_s) and now < state.probe_at:
            allowed = False  # penalised (here, or learnt from Redis) and the probe is not due
        elif self._redis_usable():
            allowed = await self._redis_allow(address, state, now)
        else:
            allowed = self._local_allow(state, now)
        if not allowed:
            self._metrics.auth_edge_refusals.inc()
        return allowed

    async def delay_refusal(self) -> None:
        """Wait ``refusal_delay_s`` before a refusal at the edge is answered (at once when
        ``max_delayed`` refusals are waiting already)."""
        if self.policy.refusal_delay_s <= 0 or self._delayed >= self.policy.max_delayed:
            return
        self._delayed += 1
        try:
            await asyncio.sleep(self.policy.refusal_delay_s)
        finally:
            self._delayed -= 1

    def _local_allow(self, state: AddressState, now: float) -> bool:
        if not state.penalised(now, self.policy.window_s):
            return True
        if now >= state.probe_at:
            state.probe_at = now + self.policy.probe_interval_s
            return True
        return False

    async def read_done(self, address: str | None, key_hash: str, *, accepted: bool) -> None:
        """Account a database read of a key sent from ``address``: an accepted key is remembered
        as valid, a refused one (401: unknown or revoked) counts against the address. A key of a
        disabled or deleted user (403) is neither: it exists, and it is not what a guess finds.
        Never raises."""
        self._metrics.auth_key_reads.labels(result="accepted" if accepted else "refused").inc()
        if accepted:
            self._remember_valid(key_hash)
            return
        self._known.pop(key_hash[:_KNOWN_HASH_CHARS], None)
        if address is None or not self.enabled:
            return
        now = self._clock()
        state = self._state(address)
        started = None
        if self._redis_usable():
            started = await self._redis_failed(address, state, now)
        if started is None:
            started = self._local_failed(state, now)
        if started:
            self._metrics.auth_edge_backoffs.inc()

    def _local_failed(self, state: AddressState, now: float) -> bool:
        """Count one refused read; True when it starts a back-off."""
        policy = self.policy
        if state.level and now >= state.blocked_until + policy.window_s:
            state.level = 0  # quiet for a whole window after its last back-off: forgiven
        if now - state.window_start >= policy.window_s:
            state.failures, state.window_start = 0, now
        state.failures += 1
        if state.backed_off(now) or (state.level == 0 and state.failures < policy.failures):
            return False
        state.blocked_until = now + policy.backoff(state.level)
        state.probe_at = now + policy.probe_interval_s
        state.level += 1
        state.failures = 0
        return True

    # -- Redis ---------------------------------------------------------------------------------

    def _key(self, address: str) -> str:
        return f"{self._prefix}{{{address}}}"

    def _redis_usable(self) -> bool:
        return self._redis is not None and time.monotonic() >= self._redis_skip_until

    async def _redis_call(self, script: Any, address: str, args: list[int]) -> list[int] | None:
        try:
            async with asyncio.timeout(self._redis_timeout_s):
                result = await script(keys=[self._key(address)], args=args)
            return [int(value) for value in result]
        except Exception as exc:  # down, slow or refusing: this process's own counts decide
            now = time.monotonic()
            self._redis_skip_until = now + REDIS_RETRY_S
            self._metrics.auth_edge_redis_errors.inc()
            if now - self._last_warning >= REDIS_WARNING_INTERVAL_S:
                self._last_warning = now
                logger.warning(
                    "Redis unavailable: failed authentications are counted per process",
                    extra={"error_type": type(exc).__name__, "retry_in_s": REDIS_RETRY_S},
                )
            return None

    async def _redis_allow(self, address: str, state: AddressState, now: float) -> bool:
        args = [_ms(now), _ms(self.policy.probe_interval_s), _ms(self.policy.window_s)]
        result = await self._redis_call(self._check, address, args)
        if result is None:
            return self._local_allow(state, now)
        allowed, blocked_ms, probe_ms, level = result
        state.blocked_until, state.probe_at, state.level = blocked_ms / 1000, probe_ms / 1000, level
        return bool(allowed)

    async def _redis_failed(self, address: str, state: AddressState, now: float) -> bool | None:
        policy = self.policy
        args = [
            _ms(now),
            policy.failures,
            _ms(policy.window_s),
            _ms(policy.backoff_s),
            _ms(policy.backoff_max_s),
            _ms(policy.probe_interval_s),
            _MAX_LEVEL,
        ]
        result = await self._redis_call(self._fail, address, args)
        if result is None:
            return None
        started, blocked_ms, probe_ms, level = result
        state.blocked_until, state.probe_at, state.level = blocked_ms / 1000, probe_ms / 1000, level
        return bool(started)


def _ms(seconds: float) -> int:
    return int(seconds * 1000)
