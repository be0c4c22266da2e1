"""ResidencyJournal: where residency bookkeeping runs, inline or deferred.

vLLM calls KvHint's block-pool hooks on the engine thread, inside its own
`allocate_slots` / `cache_blocks` / `free` calls. What the hooks must read
from vLLM's state at that moment (which blocks, which keys left the pool) is
cheap; the bookkeeping behind it (SessionPrefixIndex, published residency,
events) is not, about 2 ms per step at GPU scale (bench/results/scale).

Inline (`residency_bookkeeping=inline`, the default on vLLM's CPU
platform) runs that bookkeeping inside the hook, as before. Deferred
appends `(fn, args)` to this journal instead, in hook order, and the
settler thread applies the entries in the same order a few milliseconds
later. On a GPU the engine thread spends most of a step waiting on the
device with the GIL released; the settler runs there: the scheduler wakes
it where a step ends (`wake`), and it does not look in between.

Contract (what keeps deferred exactly equivalent to inline):
  * one lock (`lock`, re-entrant) guards the state the entries change; the
    settler holds it per chunk, and the engine thread holds it, after
    settling everything journaled, for anything that reads or changes that
    state: hint batches, queries, snapshot slices, request envelopes
    (`KvHintCore.exclusive`). Hints therefore resolve against every change
    vLLM made before them, and an Evict's removals are booked before its
    outcome, as inline;
  * entries are settled in the order they were recorded, so events come out
    in the same order with the same contents; only their timestamps (and
    the moment a WatchEvents subscriber receives them) move: to the end of
    the step that made them (the settler waits out the step and is woken at
    its end, `wake`), plus the chunks booked before them; by at most
    SETTLE_INTERVAL_S plus one chunk for a change no step boundary follows;
  * the decision to defer is the core's (`KvHintCore.record`): never inside
    an exclusive section. Retention grants do not stop it: the ledger, which
    the free-block filing reads synchronously, is the engine thread's, and no
    entry touches it. A removed block's grants end on the engine thread when
    it leaves (`KvHintCore.drop_grants`), before the removal is recorded, so
    filing and expiry see what inline bookkeeping would show them;
  * the journal is bounded: past `max_entries` the engine thread settles it
    itself (back-pressure instead of unbounded memory when the settler
    cannot keep up).

Garbage: the entries' bookkeeping creates the index nodes and events that
live on, container objects for every stored block and every event. Each one
counts toward CPython's young-generation threshold, and the collection
that crosses it runs on whichever thread allocates next: mostly the engine
thread, in the middle of a step (a young collection there costs
milliseconds, because vLLM's live requests are young too). So once new
entries have been settled (by the settler or by an exclusive section) and
the engine is not in a step, the settler runs CPython's collection itself
once the count has reached a fifth of the threshold (`collect_young`):
the garbage its own work made is collected off the engine thread, in
smaller and cheaper collections. It makes CPython's own trigger fire on
its thread, so CPython still chooses the generation (its long-lived
heuristic decides full collections), and a process that disabled the
collector is left alone (bench.scale_gc_probe measures it, with and
without; design-notes.md, "The settler collects its own garbage").

Collecting at a fifth of the threshold runs young collections up to five
times as often as CPython would, and CPython runs generation 1 every
`threshold1` (10) young collections: each promotes what is alive, vLLM's
request state included, to the oldest generation, whose growth brings full
collections. So while the settler owns the young collections
(`own_young_collections`) generation 1's threshold is scaled by
GENERATION1_SCALE, and generation 1 runs about as often as under CPython's
own trigger (bench.engine_gc, design-notes.md, "Generation 1 as often as
without the settler").

Storage: one flat deque of `fn, len(args), *args` per entry, extended in
one call (atomic for the settler, which pops whole entries). An entry
therefore leaves no container of its own alive until it is settled: a
`(fn, args)` pair and its argument tuple would, and with dozens of entries
per step those survivors were what pushed Python's young-generation count
over its threshold during the engine's steps (bench.scale_gc_probe). For
the same reason the hooks pass plain functions with their object as the
first argument, not a bound method made per call, and flatten per-block
lists into the arguments.
"""

from __future__ import annotations

import gc
import logging
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvhint.journal")

