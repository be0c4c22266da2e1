"""ResidencyJournal (kvhint_server/journal.py): order, back-pressure, errors, the settler thread,
and the core's deferral decision (KvHintCore.record / exclusive)."""

from __future__ import annotations

import time

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvhint_server.config import ConfigError, ServerConfig
from kvhint_server.core import KvHintCore
from kvhint_server.journal import ResidencyJournal
from kvhint_server.model import RemovalCause, Tier


def _wait(predicate, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.002)
    return predicate()


# Each step: ("record", x) (what the engine thread's hooks call: journaled or run now, as the
# journal's mode and open holds say), ("defer", x) (append), ("run", x) (an inline record),
# ("settle", limit), ("deadline", None) (a settle whose deadline has passed: one entry),
# ("hold", None) / ("release", None) (an exclusive section: everything journaled settled, then
# records run now until its end), ("start", None) / ("stop", None) (deferred mode on, off).
# x < 0 is an entry that fails.
_entry = st.integers(-2, 9)  # one in six fails
_kinds = st.sampled_from(["record"] * 4 + ["defer", "run", "settle", "deadline", "hold", "release", "start", "stop"])


@st.composite
def _op(draw: st.DrawFn) -> tuple[str, int | None]:
    kind = draw(_kinds)
    if kind in ("record", "defer", "run"):
        return kind, draw(_entry)
    return kind, draw(st.one_of(st.none(), st.integers(0, 3))) if kind == "settle" else None


_ops = st.lists(_op(), min_size=10, max_size=40)


# An entry journaled before an inline record fails: logged, and the record still applies (the
# journal used to raise the earlier entry's error to the record's caller and drop the record).
@example(deferred=False, ops=[("defer", -1), ("record", 0), ("record", 1)], max_entries=2)
@example(deferred=True, ops=[("record", -1), ("run", 0), ("record", 1), ("settle", None)], max_entries=4)
# Back-pressure settles a failing entry; a hold opened while deferring books inline until it ends.
@example(deferred=True, ops=[("record", 0), ("record", -1), ("hold", None), ("record", 1), ("release", None),
                             ("record", 2)], max_entries=2)
@settings(max_examples=200, deadline=None)
@given(deferred=st.booleans(), ops=_ops, max_entries=st.integers(1, 8))
def test_entries_apply_once_in_record_order_whatever_the_settle_points(
    deferred: bool, ops: list[tuple[str, object]], max_entries: int
) -> None:
    """Whatever the mode, the open holds, back-pressure and settle points: every entry is applied
    once, in record order; a record runs at once outside deferred mode or inside a hold, and is
    journaled otherwise (never more than max_entries pending); an entry that fails is logged when
    the journal settles it, or raised to its own caller when it runs at once, counted in `errors`
    either way, and never costs a later entry its turn."""
    journal = ResidencyJournal(max_entries=max_entries)
    if deferred:
        journal.start(thread=False)
    attempted: list[int] = []  # entries applied (or, failing ones, tried), in order
    recorded: list[int] = []

    def entry(x: int) -> None:
        attempted.append(x)
        if x < 0:
            raise ValueError(f"entry {x} fails")

    holds = 0
    for kind, x in ops:
        if kind in ("record", "defer", "run"):
            assert isinstance(x, int)
            recorded.append(x)
            direct = kind == "run" or (kind == "record" and (not journal.deferring or holds > 0))
            call = (
                (lambda: journal.record(entry, x)) if kind == "record"
                else (lambda: journal.append(entry, (x,))) if kind == "defer"
                else (lambda: journal.run(entry, (x,)))
            )
            pending, backpressure = journal.pending(), journal.backpressure
            if direct and x < 0:
                with pytest.raises(ValueError, match=f"entry {x} fails"):
                    call()  # its own failure reaches the caller, as inline
            else:
                call()  # a failure journaled before it is not this caller's
            if direct:
                assert journal.pending() == 0 and attempted[-1] == x  # applied now, after all before it
            elif journal.backpressure == backpressure:
                assert journal.pending() == pending + 1 < max_entries  # journaled, not applied
            else:
                assert journal.pending() == 0 and pending + 1 == max_entries  # back-pressure settled the full journal
        elif kind == "settle":
            journal.settle(x)  # type: ignore[arg-type]
        elif kind == "deadline":
            pending = journal.pending()
            assert journal.settle(deadline=time.perf_counter() - 1) == min(1, pending)
        elif kind == "hold":  # as KvHintCore.exclusive()
            with journal.lock:
                journal.settle()
                journal.hold()
            holds += 1
        elif kind == "release" and holds:
            journal.release()
            holds -= 1
        elif kind == "start":
            journal.start(thread=False)
        elif kind == "stop":
            journal.stop()
        assert attempted == recorded[: len(attempted)]  # never out of order, never twice
        assert journal.pending() == len(recorded) - len(attempted)
        assert journal.errors == sum(1 for e in attempted if e < 0)  # every failure: logged, or raised inline
    journal.stop()
    assert attempted == recorded


