"""Overload control: per-caller rate limits, the engine-queue bound's error,
and the counters the metrics exporter reads.

Contract:
  * Rate limits (KVHINT_RATE_LIMIT_HINTS_PER_S, KVHINT_RATE_LIMIT_BURST; 0 =
    unlimited) are token buckets, one per principal (`principal_of`). A bucket
    holds at most `burst` tokens and refills at `rate` tokens per second, so in
    any interval of t seconds a principal is admitted at most rate*t + burst
    tokens. ApplyHints costs one token per hint (validation.apply_cost: a
    block_hashes selector one per 64 of its hashes); QueryResidency, ListSessions
    and WatchEvents cost one per call; GetCapabilities and GetOperation are
    free (they never touch the engine thread). A call over its limit fails
    RESOURCE_EXHAUSTED (ErrorInfo reason REASON_RESOURCE_EXHAUSTED, metadata
    cause=rate_limited) with a google.rpc.RetryInfo saying when the same call
    would be admitted; it changes nothing. A batch larger than the burst can
    never be admitted and says so (no RetryInfo: split the batch). With
    tenancy, a tenant's own `rate_limit_hints_per_s` / `rate_limit_burst`
    (tenants file) replace the default for its bucket, and apply even when
    the default is unlimited.
  * The engine-thread queue holds at most KVHINT_MAX_PENDING_TASKS tasks from
    RPCs (KvHintCore.submit/submit_slice with bounded=True). Past it the
    submit fails with QueueFull, the RPC RESOURCE_EXHAUSTED (cause=queue_full)
    with RetryInfo = the recent queue wait, and nothing of the request ran.
  * `OverloadStats` counts rejections and deferred work for the metrics
    exporter (plain ints: read from any thread, written under the GIL).

`principal_of(context)` is the one place that decides who a caller is; today
it is a hash of the presented `authorization` header (only as trustworthy as
the server's authentication: without KVHINT_AUTH_TOKEN anyone may present
any header), else the peer's host.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from .credentials import RepeatedAuthorization, authorization

#: Causes in ErrorInfo.metadata["cause"] and the rejections metric's label.
CAUSE_QUEUE_FULL = "queue_full"
CAUSE_RATE_LIMITED = "rate_limited"
CAUSE_WATCH_STREAMS = "watch_streams"  # WatchEvents: KVHINT_MAX_WATCH_STREAMS open (watch.py)
CAUSE_TENANT_WATCH_STREAMS = "tenant_watch_streams"  # WatchEvents: the tenant's KVHINT_MAX_WATCH_STREAMS_PER_TENANT
#: Bounds of the RetryInfo a full queue advertises (seconds).
MIN_QUEUE_RETRY_S, MAX_QUEUE_RETRY_S = 0.005, 1.0
#: Principals whose buckets are remembered at most (least recently used go;
#: a forgotten bucket comes back full, which only ever admits what an idle
#: principal's full bucket would have).
MAX_PRINCIPALS = 65_536


F = TypeVar("F", bound=Future)

#: The part of KVHINT_MAX_PENDING_TASKS one tenant's tasks may hold (TenantQueueShares).
TENANT_QUEUE_SHARE = 0.5


class QueueFull(RuntimeError):
    """The engine-thread queue (or the calling tenant's share of it) is at its bound; nothing was queued."""

    def __init__(self, pending: int, bound: int, retry_after: float, queue: str = "the engine queue") -> None:
        super().__init__(f"{queue} is full ({pending} tasks pending, bound {bound})")
        self.pending = pending
        self.bound = bound
        self.retry_after = retry_after


@dataclass
class OverloadStats:
    """Monotonic counters (read by kvhint_server.metrics)."""

    queue_full: int = 0  # submits refused at the queue bound
    rate_limited: int = 0  # calls refused by a rate limit
    watch_streams: int = 0  # WatchEvents calls refused at the server's open-stream bound
    tenant_watch_streams: int = 0  # WatchEvents calls refused at their tenant's open-stream bound
    deferred_batches: int = 0  # ApplyHints batches that waited past >= 1 step budget
    budget_cutoffs: int = 0  # steps that ended with tasks left for the next one


def principal_of(context: Any) -> str:
    """A stable key for the caller of an RPC (grpc ServicerContext).

    The hash of the `authorization` header when one is presented, else the
    peer's host (port dropped: a client's reconnects stay one principal).
    With tenancy, the servicer keys buckets by the tenant name instead.
    """
    try:
        value = authorization(context.invocation_metadata())
    except RepeatedAuthorization:  # refused by the interceptors; without auth, one key for every value
        value = b"\n".join(v.encode() if isinstance(v, str) else bytes(v)
                           for k, v in context.invocation_metadata() if k == "authorization")
    if value is not None:
        raw = value.encode() if isinstance(value, str) else bytes(value)
        return "token:" + hashlib.sha256(raw).hexdigest()[:16]
    peer = context.peer() or ""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return "peer:" + rest.rsplit(":", 1)[0]
    return "peer:" + peer


class TokenBucket:
    """`burst` tokens at most, refilled at `rate` per second (from full)."""

    __slots__ = ("rate", "burst", "tokens", "stamp")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = float(burst)
        self.stamp = now

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now

    def take(self, cost: float, now: float) -> float:
        """Take `cost` tokens: 0.0 if admitted, else the seconds until they
        would be there (math.inf if cost > burst). Takes nothing unless admitted."""
        self._refill(now)
        if cost <= self.tokens:
            self.tokens -= cost
            return 0.0
        if cost > self.burst:
            return math.inf
        return (cost - self.tokens) / self.rate

    def give_back(self, cost: float) -> None:
        self.tokens = min(self.burst, self.tokens + cost)


@dataclass(frozen=True)
class Limit:
    """A token bucket's shape: `rate` tokens per second, at most `burst` held."""

    rate: float
    burst: int

    @classmethod
    def of(cls, rate: float, burst: int = 0) -> Limit:
        """Burst 0: one second's worth, at least one token."""
        if not rate > 0 or math.isinf(rate):
            raise ValueError("rate must be a finite number > 0")
        return cls(rate, burst if burst > 0 else max(1, math.ceil(rate)))


class RateLimiter:
    """Token buckets per principal (thread-safe).

    Each principal's bucket has the shape passed with its first call (`own`,
    e.g. a tenant's limit from the tenants file) or else the default one;
    a principal with neither is not limited."""

    def __init__(self, rate: float | None, burst: int = 0, clock: Callable[[], float] = time.monotonic,
                 max_principals: int = MAX_PRINCIPALS) -> None:
        self.default: Limit | None = None if rate is None else Limit.of(rate, burst)
        self._clock = clock
        self._max = max_principals
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: Any, clock: Callable[[], float] = time.monotonic) -> RateLimiter | None:
        """The limiter the config asks for: the default rate, and any tenant's own
        (`Tenant.rate_limit`); None when nobody is limited."""
        own = config.tenants is not None and any(t.rate_limit is not None for t in config.tenants.tenants)
        if config.rate_limit_hints_per_s <= 0 and not own:
            return None
        rate = config.rate_limit_hints_per_s if config.rate_limit_hints_per_s > 0 else None
        return cls(rate, config.rate_limit_burst, clock)

    def limit_for(self, own: Limit | None) -> Limit | None:
        return own if own is not None else self.default

    def take(self, principal: str, cost: float, own: Limit | None = None) -> float:
        """0.0 if `principal` may spend `cost` now (and it is spent), else the
        seconds to wait (math.inf: never, cost > burst)."""
        limit = self.limit_for(own)
        if limit is None:
            return 0.0
        now = self._clock()
        with self._lock:
            bucket = self._buckets.get(principal)
            if bucket is None:
                bucket = self._buckets[principal] = TokenBucket(limit.rate, limit.burst, now)
                if len(self._buckets) > self._max:
                    self._buckets.popitem(last=False)
            else:
                self._buckets.move_to_end(principal)
            return bucket.take(cost, now)

    def give_back(self, principal: str, cost: float) -> None:
        """Refund a cost whose call was refused later (nothing ran)."""
        with self._lock:
            bucket = self._buckets.get(principal)
            if bucket is not None:
                bucket.give_back(cost)