# The settler's longest sleep: it is woken at the engine's step boundaries (`wake`), so this
# only bounds the delay of entries recorded outside a step with no step following (an abort
# while the engine is idle), and of an engine that does not call `wake`.
SETTLE_INTERVAL_S = 0.01
SETTLE_CHUNK_S = 0.0001  # the settler's work per lock hold (whole entries); the GIL is offered between chunks
YIELD_S = 0.00005  # the pause between chunks: long enough for a waiting engine thread to take the GIL
MAX_ENTRIES = 65_536
# The settler's young collection runs once the young generation's count reaches this fraction
# of CPython's threshold (gc.get_threshold()[0]).
YOUNG_COLLECT_FRACTION = 0.2
# While the settler owns the young collections, generation 1's threshold (gc.get_threshold()[1],
# counted in young collections) is this many times what it was: young collections run up to
# 1 / YOUNG_COLLECT_FRACTION times as often as CPython's own trigger would run them.
GENERATION1_SCALE = round(1 / YOUNG_COLLECT_FRACTION)
# Past this many pending entries the settler works even while the engine is busy (a gate that
# never opens must not leave everything to back-pressure on the engine thread).
BUSY_BACKLOG = 4_096


def _collections() -> int:
    """Collections CPython has run so far, every generation (gc.get_stats)."""
    return sum(g["collections"] for g in gc.get_stats())


class _Generation1:
    """Generation 1's threshold, scaled while any journal owns the young collections. The
    collector is the process's, so this is too: the first owner scales it, the last one gone
    restores it, unless someone else set the thresholds in between (theirs then stay, and an
    owner that comes after them scales theirs)."""

    lock = threading.Lock()
    owners = 0
    before: tuple[int, ...] | None = None  # the thresholds when the first owner came
    scaled: tuple[int, ...] | None = None  # what it set them to (None: left them alone)

    @classmethod
    def own(cls) -> None:
        with cls.lock:
            cls.owners += 1
            t = gc.get_threshold()
            if cls.owners > 1 and (cls.scaled is None or t == cls.scaled):
                return  # scaled already (or left alone, and still as it was)
            # The first owner, or thresholds set since the scaling: those are the base now.
            # Nothing to scale with the collector off (disabled, or a zero young threshold),
            # nor from CPython 3.14 on, where threshold1 no longer counts young collections.
            if not gc.isenabled() or t[0] <= 0 or t[1] <= 0 or sys.version_info >= (3, 14):
                cls.before = cls.scaled = None
                return
            cls.before, cls.scaled = t, (t[0], t[1] * GENERATION1_SCALE, *t[2:])
            gc.set_threshold(*cls.scaled)
            log.info("kvhint: the settler runs the young collections; generation 1's threshold %d -> %d "
                     "(kvhint_server/journal.py, 'Garbage')", t[1], cls.scaled[1])

    @classmethod
    def release(cls) -> None:
        with cls.lock:
            if cls.owners == 0:
                return
            cls.owners -= 1
            if cls.owners:
                return
            if cls.scaled is not None and cls.before is not None and gc.get_threshold() == cls.scaled:
                gc.set_threshold(*cls.before)
            cls.before = cls.scaled = None


