"""Prometheus metrics of the KvHint sidecar.

What is measured (every name starts with `kvhint_`; no label ever carries a
session id, continuation id or block hash, so cardinality is bounded by the
enums of kvhint.v1):

  hints_total{action,outcome,reason}        every hint answered (replays excluded)
  apply_hints_seconds                       ApplyHints latency, wire to wire
  protected_blocks{class}                   blocks under retention / pins now
  pin_budget_blocks, pin_budget_used_blocks the pin budget and its use
  pins_broken_total                         pinned blocks reclaimed under pressure
  events_published_total{kind}              residency events published
  watch_subscribers                         open WatchEvents streams
  watch_max_lag_events                      the furthest-behind subscriber's lag
  snapshot_seconds                          time to take a START_SNAPSHOT snapshot
  operations_total{action,state}            tier operations finished, by end state
  operations_in_flight                      tier operations pending or running
  tier_bytes_moved_total{from_tier,to_tier} bytes the tier actions copied
  metrics_events_skipped_total              events the exporter could not read
                                            (it fell out of the replay window)
  tenant_budget_blocks{tenant,budget}       a tenant's pin / retention budget
                                            (budget="pin"|"retention"; unlimited: absent)
  tenant_budget_used_blocks{tenant,budget}  blocks the tenant pins / protects now
                                            (tenant names come from the tenants file)
  rejections_total{cause}                   calls refused RESOURCE_EXHAUSTED, by their
                                            ErrorInfo cause: queue_full, rate_limited,
                                            watch_streams, tenant_watch_streams (WatchEvents
                                            included: every RPC's refusals count)
  engine_queue_depth                        engine-thread tasks queued now
  deferred_batches_total                    ApplyHints batches that waited past
                                            a spent step budget
  step_budget_exhausted_total               steps that left queued tasks for
                                            the next one

Where they are visible:
  * vLLM's own `/metrics`, when the vLLM process tree runs in prometheus_client's
    multiprocess mode (`PROMETHEUS_MULTIPROC_DIR` set before vLLM starts).
    `kvhint-vllm` sets it; with the stock `vllm serve` set it yourself to an
    empty directory. EngineCore (where the sidecar runs) then writes its values
    to that directory and vLLM's API server aggregates them.
  * `KVHINT_METRICS_ADDRESS=host:port`: the sidecar serves `/metrics` itself.

How: nothing on the engine thread's hot path. A daemon thread follows the
EventBus (counting HintApplied, PinBroken, OperationCompleted and
TierTransferCompleted events as a subscriber would) and samples the gauges
and the core's overload counters (kvhint_server.overload.OverloadStats)
every `interval_s`. Only ApplyHints latency and snapshot time are observed
where they happen (`observe_apply`, `observe_snapshot`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client import multiprocess as prom_multiprocess
from prometheus_client import values as prom_values

from .events import (
    EventKind,
    HintApplied,
    OperationCompleted,
    PinBroken,
    TierTransferCompleted,
)
from .model import Outcome, Reason
from .overload import CAUSE_QUEUE_FULL, CAUSE_RATE_LIMITED, CAUSE_TENANT_WATCH_STREAMS, CAUSE_WATCH_STREAMS, OverloadStats

if TYPE_CHECKING:
    from .core import KvHintCore

log = logging.getLogger("kvhint.metrics")

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# rejections_total's cause label -> the OverloadStats counter of those refusals.
_REJECTIONS = (
    (CAUSE_QUEUE_FULL, "queue_full"),
    (CAUSE_RATE_LIMITED, "rate_limited"),
    (CAUSE_WATCH_STREAMS, "watch_streams"),
    (CAUSE_TENANT_WATCH_STREAMS, "tenant_watch_streams"),
)
_SNAPSHOT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _name(enum_value: Any) -> str:
    return enum_value.name.lower()


def multiprocess_mode() -> bool:
    """Whether prometheus_client writes values to PROMETHEUS_MULTIPROC_DIR."""
    return prom_values.ValueClass is not prom_values.MutexValue


class KvHintMetrics:
    """The metric objects. One per process (prometheus names are global)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        kw: dict[str, Any] = {"registry": registry} if registry is not None else {}
        live = {"multiprocess_mode": "livesum"}
        livemax = {"multiprocess_mode": "livemax"}
        self.hints = Counter("kvhint_hints", "Hints answered, by action, outcome and reason.",
                             ["action", "outcome", "reason"], **kw)
        self.apply_seconds = Histogram("kvhint_apply_hints_seconds", "ApplyHints latency (wire to wire).",
                                       buckets=_LATENCY_BUCKETS, **kw)
        self.protected = Gauge("kvhint_protected_blocks", "Blocks under retention or pins, by class.",
                               ["class"], **live, **kw)
        self.pin_budget = Gauge("kvhint_pin_budget_blocks", "The pin budget in blocks.", **live, **kw)
        self.pin_used = Gauge("kvhint_pin_budget_used_blocks", "Pinned blocks counted against the budget.",
                              **live, **kw)
        self.pins_broken = Counter("kvhint_pins_broken", "Pinned blocks reclaimed under memory pressure.", **kw)
        self.events = Counter("kvhint_events_published", "Residency events published, by kind.", ["kind"], **kw)
        self.subscribers = Gauge("kvhint_watch_subscribers", "Open WatchEvents streams.", **live, **kw)
        self.max_lag = Gauge("kvhint_watch_max_lag_events",
                             "Events the furthest-behind subscriber has yet to receive.", **livemax, **kw)
        self.snapshot_seconds = Histogram("kvhint_snapshot_seconds", "Time to take a START_SNAPSHOT snapshot.",
                                          buckets=_SNAPSHOT_BUCKETS, **kw)
        self.operations = Counter("kvhint_operations", "Tier operations finished, by action and end state.",
                                  ["action", "state"], **kw)
        self.in_flight = Gauge("kvhint_operations_in_flight", "Tier operations pending or running.", **live, **kw)
        self.tier_bytes = Counter("kvhint_tier_bytes_moved", "Bytes copied between tiers by tier actions.",
                                  ["from_tier", "to_tier"], **kw)
        self.tenant_budget = Gauge("kvhint_tenant_budget_blocks", "A tenant's pin or retention budget in blocks.",
                                   ["tenant", "budget"], **live, **kw)
        self.tenant_used = Gauge("kvhint_tenant_budget_used_blocks",
                                 "Blocks a tenant pins (budget=pin) or protects (budget=retention) now.",
                                 ["tenant", "budget"], **live, **kw)
        self.skipped = Counter("kvhint_metrics_events_skipped",
                               "Events the exporter could not count (outside the replay window).", **kw)
        self.rejections = Counter("kvhint_rejections", "Calls refused RESOURCE_EXHAUSTED, by cause.",
                                  ["cause"], **kw)
        self.queue_depth = Gauge("kvhint_engine_queue_depth", "Engine-thread tasks queued now.", **live, **kw)
        self.deferred_batches = Counter("kvhint_deferred_batches",
                                        "ApplyHints batches that waited past a spent step budget.", **kw)
        self.budget_exhausted = Counter("kvhint_step_budget_exhausted",
                                        "Engine steps whose hint-work budget ran out with tasks left.", **kw)
        self.journal_settled = Counter("kvhint_residency_deferred",
                                       "Residency changes booked off the engine thread's step (deferred bookkeeping).",
                                       **kw)
        self.journal_pending = Gauge("kvhint_residency_journal_pending",
                                     "Residency changes journaled, not yet booked.", **live, **kw)
        self.journal_backpressure = Counter("kvhint_residency_journal_backpressure",
                                            "Times the engine thread booked a full journal itself.", **kw)
        self.journal_errors = Counter("kvhint_residency_bookkeeping_errors",
                                      "Residency bookings that raised: journaled ones (logged) and inline ones (raised to their caller).", **kw)
        self.journal_collections = Counter("kvhint_settler_young_collections",
                                           "Young-generation garbage collections the settler ran off the engine "
                                           "thread (deferred bookkeeping).", **kw)

    # ------------------------------------------------------------ per event

    def count(self, kind: EventKind, payload: Any) -> None:
        self.events.labels(_name(kind)).inc()
        if isinstance(payload, HintApplied):
            result = payload.result
            which = getattr(payload.hint, "WhichOneof", None)
            action = which("action") if which is not None else None
            reason = result.reason if result.outcome is not Outcome.ACCEPTED else Reason.UNSPECIFIED
            self.hints.labels(action or "unspecified", _name(result.outcome), _name(reason)).inc()
        elif isinstance(payload, PinBroken):
            self.pins_broken.inc(len(payload.block_hashes))
        elif isinstance(payload, OperationCompleted):
            op = payload.operation
            self.operations.labels(_name(op.action), _name(op.state)).inc()
        elif isinstance(payload, TierTransferCompleted):
            self.tier_bytes.labels(_name(payload.from_tier), _name(payload.to_tier)).inc(payload.bytes_moved)


