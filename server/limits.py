"""Rate limits and caps, each with an injectable clock (trio.current_time by
default, so tests can drive them with trio's MockClock).

* TokenBucket / KeyedRateLimiter: a burst, then a steady rate (commands per
  connection, signals per member).
* LoginThrottle: growing delays after failed logins and failed `auth`, per
  account and per source address.
* ConnectionAdmission: caps on connections in all, on those not yet
  authenticated, and on those not yet authenticated from one address.
* Slots: at most N holders at once, the rest waiting in order.
"""

from __future__ import annotations

import contextlib
import logging
import resource
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import trio

from protocol.errors import ErrorCode, ProtocolError

log = logging.getLogger("scopewire.limits")

Clock = Callable[[], float]


class TokenBucket:
    """A burst, then a steady rate (per connection commands, per member signals)."""

    __slots__ = ("rate", "burst", "tokens", "last", "clock")

    def __init__(self, rate_per_second: float, burst: int, clock: Clock = trio.current_time) -> None:
        self.rate = rate_per_second
        self.burst = burst
        self.tokens = float(burst)
        self.last: float | None = None  # read lazily: a bucket may be built outside trio
        self.clock = clock

    def take(self) -> bool:
        now = self.clock()
        if self.last is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class KeyedRateLimiter:
    """A token bucket per key (member, or member and scope).  Over the limit the
    command answers rate_limited (never accept-and-drop).  Bounded: past
    `max_keys` the buckets are forgotten wholesale."""

    def __init__(self, rate_per_second: float, burst: int, max_keys: int = 100_000,
                 clock: Clock = trio.current_time) -> None:
        self.rate = rate_per_second
        self.burst = burst
        self.max_keys = max_keys
        self.clock = clock
        self._buckets: dict[object, TokenBucket] = {}

    def take(self, key: object) -> bool:
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self.max_keys:
                self._buckets.clear()
            bucket = self._buckets[key] = TokenBucket(self.rate, self.burst, self.clock)
        return bucket.take()


# --- failed logins ---------------------------------------------------------------------------------


@dataclass(slots=True)
class _Failures:
    count: int = 0
    last_failure: float = 0.0
    blocked_until: float = 0.0
    in_flight: bool = False  # a throttled key admits one attempt at a time
    warned: bool = False


class LoginThrottle:
    """Exponential backoff after failed credentials (the scheme of OWASP's
    authentication cheat sheet), kept per key: ("account", normalized email)
    and ("address", client IP).

    A key's first `free_failures` failures cost nothing.  Failure number
    free_failures + k (k >= 1) blocks the key for min(base_delay * 2**(k-1),
    max_delay) seconds; while any key of an attempt is blocked the attempt
    answers rate_limited at once, without the password being checked, and
    does not count as a failure.  Past its free failures a key admits one
    attempt at a time (parallel connections cannot slip several guesses in
    when a delay ends).  A key's failures are forgotten `forget_after`
    seconds after its last failure; a successful login clears its account
    key (never the address key: a working account of one's own must not
    reset an address's count).  One warning is logged per key when it first
    becomes blocked, not per attempt."""

    def __init__(self, *, account_free_failures: int = 5, address_free_failures: int = 20, base_delay: float = 1.0,
                 max_delay: float = 900.0, forget_after: float = 3600.0, max_keys: int = 100_000,
                 clock: Clock = trio.current_time) -> None:
        self.free = {"account": account_free_failures, "address": address_free_failures}
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.forget_after = forget_after
        self.max_keys = max_keys
        self.clock = clock
        self._keys: dict[tuple[str, str], _Failures] = {}  # oldest failure first

    @staticmethod
    def keys(*, account: str | None = None, address: str | None = None) -> list[tuple[str, str]]:
        return [k for k in (("account", account), ("address", address)) if k[1] is not None]

    @contextlib.contextmanager
    def attempt(self, keys: list[tuple[str, str]]) -> Iterator[None]:
        """One credential check: rate_limited now if a key is blocked (or busy
        with another attempt); inside, call `failed` or `succeeded`."""
        now = self.clock()
        known = [(key, state) for key in keys if (state := self._keys.get(key)) is not None
                 and now - state.last_failure <= self.forget_after]
        wait = max((state.blocked_until - now for _, state in known), default=0.0)
        if wait > 0 or any(state.in_flight for _, state in known):
            raise ProtocolError(ErrorCode.RATE_LIMITED, "too many failed attempts; wait before trying again",
                                details={"retry_after_seconds": round(max(wait, self.base_delay), 1)})
        throttled = [state for key, state in known if state.count >= self.free[key[0]]]
        for state in throttled:
            state.in_flight = True
        try:
            yield
        finally:
            for state in throttled:
                state.in_flight = False

    def failed(self, keys: list[tuple[str, str]]) -> None:
        now = self.clock()
        for key in keys:
            state = self._keys.pop(key, None)
            if state is None or now - state.last_failure > self.forget_after:
                state = _Failures()
            self._keys[key] = state  # re-inserted: the dict stays ordered by last failure
            state.count += 1
            state.last_failure = now
            beyond = state.count - self.free[key[0]]
            if beyond > 0:
                state.blocked_until = now + min(self.base_delay * 2 ** min(beyond - 1, 30), self.max_delay)
                if not state.warned:
                    state.warned = True
                    log.warning("failed credentials: throttling", extra={"key_kind": key[0], "key": key[1],
                                                                         "failures": state.count})
        while len(self._keys) > self.max_keys:  # forget the stalest first
            del self._keys[next(iter(self._keys))]

    def succeeded(self, keys: list[tuple[str, str]]) -> None:
        for key in keys:
            if key[0] == "account":
                self._keys.pop(key, None)