class ResidencyJournal:
    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        # Guards the engine-side state the entries change (the core's index,
        # published residency and event order; not the retention ledger, which
        # no entry touches). Re-entrant: an exclusive section may record inline
        # entries.
        self.lock = threading.RLock()
        self.max_entries = max_entries
        # fn, len(args), *args per entry (see "Storage" above).
        self._entries: deque[Any] = deque()
        self._recorded = 0  # entries appended (written by the recording thread only)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        # Wake-ups for the settler (`wake`, `stop`): a C queue, so that the engine thread's put
        # and the settler's blocking get run no Python code and the wait holds no GIL.
        self._wakeups: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._woken = False  # a wake-up is queued and the settler has not taken it yet
        self._deferring = False
        self._holds = 0  # open hold() sections (the core's exclusive sections)
        # `record` runs entries now: not deferring, or a hold is open. One flag, so that the
        # engine thread's hot path reads one attribute (hooks call `record` per vLLM call).
        self._direct = True
        # Counters (read by metrics and benchmarks; written under `lock`).
        self.settled = 0
        self.errors = 0  # bookings that raised: journaled (logged) or run now (raised to the caller)
        self.backpressure = 0  # times the engine thread settled a full journal itself
        self.collections = 0  # young collections run by collect_young
        self._owns_generation1 = False  # own_young_collections() in effect

    @property
    def deferring(self) -> bool:
        """Deferred mode: `start()` was called and `stop()` was not."""
        return self._deferring

    def pending(self) -> int:
        """Entries recorded and not settled yet."""
        return max(0, self._recorded - self.settled)

    # ------------------------------------------------------------ recording (engine thread)

    def record(self, fn: Callable[..., Any], *args: Any) -> None:
        """Book `fn(*args)`: journaled for the settler while deferring and no hold is open,
        run now (after everything journaled before it) otherwise. The engine thread's entry
        point (`KvHintCore.record` is this method); `append` inlined for its hot path."""
        if self._direct:
            self.run(fn, args)
            return
        self._recorded += 1
        self._entries.extend((fn, len(args)) + args)
        if self._recorded - self.settled >= self.max_entries:
            self.backpressure += 1
            self.settle()

    def hold(self) -> None:
        """Engine thread, with `lock` held: until `release`, `record` runs entries now (an
        exclusive section's own changes are booked inline, in order)."""
        self._holds += 1
        self._direct = True

    def release(self) -> None:
        """End one `hold`."""
        self._holds -= 1
        self._direct = not self._deferring or self._holds > 0

    def wake(self) -> None:
        """Engine thread, at a step boundary (the end of schedule() or update_from_output(),
        where it is about to wait on the device): wake the settler if anything is journaled.
        At most one wake-up is queued at a time; with nothing journaled (inline bookkeeping, a
        quiet step) this reads two attributes."""
        if self._entries and not self._woken:
            self._woken = True
            self._wakeups.put(None)

    def append(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """Journal `fn(*args)` for the settler. One `extend` of a tuple adds the whole
        entry atomically (it runs no Python code, so the settler never sees part of it)."""
        self._recorded += 1
        self._entries.extend((fn, len(args)) + args)
        if self._recorded - self.settled >= self.max_entries:
            self.backpressure += 1
            self.settle()

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """Run `fn(*args)` now, after everything journaled before it. Its own error is counted
        in `errors`, as a journaled entry's is (a booking that fails counts the same inline or
        deferred), and reaches the caller (as an inline hook's would; the caller reports it); an
        entry journaled before it that fails is logged and counted, as when the settler applies
        it: it is not the caller's, and must not stop `fn` or the entries after it."""
        with self.lock:
            if self._entries:
                self._settle_locked(None)
            try:
                fn(*args)
            except Exception:
                self.errors += 1
                raise

    # ------------------------------------------------------------ settling

    def settle(self, limit: int | None = None, deadline: float | None = None) -> int:
        """Apply journaled entries, oldest first (at most `limit`, and none
        started after `deadline`, a time.perf_counter() value; at least one);
        returns how many."""
        with self.lock:
            return self._settle_locked(limit, deadline=deadline)

    def _settle_locked(self, limit: int | None, deadline: float | None = None) -> int:
        entries = self._entries
        pop = entries.popleft
        n = 0
        while entries and (limit is None or n < limit) and (deadline is None or n == 0 or time.perf_counter() < deadline):
            fn = pop()
            args = [pop() for _ in range(pop())]
            n += 1
            try:
                fn(*args)
            except Exception:
                self.errors += 1
                log.exception("kvhint: residency bookkeeping entry %s failed", getattr(fn, "__qualname__", fn))
        self.settled += n
        return n

    def own_young_collections(self) -> None:
        """From now until `stop`, this journal's owner calls `collect_young` whenever entries
        were settled (the settler thread; a benchmark's driver settling in its place):
        generation 1's threshold is scaled by GENERATION1_SCALE, process-wide, so that those
        earlier young collections do not run generation 1 more often than CPython's own
        trigger would (see "Garbage"). Idempotent per journal."""
        if not self._owns_generation1:
            self._owns_generation1 = True
            _Generation1.own()

    def collect_young(self) -> bool:
        """Run CPython's own collection now, on this thread, if the young generation's count
        has reached YOUNG_COLLECT_FRACTION of the threshold: this thread allocates empty
        sets (a container type with no free list, so each allocation counts) until the count
        passes the threshold, so CPython's trigger fires here and
        chooses the generation itself (generation 1 with it when due, the oldest when its
        long-lived heuristic says so, which Python code cannot read). Nothing when the
        collector is disabled. Returns whether a collection ran. The settler calls it once
        new entries have been settled, outside the engine's steps (see "Garbage").

        Choosing the generation here instead (gc.collect(0) or (1), and nothing once the
        oldest generation's count was due) stopped the settler's collections for good as soon
        as that count passed its threshold and the heuristic declined the full collection:
        from then on every young collection, generation 1's included, ran on the engine
        thread (design-notes.md, "The settler collects its own garbage")."""
        if not gc.isenabled():
            return False
        t0 = gc.get_threshold()[0]
        c0 = gc.get_count()[0]
        if t0 <= 0 or c0 < max(1, int(t0 * YOUNG_COLLECT_FRACTION)):
            return False
        before = _collections()
        for _ in range(3):  # the count can drop while it allocates (objects freed): top it up again
            filler = [set() for _ in range(t0 - gc.get_count()[0] + 1)]
            del filler
            if _collections() != before:
                self.collections += 1
                return True
        return False

    # ------------------------------------------------------------ the settler thread

    def start(
        self,
        interval_s: float = SETTLE_INTERVAL_S,
        chunk_s: float = SETTLE_CHUNK_S,
        thread: bool = True,
        busy: Callable[[], bool] | None = None,
    ) -> None:
        """Deferred mode. With `thread=False` nothing settles on its own: exclusive
        sections, back-pressure and `settle()` calls do (tests and benchmarks that
        choose when, and account its CPU time separately).

        The settler sleeps until `wake()` (the engine's step boundaries) or `interval_s`,
        whichever comes first, so it does not wake up in the middle of a step to find the
        engine busy: a wake-up needs the GIL, and a thread that waits for the GIL while the
        engine thread runs makes CPython switch the engine thread out
        (bench/results/scale_target.md). `busy()`: the engine thread is inside a scheduler
        step (schedule() or update_from_output()). The settler then waits for the step to
        end, so it works while the engine thread waits on the device, unless BUSY_BACKLOG
        entries are pending. Once the journal is drained (by it or by an exclusive section)
        after new entries, it runs `collect_young` (outside a step)."""
        if self._deferring:
            return
        self._deferring = True
        self._direct = self._holds > 0
        if not thread:
            return
        self.own_young_collections()
        self._stop.clear()

        def loop() -> None:
            stop, entries, wakeups = self._stop, self._entries, self._wakeups
            booked = self._recorded  # entries recorded when the settler last looked at the collector
            while not stop.is_set():
                try:
                    wakeups.get(timeout=interval_s)
                except queue.Empty:
                    pass
                # Taken: a boundary from now on queues another (entries recorded before this
                # line are settled below; later ones have their boundary still to come).
                self._woken = False
                while entries and not stop.is_set():
                    if busy is not None and busy() and self.pending() < BUSY_BACKLOG:
                        break  # the engine is stepping: again at its boundary
                    self.settle(deadline=time.perf_counter() + chunk_s)
                    time.sleep(YIELD_S)  # offer the GIL to a waiting engine thread between chunks
                # Journal drained (by this thread or an exclusive section) since the last look,
                # and the engine is not in a step: collect the young garbage the entries made.
                recorded = self._recorded
                if recorded != booked and not entries and not stop.is_set() and (busy is None or not busy()):
                    booked = recorded
                    self.collect_young()

        self._thread = threading.Thread(target=loop, name="kvhint-settler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the settler and apply what is left; later records run inline."""
        self._deferring = False
        self._direct = True
        if self._owns_generation1:
            self._owns_generation1 = False
            _Generation1.release()
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            self._wakeups.put(None)
            thread.join(timeout=5.0)
            while not self._wakeups.empty():
                self._wakeups.get_nowait()
            self._woken = False
        self.settle()