# (tenant name, budget "pin"|"retention", blocks used, budget or None: unlimited)
TenantUsage = tuple[str, str, int, "int | None"]


class MetricsExporter:
    """Follows one KvHintCore's event bus and gauges from a daemon thread.

    `subscribers` returns (open streams, max lag in events); the gRPC server
    passes its WatchHub's. `tenant_usage` returns TenantUsage rows (the
    server computes them on the engine thread). Start with `start()`, stop with `stop()`.
    """

    def __init__(
        self,
        core: KvHintCore,
        metrics: KvHintMetrics,
        *,
        subscribers: Callable[[], tuple[int, int]] | None = None,
        tenant_usage: Callable[[], Iterable[TenantUsage]] | None = None,
        interval_s: float = 0.5,
    ) -> None:
        self._tenant_usage = tenant_usage
        self._core = core
        self._m = metrics
        self._subscribers = subscribers
        self._interval = interval_s
        self._cursor = core.bus.last_sequence
        self._overload_seen = OverloadStats()
        self._journal_seen = (0, 0, 0, 0)  # settled, backpressure, errors, collections
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvhint-metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.poll()  # count what happened since the last tick

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - metrics must never take the sidecar down
                log.exception("kvhint metrics: poll failed")

    def poll(self) -> None:
        """Count new events and sample the gauges (any thread; one at a time)."""
        bus = self._core.bus
        while True:
            batch = bus.read_after(self._cursor, 4096)
            if batch is None:  # fell out of the replay window
                oldest = bus.oldest_sequence
                self._m.skipped.inc(oldest - 1 - self._cursor)
                self._cursor = oldest - 1
                continue
            if not batch:
                break
            for ev in batch:
                self._m.count(ev.kind, ev.payload)
            self._cursor = batch[-1].sequence
        ledger = self._core.ledger
        pinned = ledger.pinned_blocks
        self._m.protected.labels("pinned").set(pinned)
        self._m.protected.labels("retained").set(max(0, len(ledger.grants) - pinned))
        self._m.pin_budget.set(ledger.pin_budget_blocks)
        self._m.pin_used.set(pinned)
        self._m.in_flight.set(len(self._core.operations.pending()))
        self._m.queue_depth.set(self._core.pending_tasks())
        self._count_overload()
        self._count_journal()
        if self._subscribers is not None:
            count, lag = self._subscribers()
            self._m.subscribers.set(count)
            self._m.max_lag.set(lag)
        if self._tenant_usage is not None:
            for tenant, budget, used, limit in self._tenant_usage():
                self._m.tenant_used.labels(tenant, budget).set(used)
                if limit is not None:
                    self._m.tenant_budget.labels(tenant, budget).set(limit)

    def _count_journal(self) -> None:
        journal, m = self._core.journal, self._m
        m.journal_pending.set(journal.pending())
        now = (journal.settled, journal.backpressure, journal.errors, journal.collections)
        counters = (m.journal_settled, m.journal_backpressure, m.journal_errors, m.journal_collections)
        for counter, before, after in zip(counters, self._journal_seen, now):
            if after > before:
                counter.inc(after - before)
        self._journal_seen = now

    def _count_overload(self) -> None:
        now, seen, m = dataclasses.replace(self._core.overload), self._overload_seen, self._m
        for cause, counter in _REJECTIONS:
            delta = getattr(now, counter) - getattr(seen, counter)
            if delta > 0:
                m.rejections.labels(cause).inc(delta)
        if now.deferred_batches > seen.deferred_batches:
            m.deferred_batches.inc(now.deferred_batches - seen.deferred_batches)
        if now.budget_cutoffs > seen.budget_cutoffs:
            m.budget_exhausted.inc(now.budget_cutoffs - seen.budget_cutoffs)
        self._overload_seen = now