def test_a_failing_entry_is_logged_and_later_entries_still_apply(caplog: pytest.LogCaptureFixture) -> None:
    journal = ResidencyJournal()
    applied: list[int] = []

    def boom() -> None:
        raise ValueError("bad entry")

    journal.append(applied.append, (1,))
    journal.append(boom, ())
    journal.append(applied.append, (2,))
    assert journal.settle() == 3
    assert applied == [1, 2] and journal.errors == 1
    assert "bad entry" in caplog.text
    # Inline, the error reaches the caller (as an inline hook's would), after the earlier entries.
    journal.append(applied.append, (3,))
    with pytest.raises(ValueError):
        journal.run(boom, ())
    assert applied == [1, 2, 3] and journal.errors == 2  # counted as the journaled one was


def test_the_settler_thread_applies_entries_and_stop_applies_the_rest() -> None:
    journal = ResidencyJournal()
    applied: list[int] = []
    journal.start(interval_s=0.001)
    assert journal.deferring
    for i in range(500):
        journal.append(applied.append, (i,))
    assert _wait(lambda: len(applied) == 500)
    assert applied == list(range(500))
    journal.stop()
    assert not journal.deferring
    journal.append(applied.append, (500,))  # stopped: nothing settles on its own now...
    journal.stop()  # ...but stop settles what is left
    assert applied[-1] == 500 and journal.pending() == 0


def test_the_settler_sleeps_until_a_step_boundary_wakes_it() -> None:
    """Between wake-ups the settler does not look (its interval here: a minute), so it never
    wakes up in the middle of the engine's step; `wake()` at a boundary brings it at once, and
    stop() does not wait out the interval either."""
    journal = ResidencyJournal()
    applied: list[int] = []
    journal.wake()  # nothing journaled: a no-op
    assert journal._wakeups.qsize() == 0
    journal.append(applied.append, (0,))
    journal.wake()
    journal.wake()
    assert journal._wakeups.qsize() == 1  # one wake-up queued at a time
    journal.start(interval_s=60.0)
    try:
        assert _wait(lambda: applied == [0], timeout=2.0)  # the queued wake-up
        time.sleep(0.05)
        journal.append(applied.append, (1,))
        time.sleep(0.1)
        assert applied == [0] and journal.pending() == 1  # no boundary yet: not settled
        journal.wake()
        assert _wait(lambda: applied == [0, 1], timeout=2.0)
    finally:
        t = time.monotonic()
        journal.stop()
        assert time.monotonic() - t < 2.0
    assert journal._wakeups.empty()


def test_the_settler_waits_for_a_section_holding_the_lock() -> None:
    journal = ResidencyJournal()
    applied: list[int] = []
    journal.start(interval_s=0.001)
    try:
        with journal.lock:
            journal.append(applied.append, (1,))
            time.sleep(0.05)
            assert applied == []  # the settler cannot book under a section's feet
        assert _wait(lambda: applied == [1])
    finally:
        journal.stop()


def test_core_defers_only_when_the_settler_runs_and_no_section_is_open() -> None:
    core = KvHintCore(ServerConfig())
    seen: list[int] = []  # what an adapter's booking steps booked, in order
    core.record(seen.append, 1)
    assert seen == [1]  # not deferring: inline
    core.journal.start(thread=False)
    core.record(seen.append, 2)
    assert core.journal.pending() == 1 and len(seen) == 1
    with core.exclusive():
        assert core.journal.pending() == 0 and seen == [1, 2]  # settled first
        core.record(seen.append, 3)  # inside a section: inline
        assert seen == [1, 2, 3]
    core.ledger.grants["owner"] = object()  # type: ignore[index,assignment]  # a grant in effect
    core.record(seen.append, 4)  # still deferred: entries never touch the ledger
    assert seen == [1, 2, 3] and core.journal.pending() == 1
    core.ledger.grants.clear()
    core.record(seen.append, 5)
    assert core.journal.pending() == 2
    core.stop()  # stopping the core settles the journal
    assert seen == [1, 2, 3, 4, 5]


