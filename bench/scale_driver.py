"""Paired stepping of a stock and a KvHint vLLM scheduler for `bench.scale`.

Both sides are vLLM's real `Scheduler` (KvHint: `KvHintScheduler`, hooks installed on the real
KVCacheManager and BlockPool), built by `engine_integration.inproc` over a synthetic pool, with
fake model-runner outputs: everything the engine thread does except the forward pass.

Timing: CPU time of the calling (engine) thread, `time.thread_time_ns`, around the
scheduler-side work of one unit: `add_request` + `schedule()` + `update_from_output()` for a
step, `get_computed_blocks` + `allocate_slots` + `record_prefix_cache_stats` + `free` for a direct fill
admission (the calls vLLM's scheduler makes to admit a request; KvHint books a prefix hit at the third). Thread CPU
time leaves out the KvHint sidecar's idle gRPC thread and the other side's work; process CPU
time is recorded too. Request construction (vLLM hashes the prompt there) and the fake model
output are outside the timed region, as they are outside the scheduler in EngineCore.

Each unit runs on both sides back to back, in random order, so both see the same machine noise;
the report uses per-unit ratios, totals and medians. Blocks admitted and evicted per unit are
read from the KvHint side's event bus after the unit (outside the timed region).
"""

from __future__ import annotations

import gc
import itertools
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from kvhint.v1 import kvhint_pb2 as pb

from .scale_workload import HintPlan, Shape, Turn, Workload, tokens

FILL_CHUNK = 16  # direct admissions per recorded fill unit
_ENDPOINTS = itertools.count()  # vLLM KV-event endpoints of this process

# The CPU timers (ns), and the wall clock (GIL waits included).
thread_ns = time.thread_time_ns
process_ns = time.process_time_ns
wall_ns = time.perf_counter_ns


@dataclass
class Unit:
    """One timed unit on both sides."""

    phase: str  # "fill" (direct admission), "steady" (a step with arrivals), "quiet" (a step, no arrivals)
    stock_ns: int
    kv_ns: int
    stock_proc_ns: int
    kv_proc_ns: int
    admitted: int  # blocks stored on the KvHint side during the unit
    evicted: int  # blocks removed on the KvHint side during the unit
    hints: int = 0
    running: int = 0
    # CPU time of settling the KvHint side's deferred bookkeeping after the unit (journal.py;
    # outside kv_ns: on an engine the settler thread does it). 0 with inline bookkeeping.
    kv_settle_ns: int = 0
    # Wall time of the same timed regions (with a settler thread, waits for the GIL show here).
    stock_wall_ns: int = 0
    kv_wall_ns: int = 0
    # The KvHint (or A/A second) side ran its step first: the step order moves a pair's per-step
    # ratio by points, so order-balanced statistics split by it (`balanced_ratio`).
    kv_first: int = 0  # 1: yes (an int, as the CSV of units reads every field back)

    def row(self) -> dict[str, Any]:
        return asdict(self)


