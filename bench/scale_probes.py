"""Measurements of `bench.scale` beyond the paired steps: KvHint memory, ApplyHints apply time
against the blocks selected, and the event bus with 8 in-process subscribers.

All of them run on the KvHint side of a `scale_driver.Pair` after its steady phase.
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import sys
import threading
import time
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvhint.v1 import kvhint_pb2 as pb

from .scale_driver import HintSender, Pair, Side, thread_ns
from .scale_report import REMOVAL_CALLBACKS
from .scale_workload import HintPlan, Turn, tokens

# ---------------------------------------------------------------- memory


def deep_stats(roots: Iterable[Any], exclude: tuple[type, ...] = (), stop: Iterable[Any] = ()) -> tuple[int, int]:
    """(bytes, GC-tracked objects) of every object reachable from `roots` (sys.getsizeof, each
    object once), not following into classes, modules, functions, methods, instances of `exclude`
    or the `stop` objects (objects owned by someone else: vLLM's KVCacheBlocks that the protected
    classes refer to, the core or pool a clock or callback is bound to). Tracked objects are the
    ones the cyclic garbage collector traverses (gc.is_tracked)."""
    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, *exclude)
    seen: set[int] = {id(x) for x in stop}
    stack = list(roots)
    total = tracked = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        tracked += gc.is_tracked(obj)
        stack.extend(gc.get_referents(obj))
    return total, tracked


def full_collection(repeats: int = 3) -> dict[str, float]:
    """A full collection of this process's heap, the startup heap included (unfrozen for it, then
    frozen again): tracked objects and the fastest of `repeats` collections (ms). The first one
    also frees what became garbage since the last, so with repeats >= 2 the fastest is a
    collection that frees (almost) nothing; quick runs take 1, and 0 (nothing collected, nothing
    reported) on all runs but one."""
    if repeats < 1:
        return {}
    gc.unfreeze()
    times = []
    objects = 0
    for i in range(repeats):
        t = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - t)
        if i == 0:
            objects = len(gc.get_objects())
    gc.freeze()
    return {"gc_objects": objects, "gc_full_ms": round(min(times) * 1e3, 1)}


def memory(side: Side, gc_repeats: int = 3) -> dict[str, int]:
    """KvHint's structures on `side` (bytes) and what they track.

    index: SessionPrefixIndex (nodes, sessions, continuations); hash_map: the adapter's own maps
    and sets (wire hash -> vLLM digest and the like: entries per cached block, with or without a
    session); retention: the
    RetentionLedger and the protected free-block classes; bus: the event replay ring (bounded by
    event_replay_window, whatever the pool size)."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    sched = side.sched
    core, adapter, pool = sched.kvhint_core, sched.kvhint_adapter, sched.kv_cache_manager.block_pool
    collection = full_collection(gc_repeats)  # first: its collections also untrack what they can
    index = core.index
    sessions = len(index.sessions)
    owners = (core, adapter, pool, sched)
    index_bytes, index_gc = deep_stats([index.nodes, index.sessions, index.children_of, index.continuations,
                                        index._continuations_at], stop=owners)
    map_bytes, map_gc = deep_stats(_adapter_maps(adapter), exclude=(KVCacheBlock,), stop=owners)
    retention_bytes, retention_gc = deep_stats([core.ledger, pool._kvh_protected], exclude=(KVCacheBlock,), stop=owners)
    bus_bytes, bus_gc = deep_stats([core.bus._ring])
    return {
        "cached_blocks": len(pool.cached_block_hash_to_block),
        "index_nodes": len(index.nodes),
        "index_resident_nodes": sum(1 for n in index.nodes.values() if n.tiers),
        "sessions": sessions,
        "memberships": sum(len(s.blocks) for s in index.sessions.values()),
        "retained_blocks": len(core.ledger.grants),
        "index_bytes": index_bytes,
        "hash_map_bytes": map_bytes,
        "retention_bytes": retention_bytes,
        "bus_bytes": bus_bytes,
        # Objects of these structures that every full collection traverses, and one full
        # collection of the whole process (both schedulers and the workload).
        "kvhint_gc_objects": index_gc + map_gc + retention_gc + bus_gc,
        "index_gc_objects": index_gc,
        **collection,
    }


def _adapter_maps(adapter: Any) -> list[Any]:
    """The adapter's own containers (whatever their names), not the objects it points to."""
    return [v for v in vars(adapter).values() if isinstance(v, (dict, set, frozenset, list))]