def test_nested_sections_and_a_start_inside_one_keep_recording_inline_until_the_last_ends() -> None:
    """The journal's one "run now" flag (what `record` reads on the engine thread's hot path)
    follows nested exclusive sections and a start or stop made inside one."""
    core = KvHintCore(ServerConfig())
    seen: list[int] = []
    with core.exclusive():
        core.journal.start(thread=False)  # deferral switched on inside a section...
        core.record(seen.append, 1)
        assert seen == [1]  # ...does not defer what the section books
        with core.exclusive():
            core.record(seen.append, 2)
        core.record(seen.append, 3)  # the outer section is still open
        assert seen == [1, 2, 3] and core.journal.pending() == 0
    core.record(seen.append, 4)  # the last section ended: deferred
    assert seen == [1, 2, 3] and core.journal.pending() == 1
    with core.exclusive():
        assert seen == [1, 2, 3, 4]
        core.journal.stop()  # stopped inside a section: inline after it too
    core.record(seen.append, 5)
    assert seen == [1, 2, 3, 4, 5] and core.journal.pending() == 0


def test_grants_end_on_the_calling_thread_and_the_booking_leaves_the_ledger_alone(harness) -> None:  # type: ignore[no-untyped-def]
    """`drop_grants` ends a removed block's grants at once; `on_removed(grants_dropped=True)`
    and `on_cleared(..., grants_dropped=True)`, which a journal entry may run later on another
    thread, do not touch the ledger (which the engine thread may have changed since)."""
    core = harness.core

    def steps() -> None:
        now = core.monotonic()
        core.ledger.grant("s:s", [b"a", b"b"], pinned=False, priority=0, deadline=now + 60, expires_at=now + 60)
        assert core.drop_grants([b"a", b"x"]) == ["s"]
        assert set(core.ledger.grants) == {b"b"}
        core.on_removed([b"b"], tier=Tier.DEVICE, medium="GPU", cause=RemovalCause.EVICTED, grants_dropped=True)
        assert set(core.ledger.grants) == {b"b"}  # left alone
        core.on_removed([b"b"], tier=Tier.DEVICE, medium="GPU", cause=RemovalCause.EVICTED)
        assert not core.ledger.grants  # an engine that books inline lets on_removed end them
        core.ledger.grant("s:s", [b"c"], pinned=True, priority=0, deadline=now + 60, expires_at=now + 60)
        core.on_cleared(Tier.DEVICE, grants_dropped=True)
        assert set(core.ledger.grants) == {b"c"}
        core.clear_grants()
        assert not core.ledger.grants

    harness.engine.run(steps)


def test_the_bookkeeping_setting_is_checked() -> None:
    assert ServerConfig().residency_bookkeeping == "auto"
    assert ServerConfig.from_env({"KVHINT_RESIDENCY_BOOKKEEPING": "deferred"}).residency_bookkeeping == "deferred"
    with pytest.raises(ConfigError, match="KVHINT_RESIDENCY_BOOKKEEPING='later': expected one of auto, inline, deferred"):
        ServerConfig.from_env({"KVHINT_RESIDENCY_BOOKKEEPING": "later"})


# ---------------------------------------------------------------- the settler's young collections


@pytest.fixture
def collector() -> object:
    """A known threshold for the test, the process's own restored after it."""
    import gc

    saved, enabled = gc.get_threshold(), gc.isenabled()
    gc.set_threshold(10_000, 10, 10)
    gc.enable()
    # The heap so far (vLLM's, the test session's) leaves the generations for the test, so the
    # collection that zeroes every generation's count is quick; it is given back afterwards.
    frozen_before = gc.get_freeze_count()
    gc.freeze()
    gc.collect()
    try:
        yield gc
    finally:
        if not frozen_before:
            gc.unfreeze()
        gc.set_threshold(*saved)
        if not enabled:
            gc.disable()