class Side:
    """One scheduler and the CPU time of its scheduler-side work."""

    def __init__(self, shape: Shape, kvhint: bool, name: str, kv_events: bool = False) -> None:
        from engine_integration import inproc

        self.inproc = inproc
        self.shape = shape
        self.name = name
        self.kvhint = kvhint
        self.kv_events_endpoint = (
            f"ipc://{tempfile.gettempdir()}/kvhint-scale-{os.getpid()}-{next(_ENDPOINTS)}" if kv_events else None
        )
        self.sched = inproc.make_scheduler(
            num_blocks=shape.pool_blocks,
            block_size=shape.block_size,
            kvhint=kvhint,
            async_scheduling=shape.async_scheduling,
            hybrid=shape.hybrid,
            sliding_window=shape.sliding_window,
            max_num_seqs=shape.max_num_seqs,
            max_num_batched_tokens=shape.max_num_batched_tokens,
            max_model_len=shape.max_model_len,
            # vLLM's ZMQ publisher binds it; with no subscriber PUB drops the batches after
            # building and serializing them, which is the engine process's work either way.
            kv_events_endpoint=self.kv_events_endpoint,
        )
        self.core = getattr(self.sched, "kvhint_core", None)
        self.cpu_ns = 0
        self.proc_ns = 0
        self.settle_ns = 0
        self.wall_ns = 0
        if self.core is not None:
            # Bookkeeping as the shape says. Deferred gets no settler thread unless the shape
            # asks for one: the driver settles after each unit and times that separately
            # (settle_ns).
            journal = self.core.journal
            journal.stop()
            if shape.deferred and shape.settler_thread:
                self.sched.kvhint_start_settler()  # as an engine runs it: gated on steps, woken at their ends
            elif shape.deferred:
                journal.start(thread=False)
                journal.own_young_collections()  # the driver's settle runs collect_young (settle)
        self.time_steps(self.sched.schedule, self.sched.update_from_output)

    def time_steps(self, schedule_fn: Callable[..., Any], update_fn: Callable[..., Any]) -> None:
        """Make the scheduler's schedule() / update_from_output() these callables, timed into
        this side's CPU and wall clocks (bench.scale_ablation swaps in vLLM's own methods)."""

        def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
            def call(*a: Any, **k: Any) -> Any:
                t, p, w = thread_ns(), process_ns(), wall_ns()
                try:
                    return fn(*a, **k)
                finally:
                    self.cpu_ns += thread_ns() - t
                    self.proc_ns += process_ns() - p
                    self.wall_ns += wall_ns() - w

            return call

        self.sched.schedule, self.sched.update_from_output = timed(schedule_fn), timed(update_fn)

    def request(self, turn: Turn) -> Any:
        req = self.inproc.make_request(
            turn.request_id, turn.prompt, session_id=turn.session_id or None, max_tokens=turn.max_tokens,
            block_size=self.shape.block_size,
        )
        if turn.continuation_id:
            req.sampling_params.extra_args = {"continuation_id": turn.continuation_id}
        return req

    def take(self) -> tuple[int, int]:
        """CPU time (thread, process) accumulated since the last take."""
        out = (self.cpu_ns, self.proc_ns)
        self.cpu_ns = self.proc_ns = 0
        return out

    def take_wall(self) -> int:
        out, self.wall_ns = self.wall_ns, 0
        return out

    def settle(self) -> None:
        """Settle deferred bookkeeping now (after a unit, outside its timed region). With the
        settler thread, wait for it instead: its CPU is its own, not the driver's."""
        if self.core is not None and self.shape.settler_thread:
            journal = self.core.journal
            deadline = time.monotonic() + 5.0
            while journal.pending() and time.monotonic() < deadline:
                time.sleep(0.0005)
            with journal.lock:  # the chunk in progress, if any, is booked
                pass
        if self.core is not None and self.core.journal.pending():
            t = thread_ns()
            self.core.settle()
            self.core.journal.collect_young()  # what the settler thread does once entries are settled
            self.settle_ns += thread_ns() - t

    def take_settle(self) -> int:
        out, self.settle_ns = self.settle_ns, 0
        return out

    def fill(self, turn: Turn) -> bool:
        """Admit a prompt directly through the KVCacheManager (no step): its full blocks are
        cached, then freed. Returns False when the pool could not hold it."""
        req = self.request(turn)
        manager = self.sched.kv_cache_manager
        t, p = thread_ns(), process_ns()
        blocks, hit, _ = manager.get_computed_blocks(req)
        ok = manager.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
        if ok:
            manager.record_prefix_cache_stats(req, hit)  # as vLLM's scheduler does at admission
            manager.free(req)
        self.cpu_ns += thread_ns() - t
        self.proc_ns += process_ns() - p
        return ok

    def step(self, turns: Sequence[Turn]) -> list[str]:
        """Add the arriving turns and run one engine step. Returns the finished request ids."""
        requests = [self.request(t) for t in turns]
        t, p, w = thread_ns(), process_ns(), wall_ns()
        for req in requests:
            self.sched.add_request(req)
        self.cpu_ns += thread_ns() - t
        self.proc_ns += process_ns() - p
        self.wall_ns += wall_ns() - w
        # The device's share of a step (the GIL free) where EngineCore waits for the model's
        # output: between schedule() and update_from_output() (inproc.step).
        wait = self.shape.gpu_wait_s
        return self.inproc.step(self.sched, device_wait=(lambda: time.sleep(wait)) if wait else None).finished

    def running(self) -> int:
        return len(self.sched.running)

    def close(self) -> None:
        self.inproc.close(self.sched)