_metrics: KvHintMetrics | None = None
_metrics_lock = threading.Lock()


def process_metrics() -> KvHintMetrics:
    """This process's metrics (created on first use, in the default registry)."""
    global _metrics
    with _metrics_lock:
        if _metrics is None:
            _metrics = KvHintMetrics()
        return _metrics


def serve_metrics(address: str) -> tuple[Any, threading.Thread] | None:
    """Serve /metrics on `address` (host:port) from a daemon thread. In
    multiprocess mode the endpoint aggregates the whole process tree. Returns
    (the HTTP server, its thread) for `stop_metrics` (None from a
    prometheus_client too old to return them)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")  # a bracketed IPv6 host, e.g. [::1]:9100
    registry = None
    if multiprocess_mode():
        registry = CollectorRegistry()
        prom_multiprocess.MultiProcessCollector(registry)
    return start_http_server(int(port), addr=host or "127.0.0.1", **({"registry": registry} if registry else {}))


def stop_metrics(handle: tuple[Any, threading.Thread] | None, timeout: float = 5.0) -> None:
    """Stop serving what `serve_metrics` started: the thread ends and the port is closed."""
    if handle is None:
        return
    httpd, thread = handle
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout)


__all__ = ["KvHintMetrics", "MetricsExporter", "multiprocess_mode", "process_metrics", "serve_metrics", "stop_metrics"]