# ---------------------------------------------------------------- attribution


CALLBACKS = {  # adapter callback -> blocks it handles, from its arguments
    "on_blocks_cached": lambda a: a[3] - a[2],  # (request, blocks, num_cached, num_full, ...)
    # Every removal report: `on_keys_removed`'s, and the carried removals of allocations that
    # `flush_removed` reports at a step boundary, which do not go through `on_keys_removed`.
    # Raw data written before the carry has "on_keys_removed" instead (scale_report.REMOVAL_CALLBACKS).
    REMOVAL_CALLBACKS[0]: lambda a: len(a[0]),  # (keys, cause)
    "on_prefix_hit": lambda a: 0,
}


def attribution(pair: Pair, steps: int) -> dict[str, dict[str, float]]:
    """CPU time of the adapter's residency callbacks (the index, retention and event bookkeeping
    behind every admission and removal) in `steps` steps of the KvHint side alone, timed per call
    on the engine thread: us per call, blocks per call, us per block, and a least-squares fit of
    a call's time as fixed + per-block cost (from sums kept per call: n, blocks, blocks^2, time,
    blocks x time), which says whether calls or blocks drive the cost."""
    side, wl = pair.kv, pair.workload
    adapter = side.sched.kvhint_adapter
    stats: dict[str, list[int]] = {}
    originals = {}
    for name, blocks_of in CALLBACKS.items():
        fn = getattr(adapter, name, None)
        if fn is None:
            continue
        acc = stats[name] = [0, 0, 0, 0, 0]  # ns, calls, blocks, blocks^2, blocks x ns
        originals[name] = fn

        def timed(*a: Any, _fn: Any = fn, _acc: list[int] = acc, _blocks: Any = blocks_of, **k: Any) -> Any:
            t = thread_ns()
            try:
                return _fn(*a, **k)
            finally:
                ns = thread_ns() - t
                b = _blocks(a)
                _acc[0] += ns
                _acc[1] += 1
                _acc[2] += b
                _acc[3] += b * b
                _acc[4] += b * ns

        setattr(adapter, name, timed)
    try:
        for _ in range(steps):
            for rid in side.step(wl.arrivals()):
                wl.finished(rid)
            wl.hints()
    finally:
        for name in originals:
            delattr(adapter, name)  # back to the class's method
    return {
        name: {"calls": c, "blocks": b, "us_per_call": ns / 1e3 / max(1, c), "us_per_block": ns / 1e3 / max(1, b), "ms": ns / 1e6,
               **_call_fit(c, b, b2, ns, bns)}
        for name, (ns, c, b, b2, bns) in stats.items()
    }


def _call_fit(n: int, sx: float, sxx: float, sy: float, sxy: float) -> dict[str, float]:
    """Least squares y = fixed + per_block * x over n calls, from the sums (y in ns)."""
    det = n * sxx - sx * sx
    if n < 2 or det <= 0:
        return {}
    per_block = (n * sxy - sx * sy) / det
    return {"fit_us_fixed": (sy - per_block * sx) / n / 1e3, "fit_us_per_block": per_block / 1e3}


# ---------------------------------------------------------------- ApplyHints apply time


def _admit_session(side: Side, session: str, n_blocks: int, tag: str) -> None:
    """Give `session` n_blocks resident blocks (prompts of up to max_model_len, one branch each)."""
    shape = side.shape
    per = shape.max_model_len // shape.block_size - 1
    i = 0
    while n_blocks > 0:
        k = min(per, n_blocks)
        turn = Turn(f"{session}-probe-{i}", tokens(f"{tag}-{session}-{i}", k * shape.block_size + 1), session, "", 1)
        if not side.fill(turn):
            raise RuntimeError("pool too small for the ApplyHints probe")
        n_blocks -= k
        i += 1