class BusCounter:
    """Blocks stored / removed on the KvHint side since the last `take()` (from its event bus)."""

    def __init__(self, core: Any) -> None:
        from kvhint_server.events import EventKind

        self._kinds = (EventKind.BLOCKS_STORED, EventKind.BLOCKS_REMOVED)
        self.bus = core.bus
        self.cursor = self.bus.last_sequence

    def take(self) -> tuple[int, int]:
        stored = removed = 0
        events = self.bus.read_after(self.cursor, 1 << 30)
        if events is None:
            raise RuntimeError("the KvHint event ring overran between two units; lower the unit size")
        for ev in events:
            if ev.kind is self._kinds[0] and not ev.payload.prefix_hit:
                stored += len(ev.payload.block_hashes)
            elif ev.kind is self._kinds[1]:
                removed += len(ev.payload.block_hashes)
        self.cursor = self.bus.last_sequence
        return stored, removed


def hint_message(plan: HintPlan) -> pb.Hint:
    sel = pb.Selector(session=pb.SessionSelector(session_id=plan.session_id))
    ttl = {"seconds": int(plan.ttl_s), "nanos": int((plan.ttl_s % 1) * 1e9)}
    if plan.action == "retain":
        return pb.Hint(selector=sel, retain=pb.RetainAction(ttl=ttl, priority=plan.priority))
    if plan.action == "pin":
        return pb.Hint(selector=sel, pin=pb.PinAction(ttl=ttl))
    if plan.action == "release":
        return pb.Hint(selector=sel, release=pb.ReleaseAction())
    if plan.action == "evict":
        return pb.Hint(selector=sel, evict=pb.EvictAction())
    raise ValueError(plan.action)


class HintSender:
    """ApplyHints on the engine thread: validated like the servicer does, submitted to
    KvHintCore, applied by the KvHint scheduler's next `schedule()` (a step boundary). Records
    each batch's apply time (thread CPU) and the blocks its results report."""

    def __init__(self, scheduler: Any) -> None:
        from kvhint_server.validation import parse_apply_request

        self._parse = parse_apply_request
        self.core = scheduler.kvhint_core
        self.executor = scheduler.kvhint_core.executor
        self.config = scheduler.kvhint_server.servicer.config
        self.batches: list[dict[str, Any]] = []

    def submit(self, plans: Sequence[HintPlan]) -> Any:
        if not plans:
            return None
        wire = [hint_message(p) for p in plans]
        items = self._parse(pb.ApplyHintsRequest(hints=wire), self.config, self.core.info)
        actions = sorted({p.action for p in plans})

        def apply() -> Any:
            t = thread_ns()
            results = self.executor.apply_batch(items).results
            dt = thread_ns() - t
            blocks = sum(sum(r.affected.values()) for r in results)
            self.batches.append({"hints": len(wire), "actions": actions, "ns": dt, "blocks": blocks,
                                 "outcomes": sorted({r.outcome.name for r in results})})
            return results

        return self.core.submit(apply)

    def apply_now(self, plans: Sequence[HintPlan]) -> list[Any]:
        """Submit and run at once on this thread (a step boundary with nothing else to do)."""
        future = self.submit(plans)
        self.core.run_pending()
        return list(future.result(timeout=0))