def _young(gc, n: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    kept = [[i] for i in range(n)]  # n young container objects, kept alive
    assert gc.get_count()[0] >= n * 0.9
    return kept


def test_collect_young_waits_for_a_fifth_of_the_threshold(collector) -> None:  # type: ignore[no-untyped-def]
    gc, journal = collector, ResidencyJournal()
    kept = _young(gc, 1_000)  # a tenth of 10 000
    assert not journal.collect_young() and journal.collections == 0
    kept += _young(gc, 1_500)  # past 2 000
    before = gc.get_count()[1]
    assert journal.collect_young() and journal.collections == 1
    assert gc.get_count()[0] < 100  # the young generation was collected...
    assert gc.get_count()[1] == before + 1  # ...and only it (generation 1 counts one more)
    assert len(kept) == 2_500


def test_collect_young_collects_generation_1_when_cpython_would(collector) -> None:  # type: ignore[no-untyped-def]
    gc, journal = collector, ResidencyJournal()
    for _ in range(11):
        gc.collect(0)  # generation 1's count past its threshold: CPython's next collection includes it
    kept = _young(gc, 2_500)
    assert journal.collect_young()
    assert gc.get_count()[0] < 100 and gc.get_count()[1:] == (0, 1)
    assert len(kept) == 2_500


def test_collect_young_lets_cpython_choose_a_full_collection(collector) -> None:  # type: ignore[no-untyped-def]
    """The oldest generation's count past its threshold, and few long-lived objects (the
    fixture froze the heap): CPython's heuristic takes the full collection, on this thread."""
    gc, journal = collector, ResidencyJournal()
    for _ in range(11):
        gc.collect(1)
    for _ in range(11):
        gc.collect(0)
    kept = _young(gc, 2_500)
    threads: list[int] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            threads.append(info["generation"])

    gc.callbacks.append(seen)
    try:
        assert journal.collect_young() and journal.collections == 1
    finally:
        gc.callbacks.remove(seen)
    assert threads == [2] and gc.get_count()[1:] == (0, 0)
    assert len(kept) == 2_500


def test_collect_young_goes_on_when_cpython_declines_the_full_collection(collector) -> None:  # type: ignore[no-untyped-def]
    """The oldest generation's count past its threshold, but many long-lived objects and few
    new ones: CPython declines the full collection (its long-lived heuristic) and collects
    generation 1. The settler's collections go on through that state, which can last for
    the rest of a steady engine's life, instead of leaving every young collection to the
    engine thread."""
    gc, journal = collector, ResidencyJournal()
    old = [[i] for i in range(200_000)]
    gc.collect()  # a large oldest generation: the heuristic's yardstick
    for _ in range(11):
        gc.collect(1)
    for _ in range(11):
        gc.collect(0)
    assert gc.get_count()[1:] == (11, 11)
    kept: list[list[int]] = []
    for round_ in range(3):
        kept += _young(gc, 2_500)
        assert journal.collect_young() and journal.collections == round_ + 1
        assert gc.get_count()[:2] == (0, 0) and gc.get_count()[2] > 10  # generation 1, not a full one
        for _ in range(11):
            gc.collect(0)
    assert len(old) == 200_000 and len(kept) == 7_500


def test_collect_young_does_nothing_with_the_collector_disabled(collector) -> None:  # type: ignore[no-untyped-def]
    gc, journal = collector, ResidencyJournal()
    kept = _young(gc, 3_000)
    gc.disable()
    try:
        assert not journal.collect_young() and gc.get_count()[0] >= 2_000
    finally:
        gc.enable()
    assert len(kept) == 3_000


def test_the_settler_thread_collects_after_draining(collector) -> None:  # type: ignore[no-untyped-def]
    gc, journal = collector, ResidencyJournal()
    kept = _young(gc, 3_000)
    journal.start()
    try:
        journal.append(lambda: None, ())
        assert _wait(lambda: journal.collections >= 1)
        assert gc.get_count()[0] < 2_000
    finally:
        journal.stop()
    assert len(kept) == 3_000


def test_the_settler_thread_does_not_collect_while_the_engine_steps(collector) -> None:  # type: ignore[no-untyped-def]
    gc, journal = collector, ResidencyJournal()
    kept = _young(gc, 3_000)
    stepping = [True]
    journal.start(busy=lambda: stepping[0])
    try:
        journal.append(lambda: None, ())
        time.sleep(0.05)
        assert journal.pending() == 1 and journal.collections == 0
        stepping[0] = False
        assert _wait(lambda: journal.collections >= 1 and journal.pending() == 0)
    finally:
        journal.stop()
    assert len(kept) == 3_000


def test_the_settler_collects_after_a_drain_it_did_not_do(collector) -> None:  # type: ignore[no-untyped-def]
    """An exclusive section on the engine thread settles the journal itself; the settler still
    collects the garbage those entries made, at its next look outside a step."""
    gc, journal = collector, ResidencyJournal()
    stepping = [True]
    journal.start(busy=lambda: stepping[0])
    try:
        journal.append(lambda: None, ())
        assert journal.settle() == 1  # as KvHintCore.exclusive() does
        kept = _young(gc, 3_000)
        time.sleep(0.05)
        assert journal.collections == 0  # the engine is stepping
        stepping[0] = False
        assert _wait(lambda: journal.collections >= 1)
        count = journal.collections
        kept += _young(gc, 3_000)  # garbage that no entry made
        time.sleep(0.05)
        assert journal.collections == count  # nothing new recorded: the settler leaves it alone
    finally:
        journal.stop()
    assert len(kept) == 6_000


# ---------------------------------------------------------------- generation 1 while the settler collects


def _gen1_collections(gc, journal: ResidencyJournal, chunks: int, chunk: int) -> int:  # type: ignore[no-untyped-def]
    """Allocate `chunks` x `chunk` young objects, kept alive, calling collect_young after each
    chunk as the settler does after each settle; count the generation-1 collections (full ones
    included) that ran meanwhile."""
    seen: list[int] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] >= 1:
            seen.append(info["generation"])

    kept: list[list[int]] = []
    gc.callbacks.append(on_gc)
    try:
        for _ in range(chunks):
            kept += _young(gc, chunk)
            journal.collect_young()
    finally:
        gc.callbacks.remove(on_gc)
    assert len(kept) == chunks * chunk
    return len(seen)