def apply_sweep(side: Side, sizes: Iterable[int], repeats: int = 5) -> list[dict[str, Any]]:
    """Apply time (thread CPU, engine thread) of one hint against the blocks it selects: Pin,
    Retain and Release of a session with n resident blocks, then Evict."""
    sender = HintSender(side.sched)
    rows = []
    for n in sizes:
        session = f"probe-{n}"
        times: dict[str, list[int]] = {"pin": [], "retain": [], "release": []}
        selected: dict[str, int] = {}
        for _ in range(repeats):
            # (Re-)admit: a full-session Release forgets the session; a prefix hit brings it back.
            _admit_session(side, session, n, "sweep")
            for action in ("pin", "retain", "release"):
                sender.batches.clear()
                sender.apply_now([HintPlan(action, session, ttl_s=60.0, priority=1)])
                batch = sender.batches[-1]
                times[action].append(batch["ns"])
                selected[action] = batch["blocks"]
        sender.batches.clear()
        _admit_session(side, session, n, "sweep")
        sender.apply_now([HintPlan("evict", session)])
        times["evict"] = [sender.batches[-1]["ns"]]
        selected["evict"] = sender.batches[-1]["blocks"]
        for action, ns in times.items():
            rows.append({"action": action, "blocks": selected[action], "requested": n, "us": statistics.median(ns) / 1e3})
    return rows