# Descriptors a server needs besides its client connections (database pool,
# LISTEN connection, listeners, logs, the runtime's own).
DESCRIPTOR_RESERVE = 64


def warn_if_descriptors_short(max_connections: int) -> None:
    """--max-connections only protects the server if it is below the
    descriptor limit; beyond it accept() fails with EMFILE first."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and max_connections + DESCRIPTOR_RESERVE > soft:
        log.warning("--max-connections is above what the descriptor limit allows; raise `ulimit -n` or lower it",
                    extra={"max_connections": max_connections, "descriptor_limit": soft,
                           "reserve": DESCRIPTOR_RESERVE})


# --- connection admission --------------------------------------------------------------------------


class ConnectionAdmission:
    """Counts live connections and refuses new ones beyond the caps.  A
    refusal is logged at most once per `log_interval` seconds, with the
    number refused since the last line."""

    def __init__(self, *, max_connections: int, max_unauthenticated: int, max_unauthenticated_per_address: int,
                 log_interval: float = 10.0, clock: Clock = trio.current_time) -> None:
        self.max_connections = max_connections
        self.max_unauthenticated = max_unauthenticated
        self.max_unauthenticated_per_address = max_unauthenticated_per_address
        self.log_interval = log_interval
        self.clock = clock
        self.total = 0
        self.unauthenticated = 0
        self._unauthenticated_by_address: dict[str, int] = {}
        self._refused_unlogged = 0
        self._next_log = float("-inf")

    def admit(self, address: str) -> bool:
        """Count a new (unauthenticated) connection, or False: refuse it."""
        reason = None
        if self.total >= self.max_connections:
            reason = "max_connections"
        elif self.unauthenticated >= self.max_unauthenticated:
            reason = "max_unauthenticated"
        elif self._unauthenticated_by_address.get(address, 0) >= self.max_unauthenticated_per_address:
            reason = "max_unauthenticated_per_address"
        if reason is not None:
            self._refused(reason, address)
            return False
        self.total += 1
        self.unauthenticated += 1
        self._unauthenticated_by_address[address] = self._unauthenticated_by_address.get(address, 0) + 1
        return True

    def authenticated(self, address: str) -> None:
        self.unauthenticated -= 1
        self._release_address(address)

    def release(self, address: str, *, authenticated: bool) -> None:
        self.total -= 1
        if not authenticated:
            self.unauthenticated -= 1
            self._release_address(address)

    def _release_address(self, address: str) -> None:
        left = self._unauthenticated_by_address[address] - 1
        if left:
            self._unauthenticated_by_address[address] = left
        else:
            del self._unauthenticated_by_address[address]

    def _refused(self, reason: str, address: str) -> None:
        self._refused_unlogged += 1
        now = self.clock()
        if now >= self._next_log:
            log.warning("refusing new connections (HTTP 503)", extra={
                "reason": reason, "address": address, "refused": self._refused_unlogged,
                "connections": self.total, "unauthenticated": self.unauthenticated})
            self._refused_unlogged = 0
            self._next_log = now + self.log_interval


class Slots:
    """`async with slots:` — at most `size` holders at once, the others waiting in
    arrival order; a released slot passes straight to the longest waiter.

    trio.Semaphore would do, but its waiters wait inside `except WouldBlock`, each
    keeping that exception and its traceback alive (~1.9 KB): a reconnect storm queues
    thousands of subscribes here, and that burst, freed between the subscriptions'
    long-lived objects, stays in the allocator's arenas as RSS."""

    __slots__ = ("_free", "_waiting")

    def __init__(self, size: int) -> None:
        self._free = size
        self._waiting = trio.lowlevel.ParkingLot()

    async def __aenter__(self) -> None:
        if self._free and not self._waiting:
            await trio.lowlevel.checkpoint_if_cancelled()
            self._free -= 1
            await trio.lowlevel.cancel_shielded_checkpoint()
        else:
            await self._waiting.park()  # woken holding the slot its releaser passed on

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()

    def acquire_nowait(self) -> None:
        if not self._free or self._waiting:
            raise trio.WouldBlock
        self._free -= 1

    def release(self) -> None:
        if self._waiting:
            self._waiting.unpark()
        else:
            self._free += 1

    @property
    def free(self) -> int:
        return self._free

    @property
    def waiting(self) -> int:
        return len(self._waiting)