def test_young_collections_at_a_fifth_run_generation_1_as_often_as_cpythons_trigger(collector) -> None:  # type: ignore[no-untyped-def]
    """210 000 allocations: CPython's own trigger (threshold 10 000) would run 21 young
    collections and 2 of generation 1. The settler collects at a fifth of the threshold, 100
    young collections; owning them scales generation 1's threshold, so generation 1 still runs
    about twice, not ten times (each time moving what is alive to the oldest generation)."""
    gc = collector
    unscaled = ResidencyJournal()
    assert _gen1_collections(gc, unscaled, 100, 2_100) >= 8  # what the settler did before the scaling
    gc.collect()
    journal = ResidencyJournal()
    journal.start(thread=False)
    journal.own_young_collections()
    try:
        assert gc.get_threshold() == (10_000, 50, 10)
        assert _gen1_collections(gc, journal, 100, 2_100) <= 3
        assert journal.collections >= 90  # the young collections themselves still ran, here
    finally:
        journal.stop()
    assert gc.get_threshold() == (10_000, 10, 10)


def test_the_settler_thread_scales_generation_1_until_it_stops(collector) -> None:  # type: ignore[no-untyped-def]
    gc = collector
    journal = ResidencyJournal()
    journal.start()
    try:
        assert gc.get_threshold() == (10_000, 50, 10)
    finally:
        journal.stop()
    assert gc.get_threshold() == (10_000, 10, 10)
    journal.stop()  # a second stop releases nothing more
    assert gc.get_threshold() == (10_000, 10, 10)


def test_journals_in_one_process_share_one_scaling(collector) -> None:  # type: ignore[no-untyped-def]
    """The collector is the process's: two settlers (two engines, a benchmark's pair) scale it
    once, and it is restored when the last one stops."""
    gc = collector
    first, second = ResidencyJournal(), ResidencyJournal()
    first.start()
    second.start()
    second.own_young_collections()  # idempotent per journal
    try:
        assert gc.get_threshold() == (10_000, 50, 10)
        first.stop()
        assert gc.get_threshold() == (10_000, 50, 10)
    finally:
        first.stop()
        second.stop()
    assert gc.get_threshold() == (10_000, 10, 10)


def test_thresholds_set_while_the_settler_ran_are_kept(collector) -> None:  # type: ignore[no-untyped-def]
    gc = collector
    journal = ResidencyJournal()
    journal.start()
    try:
        gc.set_threshold(5_000, 7, 10)  # the operator's own tuning, after the settler started
    finally:
        journal.stop()
    assert gc.get_threshold() == (5_000, 7, 10)


def test_a_settler_that_starts_after_new_thresholds_scales_those(collector) -> None:  # type: ignore[no-untyped-def]
    gc = collector
    first, second = ResidencyJournal(), ResidencyJournal()
    first.start()
    try:
        gc.set_threshold(5_000, 7, 10)
        second.start()
        assert gc.get_threshold() == (5_000, 35, 10)
        second.stop()
        assert gc.get_threshold() == (5_000, 35, 10)  # the first settler still collects
    finally:
        second.stop()
        first.stop()
    assert gc.get_threshold() == (5_000, 7, 10)


def test_nothing_is_scaled_with_the_collector_disabled(collector) -> None:  # type: ignore[no-untyped-def]
    gc = collector
    gc.disable()
    journal = ResidencyJournal()
    try:
        journal.start()
        assert gc.get_threshold() == (10_000, 10, 10)
        gc.enable()
    finally:
        journal.stop()
        gc.enable()
    assert gc.get_threshold() == (10_000, 10, 10)