class TenantQueueShares:
    """Each tenant's share of the engine-thread queue: at most TENANT_QUEUE_SHARE of its bound
    (rounded up) of one tenant's tasks queued or running at once, so one tenant's bursts cannot
    fill the queue that every other tenant's calls wait in. What counts: every engine task a
    tenant's RPC submits, and each slice of its WatchEvents snapshots (watch.py; a snapshot's
    next slice waits for a place instead of being refused). A place is taken on the RPC loop
    before the task is submitted and given back when its future is done (the engine thread, or
    at once when refused); thread-safe. A refusal counts in `stats.queue_full`."""

    def __init__(self, queue_bound: int, stats: OverloadStats, retry_after: Callable[[], float],
                 share: float = TENANT_QUEUE_SHARE) -> None:
        self.bound = max(1, math.ceil(queue_bound * share))
        self.stats = stats
        #: The RetryInfo delay of a refusal (the core's recent queue wait).
        self.retry_after = retry_after
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}

    def enter(self, tenant: str) -> int | None:
        """Take a place for one of `tenant`'s tasks: None, or the tasks it holds when its share is full."""
        with self._lock:
            held = self._held.get(tenant, 0)
            if held >= self.bound:
                return held
            self._held[tenant] = held + 1
            return None

    def submit(self, tenant: str, submit: Callable[[], F]) -> F:
        """`submit()`'s future, for one of `tenant`'s tasks, holding a place in its share until
        done; QueueFull, nothing submitted, when the share is full."""
        held = self.enter(tenant)
        if held is not None:
            self.stats.queue_full += 1
            raise QueueFull(held, self.bound, self.retry_after(), queue=f"tenant {tenant!r}'s share of the engine queue")
        return self.hold(tenant, submit())

    def hold(self, tenant: str, future: F) -> F:
        """`future`, the task a place was taken for: the place is given back when it is done."""
        future.add_done_callback(lambda _: self.leave(tenant))
        return future

    def leave(self, tenant: str) -> None:
        with self._lock:
            held = self._held.get(tenant, 0) - 1
            if held > 0:
                self._held[tenant] = held
            else:
                self._held.pop(tenant, None)

    def held(self, tenant: str) -> int:
        with self._lock:
            return self._held.get(tenant, 0)


def queue_retry_after(recent_wait_s: float) -> float:
    """RetryInfo for a full queue: how long tasks recently waited, bounded."""
    return min(MAX_QUEUE_RETRY_S, max(MIN_QUEUE_RETRY_S, recent_wait_s))


__all__ = [
    "CAUSE_QUEUE_FULL",
    "CAUSE_RATE_LIMITED",
    "CAUSE_TENANT_WATCH_STREAMS",
    "CAUSE_WATCH_STREAMS",
    "TENANT_QUEUE_SHARE",
    "TenantQueueShares",
    "OverloadStats",
    "QueueFull",
    "RateLimiter",
    "TokenBucket",
    "principal_of",
    "queue_retry_after",
]