def shared_sweep(side: Side, owners: Iterable[int], shared_blocks: int = 64, repeats: int = 5) -> list[dict[str, Any]]:
    """Apply time of Retain on one session whose `shared_blocks`-block prefix is retained by k
    sessions in all, itself included (a shared system prompt under per-session hints), against k. The prefix is
    capped so that prefix + the session's own block fit max_model_len."""
    shape = side.shape
    sender = HintSender(side.sched)
    shared_blocks = min(shared_blocks, shape.max_model_len // shape.block_size - 2)  # prompt + own block fit the model
    prefix = tokens("shared-prefix", shared_blocks * shape.block_size)
    rows, retained = [], 0
    for k in sorted(owners):
        while retained < k:  # k sessions on the prefix, each retaining its blocks
            sid = f"share-{retained}"
            own = tokens(f"own-{sid}", shape.block_size + 1)
            side.fill(Turn(f"{sid}-probe", prefix + own, sid, "", 1))
            sender.apply_now([HintPlan("retain", sid, ttl_s=600.0, priority=1)])
            retained += 1
        times, blocks = [], 0
        for _ in range(repeats):
            sender.batches.clear()
            sender.apply_now([HintPlan("retain", "share-0", ttl_s=600.0, priority=2)])
            times.append(sender.batches[-1]["ns"])
            blocks = sender.batches[-1]["blocks"]
        rows.append({"owners": k, "blocks": blocks, "us": statistics.median(times) / 1e3})
    return rows


# ---------------------------------------------------------------- event bus, 8 subscribers


class _Subscribers:
    """`n` WatchEvents streams of the KvHint core's WatchHub on their own asyncio loop thread,
    each parsing every message and checking that sequences are contiguous (0 lost)."""

    def __init__(self, side: Side, n: int) -> None:
        from kvhint_server.watch import WatchHub

        servicer = side.sched.kvhint_server.servicer
        self.loop = asyncio.new_event_loop()
        self.hub = WatchHub(servicer.core, servicer.queries, servicer.config, self.loop)
        self.received = [0] * n
        self.last = [0] * n
        self.lost = [0] * n
        self.resyncs = [0] * n
        self.mark = [0] * n  # received counts at the start of the current measurement
        self._ready = threading.Barrier(n + 1)
        self._stop = False
        self.thread = threading.Thread(target=self._run, args=(n,), daemon=True)
        self.thread.start()

    def _run(self, n: int) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(asyncio.gather(*(self._consume(i) for i in range(n))))

    async def _consume(self, i: int) -> None:
        request = pb.WatchEventsRequest(start=pb.WatchEventsRequest.START_NOW)
        request.heartbeat_interval.FromMilliseconds(100)
        stream = self.hub.stream(request)
        async for msg in stream:
            m = pb.WatchEventsResponse.FromString(msg) if isinstance(msg, bytes) else msg
            kind = m.WhichOneof("payload")
            if kind == "resync":
                self.resyncs[i] += 1
                return
            if kind != "heartbeat":
                if self.last[i] and m.sequence != self.last[i] + 1:
                    self.lost[i] += m.sequence - self.last[i] - 1
                self.last[i] = m.sequence
                self.received[i] += 1
            if self._stop:
                return

    def wait_subscribed(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.hub.subscribers < len(self.received):
            if time.monotonic() > deadline:
                raise RuntimeError("subscribers did not start")
            time.sleep(0.01)

    def wait_caught_up(self, last: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while min(self.last) < last and not any(self.resyncs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"subscribers stuck at {self.last}, published up to {last}")
            time.sleep(0.005)

    def close(self) -> None:
        self._stop = True
        self.loop.call_soon_threadsafe(self.hub.close)
        self.thread.join(timeout=10)
        self.loop.close()


def _measure(subs: _Subscribers, bus: Any, source: str, publish: Any) -> dict[str, Any]:
    first = bus.last_sequence
    t0 = time.perf_counter()
    cpu0 = thread_ns()
    publish()
    cpu = (thread_ns() - cpu0) / 1e9
    last = bus.last_sequence
    subs.wait_caught_up(last)
    wall = time.perf_counter() - t0
    events = last - first
    received = [r - base for r, base in zip(subs.received, subs.mark)]
    subs.mark = list(subs.received)
    return {
        "source": source,
        "events": events,
        "wall_s": wall,
        "publisher_cpu_s": cpu,
        "events_per_s": events / wall if wall else 0.0,
        "delivered_min": min(received),
        "lost": sum(subs.lost) + sum(max(0, events - r) for r in received),
        "resyncs": sum(subs.resyncs),
    }


def event_bus(pair: Pair, steps: int, synthetic_events: int, subscribers: int = 8) -> dict[str, Any]:
    """The KvHint core's event bus with `subscribers` WatchEvents streams (in-process WatchHub,
    each message serialized once and parsed by every subscriber), fed two ways:

      * workload: the KvHint side alone runs `steps` steps of the workload at full speed;
      * paced publish: one-block BlocksStored events published in bursts of 500 as fast as the
        subscribers keep within 2,000 events (well inside the 10,000-event replay window),
        the most the bus and 8 readers sustain on this machine without loss.

    events/s = events published / wall time until every subscriber has all of them."""
    from kvhint_server.events import BlocksStored, Coordinates
    from kvhint_server.model import Tier

    side = pair.kv
    bus = side.core.bus
    subs = _Subscribers(side, subscribers)
    wl = pair.workload

    def run_steps() -> None:
        for _ in range(steps):
            for rid in side.step(wl.arrivals()):
                wl.finished(rid)
            wl.hints()

    def paced() -> None:
        coords = Coordinates("bench-session", "", ())
        for start in range(0, synthetic_events, 500):
            for i in range(start, min(synthetic_events, start + 500)):
                bus.publish(BlocksStored(Tier.DEVICE, "GPU", (i.to_bytes(8, "big"),), None, i, 16, coords), sessions=("bench-session",), tier=Tier.DEVICE)
            subs.wait_caught_up(bus.last_sequence - 2000)

    try:
        subs.wait_subscribed()
        sources = [_measure(subs, bus, f"workload ({steps} steps)", run_steps),
                   _measure(subs, bus, f"paced publish ({synthetic_events} events)", paced)]
        return {"subscribers": subscribers, "sources": sources}
    finally:
        subs.close()


# Where KvHint's own code lives: the lines counted per quiet step. engine_integration/inproc.py
# is the in-process harness both sides step through (its stand-in model runner), not KvHint's.
_ROOT = Path(__file__).resolve().parent.parent
_KVHINT_DIRS = tuple(str(_ROOT / d) + "/" for d in ("kvhint_server", "engine_integration"))
_HARNESS = str(_ROOT / "engine_integration" / "inproc.py")


def quiet_lines(pair: Pair) -> dict[str, Any]:
    """Lines of KvHint's code (kvhint_server/, engine_integration/ but its in-process harness) that
    the KvHint side runs per strictly quiet step: one more quiet round (`Pair.quiet`) traced with
    `sys.settrace`, counting the steps in which that side stored, evicted and freed no block (none
    of its requests finished). A count, not a time: the same in every run unless some per-step
    work depends on the pool or the sessions. The traced round's units are dropped (tracing slows
    the steps)."""
    counts: list[tuple[int, bool]] = []
    n = [0]

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            n[0] += 1
        return local

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        name = frame.f_code.co_filename
        return local if name.startswith(_KVHINT_DIRS) and name != _HARNESS else None

    def around(region: str, call: Any) -> Any:
        if region != pair.kv.name:
            return call()
        n[0] = 0
        sys.settrace(on_call)
        try:
            finished = call()
        finally:
            sys.settrace(None)
        counts.append((n[0], bool(finished)))
        return finished

    start = len(pair.units)
    try:
        with pair.around_steps(around):
            pair.quiet(1)
    finally:
        units = pair.units[start:]
        del pair.units[start:]
    lines = [c for (c, finished), u in zip(counts, units)
             if u.phase == "quiet" and not u.admitted and not u.evicted and not finished]
    return {"steps": len(lines), "lines": sorted(set(lines))}