class SimClock:
    """Monotonic time of the KvHint core advanced by `step_seconds` per step (TTLs and the
    hint rate are in simulated GPU time, not in this machine's slower steps)."""

    def __init__(self, core: Any, step_seconds: float) -> None:
        self.now = core.monotonic()
        self.step_seconds = step_seconds
        core.monotonic = self

    def __call__(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += self.step_seconds


class Pair:
    """A stock side and a KvHint (or, for A/A, a second stock) side fed the same workload."""

    def __init__(self, shape: Shape, aa: bool = False, sample: Callable[[str, int], int] | None = None,
                 collect: bool = True, kv_first: bool = False) -> None:
        self.shape = shape
        self.aa = aa
        # Collect before freezing (fill_and_freeze). Off only where timings are not the point
        # (`bench.scale --quick`, for tests): earlier pairs' garbage is then frozen with the heap
        # instead of freed, and each full collection of this heap costs a noticeable fraction
        # of a second.
        self.collect = collect
        # The side built second runs measurably faster in this harness (the A/A pair's second
        # side: 0.99x in most runs), so `kv_first` builds the KvHint side first; bench.scale_target
        # alternates it between rounds.
        if kv_first:
            self.kv = Side(shape, not aa, "stock-b" if aa else "kvhint")
            self.stock = Side(shape, False, "stock", kv_events=shape.stock_kv_events)
        else:
            self.stock = Side(shape, False, "stock", kv_events=shape.stock_kv_events)
            self.kv = Side(shape, not aa, "stock-b" if aa else "kvhint")
        self._kv_ran_first = False
        self.rng = random.Random(shape.seed + 1)
        self.counter = BusCounter(self.kv.core) if self.kv.core is not None else None
        self.sender = HintSender(self.kv.sched) if self.kv.core is not None else None
        self.clock = SimClock(self.kv.core, shape.step_seconds) if self.kv.core is not None else None
        default_sample = self.stock.inproc.default_sample
        self.workload = Workload(shape, sample or (lambda rid, i: default_sample(_Rid(rid), i)))
        self.units: list[Unit] = []

    # ------------------------------------------------------------ units

    def _record(self, phase: str, hints: int = 0) -> Unit:
        s, sp = self.stock.take()
        k, kp = self.kv.take()
        self.kv.settle()
        admitted, evicted = self.counter.take() if self.counter is not None else (0, 0)
        unit = Unit(phase, s, k, sp, kp, admitted, evicted, hints, self.kv.running(), self.kv.take_settle(),
                    self.stock.take_wall(), self.kv.take_wall(), int(self._kv_ran_first))
        self.units.append(unit)
        return unit

    def _both(self, fn: Callable[[Side], Any]) -> tuple[Any, Any]:
        if self.rng.random() < 0.5:
            self._kv_ran_first = False
            a = fn(self.stock)
            b = fn(self.kv)
        else:
            self._kv_ran_first = True
            b = fn(self.kv)
            a = fn(self.stock)
        return a, b

    def fill(self) -> dict[str, int]:
        """Every session's first context, then anonymous prompts until the pool is full (or the
        sessions alone overflow it). Returns what was admitted."""
        shape = self.shape
        turns = self.workload.first_turns()
        for i in range(0, len(turns), FILL_CHUNK):
            for turn in turns[i : i + FILL_CHUNK]:
                self._both(lambda side: side.fill(turn))
            self._record("fill")
        pool = self.stock.sched.kv_cache_manager.block_pool
        fillers = 0
        filler_tokens = (shape.max_model_len // shape.block_size - 1) * shape.block_size
        room = shape.pool_blocks - 1 - filler_tokens // shape.block_size
        while len(pool.cached_block_hash_to_block) < room:
            for _ in range(FILL_CHUNK):
                turn = Turn(f"filler-{fillers}", _filler(fillers, filler_tokens), "", "", 1)
                ok = self._both(lambda side: side.fill(turn))
                fillers += 1
                if not all(ok) or len(pool.cached_block_hash_to_block) >= room:
                    break
            self._record("fill")
            if not all(ok):
                break
        return {"fillers": fillers, "cached_blocks": len(pool.cached_block_hash_to_block)}

    def steps(self, n: int, phase: str, arrivals: bool = True) -> None:
        wl = self.workload
        for _ in range(n):
            turns = wl.arrivals() if arrivals else []
            plans = wl.hints()
            if self.shape.hints_in_warmup_only and phase != "warmup":
                plans = []
            if plans and self.sender is not None:
                self.sender.submit(plans)
            stock_done, kv_done = self._both(lambda side: side.step(turns))
            if self.clock is not None:
                self.clock.tick()
            for rid in stock_done:
                wl.finished(rid)
            self._record(phase, len(plans))

    def drain(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not (self.stock.inproc.busy(self.stock.sched) or self.kv.inproc.busy(self.kv.sched)):
                return
            self.steps(1, "drain", arrivals=False)
        raise RuntimeError("schedulers still busy")

    def quiet(self, rounds: int, batch: int = 32) -> None:
        """Steps in which nothing changes: resumed sessions whose prompts are cached up to the last
        token decode inside one block (no block stored, none evicted, no hint)."""
        wl, bs = self.workload, self.shape.block_size
        for r in range(rounds):
            picks = wl.recently_finished(batch)
            turns = []
            for s in picks:
                prompt = wl.prompt_of(s)[: self.shape.system_tokens + len(s.context)]
                cut = (len(prompt) // bs - 1) * bs + 1
                turns.append(Turn(f"{s.session_id}-q{r}", prompt[:cut], s.session_id, f"{s.session_id}/q", bs - 4))
            stock_done, _ = self._both(lambda side: side.step(turns))
            self._record("quiet-admit")
            while self.stock.inproc.busy(self.stock.sched) or self.kv.inproc.busy(self.kv.sched):
                self._both(lambda side: side.step([]))
                self._record("quiet")

    def fill_and_freeze(self, freeze_first: bool = False) -> dict[str, int]:
        """`fill()`, then freeze the heap as EngineCore does after start-up: the pool's objects
        leave the GC's young generations. `freeze_first`: freeze before the fill instead, as
        EngineCore freezes before it serves, so what the fill builds (standing in for a serving
        history: KvHint's index, the sessions' state) stays in the collector's generations.
        Returns what was admitted."""
        if freeze_first:
            gc.collect()
            gc.freeze()
            return self.fill()
        fill = self.fill()
        if self.collect:
            gc.collect()
        gc.freeze()
        return fill

    def run(self) -> dict[str, Any]:
        shape = self.shape
        fill = self.fill_and_freeze()
        self.steps(shape.warmup_steps, "warmup")
        self.steps(shape.steps, "steady")
        self.drain()
        self.quiet(shape.quiet_rounds)
        return fill

    @contextmanager
    def around_steps(self, around: Callable[[str, Callable[[], Any]], Any]) -> Iterator[None]:
        """Inside the block, each side's step and the KvHint side's settle run as
        `around(region, call)`: region is the side's name or "settle", `call()` does the work and
        `around` returns its result (diagnostics that trace or count a region)."""
        saved: list[tuple[Any, str, Any]] = []
        for side in (self.stock, self.kv):
            saved.append((side, "step", side.step))

            def step(turns: Any, _step: Any = side.step, _name: str = side.name) -> Any:
                return around(_name, lambda: _step(turns))

            side.step = step  # type: ignore[method-assign]
        kv = self.kv
        saved.append((kv, "settle", kv.settle))

        def settle(_settle: Any = kv.settle) -> Any:
            return around("settle", _settle)

        kv.settle = settle  # type: ignore[method-assign]
        try:
            yield
        finally:
            for obj, name, fn in saved:
                setattr(obj, name, fn)

    def close(self) -> None:
        self.stock.close()
        self.kv.close()
        # The pair's objects become ordinary garbage again. No collection here: the next pair's
        # fill_and_freeze collects before it freezes (each full collection of a large heap
        # costs a noticeable fraction of a second).
        gc.unfreeze()


class _Rid:
    """The attribute `inproc.default_sample` reads from a request."""

    __slots__ = ("request_id",)

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


def _filler(i: int, n: int) -> list[int]:
    return tokens(f"filler-{i}", n)


def balanced_ratio(units: Sequence[Unit]) -> float:
    """The per-step KvHint / stock CPU ratio with the step order balanced out: the geometric mean
    of the median ratio of the steps where the KvHint side ran first and of those where it ran
    second (the order moves a step's ratio by points either way; a fixed seed gives every run the
    same split of the two, so the pooled median leans to one). The pooled median when one order
    has no step."""
    first = [u.kv_ns / u.stock_ns for u in units if u.kv_first]
    second = [u.kv_ns / u.stock_ns for u in units if not u.kv_first]
    if not first or not second:
        return statistics.median(u.kv_ns / u.stock_ns for u in units)
    return float((statistics.median(first) * statistics.median(second)) ** 0.5)
