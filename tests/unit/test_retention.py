"""RetentionLedger and DeadlineQueue.

The ledger decides the free-pool class of every block (docs/design.md §4): PINNED >
RETAINED (highest priority wins) > ORDINARY, and a grant whose deadline passed
counts as absent even if no expiry reclaimed it. The deadline queue only does
proactive cleanup, but it must hand back every due key exactly once however
irregularly it is advanced.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhint_server.model import RetentionClass, RetentionView
from kvhint_server.retention import RetentionLedger
from kvhint_server.deadlines import DeadlineQueue

BLOCKS = [b"\x01", b"\x02", b"\x03", b"\x04"]
OWNERS = ["s:a", "s:b", "c:k", "b:"]


def grant(ledger: RetentionLedger, owner: str, hashes, *, pinned=False, priority=0, deadline=10.0):
    # Wall-clock expiry = monotonic deadline + 1000, so the two are distinguishable.
    return ledger.grant(owner, hashes, pinned=pinned, priority=priority, deadline=deadline, expires_at=deadline + 1000)


# --------------------------------------------------------------------------- ledger: examples


def test_pinned_beats_retained_beats_ordinary():
    ledger = RetentionLedger(pin_budget_blocks=10)
    h = BLOCKS[0]
    assert ledger.view(h, 0.0).cls is RetentionClass.ORDINARY
    grant(ledger, "s:a", [h], priority=-7, deadline=50)
    v = ledger.view(h, 0.0)
    assert (v.cls, v.priority, v.expires_at) == (RetentionClass.RETAINED, -7, 1050)  # negative priority is still retained
    grant(ledger, "s:b", [h], priority=3, deadline=40)
    v = ledger.view(h, 0.0)
    assert (v.cls, v.priority, v.expires_at) == (RetentionClass.RETAINED, 3, 1040)  # highest priority wins
    grant(ledger, "c:k", [h], pinned=True, deadline=20)
    assert ledger.view(h, 0.0) == RetentionView(RetentionClass.PINNED, 0, 1020)
    # As deadlines pass, the next strongest grant shows, without any expire() call.
    assert ledger.view(h, 20.0) == RetentionView(RetentionClass.RETAINED, 3, 1040)
    assert ledger.view(h, 40.0) == RetentionView(RetentionClass.RETAINED, -7, 1050)
    assert ledger.view(h, 50.0).cls is RetentionClass.ORDINARY
    assert ledger.view(h, 1e9).cls is RetentionClass.ORDINARY


def test_missed_tick_never_extends_protection():
    """A block whose deadline passed is ordinary again even if expire() never ran."""
    ledger = RetentionLedger(pin_budget_blocks=10)
    grant(ledger, "s:a", BLOCKS[:2], pinned=True, deadline=5.0)
    grant(ledger, "s:b", BLOCKS[2:], priority=9, deadline=5.0)
    for h in BLOCKS:
        assert ledger.view(h, 4.999).cls is not RetentionClass.ORDINARY
        assert ledger.view(h, 5.0).cls is RetentionClass.ORDINARY
    assert ledger.pinned_by_other(BLOCKS[0], "s:b", 4.9)
    assert not ledger.pinned_by_other(BLOCKS[0], "s:b", 5.0)
    assert ledger.owner_view("s:a", 4.0).cls is RetentionClass.PINNED
    assert ledger.owner_view("s:a", 5.0).cls is RetentionClass.ORDINARY
    assert ledger.owner_view("s:b", 6.0).cls is RetentionClass.ORDINARY
    # The late expire() reclaims exactly the expired grants.
    assert sorted(set(ledger.expire(100.0))) == sorted(BLOCKS)
    assert not ledger.grants and ledger.pinned_blocks == 0


def test_regrant_replaces_deadline_and_class_for_the_same_owner():
    ledger = RetentionLedger(pin_budget_blocks=10)
    h = BLOCKS[0]
    grant(ledger, "s:a", [h], pinned=True, deadline=5.0)
    assert ledger.pinned_blocks == 1
    grant(ledger, "s:a", [h], priority=2, deadline=50.0)  # now only retained
    assert ledger.pinned_blocks == 0 and not ledger.is_pinned(h)
    assert ledger.view(h, 10.0) == RetentionView(RetentionClass.RETAINED, 2, 1050)
    # The old deadline no longer expires the grant.
    assert ledger.expire(10.0) == []
    assert ledger.view(h, 10.0).cls is RetentionClass.RETAINED
    assert ledger.expire(50.0) == [h]


def test_release_per_owner_leaves_other_owners_grants():
    ledger = RetentionLedger(pin_budget_blocks=10)
    grant(ledger, "s:a", BLOCKS[:3], pinned=True, deadline=100)
    grant(ledger, "s:b", BLOCKS[1:], priority=4, deadline=100)
    assert sorted(ledger.release("s:a")) == sorted(BLOCKS[:3])
    assert ledger.view(BLOCKS[0], 0).cls is RetentionClass.ORDINARY
    for h in BLOCKS[1:]:
        assert ledger.view(h, 0) == RetentionView(RetentionClass.RETAINED, 4, 1100)
        assert ledger.owners(h) == ("s:b",)
    assert ledger.pinned_blocks == 0
    assert ledger.release("s:a") == []  # nothing left to release
    # Partial release by hashes only touches those blocks.
    assert ledger.release("s:b", [BLOCKS[1], BLOCKS[0]]) == [BLOCKS[1]]
    assert ledger.owned_by("s:b") == set(BLOCKS[2:])
    # A released grant is not reported again by expire().
    assert sorted(ledger.expire(1000)) == sorted(BLOCKS[2:])


def test_pin_budget_counts_distinct_blocks_across_overlapping_owners():
    ledger = RetentionLedger(pin_budget_blocks=3)
    assert ledger.pin_headroom() == 3
    grant(ledger, "s:a", BLOCKS[:2], pinned=True, deadline=10)
    grant(ledger, "s:b", BLOCKS[1:3], pinned=True, deadline=20)
    assert ledger.pinned_blocks == 3  # blocks 0, 1, 2: block 1 counted once
    assert ledger.pin_headroom() == 0
    grant(ledger, "s:b", BLOCKS[1:3], pinned=True, deadline=30)  # re-pin: no double count
    assert ledger.pinned_blocks == 3
    ledger.release("s:a")
    assert ledger.pinned_blocks == 2 and ledger.is_pinned(BLOCKS[1])  # still pinned by s:b
    assert ledger.pin_headroom() == 1
    grant(ledger, "s:a", [BLOCKS[3]], pinned=True, deadline=5)
    assert ledger.pin_headroom() == 0
    ledger.expire(5.0)  # s:a's pin on block 3 expires
    assert ledger.pinned_blocks == 2 and ledger.pin_headroom() == 1
    ledger.expire(30.0)
    assert ledger.pinned_blocks == 0 and ledger.pin_headroom() == 3


def test_drop_block_forgets_every_grant_on_that_block_only():
    ledger = RetentionLedger(pin_budget_blocks=10)
    grant(ledger, "s:a", BLOCKS[:2], pinned=True, deadline=10)
    grant(ledger, "s:b", BLOCKS[:2], priority=1, deadline=10)
    assert sorted(ledger.drop_block(BLOCKS[0])) == ["s:a", "s:b"]
    assert ledger.drop_block(BLOCKS[0]) == ()
    assert ledger.view(BLOCKS[0], 0).cls is RetentionClass.ORDINARY
    assert ledger.view(BLOCKS[1], 0).cls is RetentionClass.PINNED
    assert ledger.pinned_blocks == 1
    assert ledger.owned_by("s:a") == {BLOCKS[1]}
    # The dropped block's timers are gone too.
    assert set(ledger.expire(10.0)) == {BLOCKS[1]}


def test_equal_priority_retention_reports_when_protection_ends():
    ledger = RetentionLedger(pin_budget_blocks=10)
    h = BLOCKS[0]
    grant(ledger, "s:a", [h], priority=5, deadline=10)
    grant(ledger, "s:b", [h], priority=5, deadline=100)
    # The block stays RETAINED at priority 5 until t=100.
    assert ledger.view(h, 50.0) == RetentionView(RetentionClass.RETAINED, 5, 1100)
    assert ledger.view(h, 0.0).expires_at == 1100


# --------------------------------------------------------------------------- ledger: random sequences

op = st.one_of(
    st.tuples(
        st.just("grant"),
        st.sampled_from(OWNERS),
        st.lists(st.sampled_from(BLOCKS), min_size=1, max_size=4),
        st.booleans(),
        st.integers(-3, 3),
        st.floats(0.0, 30.0),
    ),
    st.tuples(st.just("release"), st.sampled_from(OWNERS), st.none() | st.lists(st.sampled_from(BLOCKS), max_size=3)),
    st.tuples(st.just("drop"), st.sampled_from(BLOCKS)),
    st.tuples(st.just("advance"), st.floats(0.0, 12.0)),
    st.tuples(st.just("expire")),
)


def _model_view(grants: dict[tuple[bytes, str], tuple[bool, int, float]], h: bytes, now: float):
    live = [(p, pr, d) for (b, _), (p, pr, d) in grants.items() if b == h and d > now]
    pins = [d for p, _, d in live if p]
    if pins:
        return RetentionClass.PINNED, 0, {max(pins) + 1000}
    if live:
        best = max(pr for _, pr, _ in live)
        return RetentionClass.RETAINED, best, {d + 1000 for p, pr, d in live if pr == best}
    return RetentionClass.ORDINARY, 0, {None}


@settings(max_examples=200, deadline=None)
@given(st.lists(op, max_size=40))
def test_ledger_matches_model(ops):
    ledger = RetentionLedger(pin_budget_blocks=3)
    grants: dict[tuple[bytes, str], tuple[bool, int, float]] = {}
    now = 0.0
    for o in ops:
        kind = o[0]
        if kind == "grant":
            _, owner, hashes, pinned, prio, ttl = o
            grant(ledger, owner, hashes, pinned=pinned, priority=prio, deadline=now + ttl)
            for h in hashes:
                grants[(h, owner)] = (pinned, prio, now + ttl)
        elif kind == "release":
            _, owner, hashes = o
            got = ledger.release(owner, hashes)
            want = {h for (h, ow) in grants if ow == owner and (hashes is None or h in hashes)}
            assert set(got) == want
            for h in want:
                del grants[(h, owner)]
        elif kind == "drop":
            _, h = o
            got = ledger.drop_block(h)
            want = {ow for (b, ow) in grants if b == h}
            assert set(got) == want
            for ow in want:
                del grants[(h, ow)]
        elif kind == "advance":
            now += o[1]
        else:
            got = ledger.expire(now)
            want = [(h, ow) for (h, ow), (_, _, d) in grants.items() if d <= now]
            assert sorted(got) == sorted(h for h, _ in want), "expire() must return each expired grant's block"
            for key in want:
                del grants[key]
            # The pin budget counts distinct blocks with an unexpired pin.
            pinned = {h for (h, _), (p, _, _) in grants.items() if p}
            assert ledger.pinned_blocks == len(pinned)
            assert ledger.pin_headroom() == max(0, 3 - len(pinned))
        # One deadline entry per grant() call with a block still holding its grant: replaced,
        # released and dropped grants take their call out of the queue with its last block.
        assert len(ledger._calls) == len(ledger._deadlines) <= len(grants)
        # Views always follow deadlines, expire() or not.
        for h in BLOCKS:
            v = ledger.view(h, now)
            cls, prio, expiries = _model_view(grants, h, now)
            assert v.cls is cls and v.priority == prio
            assert v.expires_at in expiries
            assert set(ledger.owners(h)) == {ow for (b, ow) in grants if b == h}
        for owner in OWNERS:
            assert ledger.owned_by(owner) == {h for (h, ow) in grants if ow == owner}
            ov = ledger.owner_view(owner, now)
            mine = {k: g for k, g in grants.items() if k[1] == owner}
            live = [g for g in mine.values() if g[2] > now]
            if any(p for p, _, _ in live):
                assert ov.cls is RetentionClass.PINNED
            elif live:
                assert ov.cls is RetentionClass.RETAINED and ov.priority == max(pr for _, pr, _ in live)
            else:
                assert ov.cls is RetentionClass.ORDINARY
            for h in BLOCKS:
                others_pin = any(p and d > now for (b, ow), (p, _, d) in grants.items() if b == h and ow != owner)
                assert ledger.pinned_by_other(h, owner, now) is others_pin


# --------------------------------------------------------------------------- ledger: widely shared blocks

MANY_OWNERS = [f"s:{i}" for i in range(24)]

shared_op = st.one_of(
    st.tuples(
        st.just("grant"),
        st.lists(st.sampled_from(MANY_OWNERS), min_size=1, max_size=6),
        st.lists(st.sampled_from(BLOCKS[:2]), min_size=1, max_size=2),
        st.booleans(),
        st.integers(-2, 2),
        st.floats(0.0, 30.0),
        st.none() | st.floats(0.0, 40.0),
    ),
    st.tuples(st.just("release"), st.sampled_from(MANY_OWNERS)),
    st.tuples(st.just("drop"), st.sampled_from(BLOCKS[:2])),
    st.tuples(st.just("advance"), st.floats(0.0, 8.0)),
    st.tuples(st.just("expire")),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(shared_op, max_size=50), st.lists(st.floats(0.0, 60.0), min_size=1, max_size=4))
def test_heaped_view_matches_scanned_view(ops, probes):
    """A block with many owners is viewed through heaps; the answer is the scan's,
    whatever the replaced, released, dropped and expired grants, and for any `now`
    asked (earlier or later than the last)."""
    heaped = RetentionLedger(pin_budget_blocks=100)
    heaped.scan_owners = 2  # heaps from the third owner on (and down again at one)
    scanned = RetentionLedger(pin_budget_blocks=100)
    scanned.scan_owners = 1 << 30  # never heaps
    now = 0.0
    for o in ops:
        kind = o[0]
        for ledger in (heaped, scanned):
            if kind == "grant":
                _, owners, hashes, pinned, prio, ttl, reuse_in = o
                for owner in owners:
                    ledger.grant(owner, hashes, pinned=pinned, priority=prio, deadline=now + ttl,
                                 expires_at=now + ttl + 1000, reuse_at=None if reuse_in is None else now + reuse_in)
            elif kind == "release":
                ledger.release(o[1])
            elif kind == "drop":
                ledger.drop_block(o[1])
            elif kind == "expire":
                ledger.expire(now)
        if kind == "advance":
            now += o[1]
        for h in BLOCKS[:2]:
            for t in (now, *probes):
                assert heaped.view(h, t) == scanned.view(h, t)


# --------------------------------------------------------------------------- deadline queue

KEYS = list(range(8))

deadline_op = st.one_of(
    # deadline relative to now: past, imminent, soon, far
    st.tuples(st.just("schedule"), st.sampled_from(KEYS), st.one_of(
        st.floats(-5.0, 0.0), st.floats(0.0, 0.06), st.floats(0.0, 3.0), st.floats(0.0, 200.0),
    )),
    st.tuples(st.just("cancel"), st.sampled_from(KEYS)),
    # time jumps: none, tiny, a few ticks, long
    st.tuples(st.just("advance"), st.one_of(
        st.just(0.0), st.floats(0.0, 0.01), st.floats(0.0, 0.3), st.floats(0.0, 5.0), st.floats(0.0, 500.0),
    )),
)


@pytest.mark.parametrize("slack", [0, 3, 1024])
@settings(max_examples=150, deadline=None)
@given(start=st.floats(0.0, 1e6), ops=st.lists(deadline_op, max_size=60))
def test_deadline_queue_returns_each_due_key_exactly_once(slack, start, ops):
    queue: DeadlineQueue[int] = DeadlineQueue(compact_slack=slack)
    pending: dict[int, float] = {}
    now = start
    for o in ops:
        if o[0] == "schedule":
            deadline = now + o[2]
            queue.schedule(o[1], deadline)
            pending[o[1]] = deadline  # rescheduling replaces the deadline
        elif o[0] == "cancel":
            queue.cancel(o[1])
            pending.pop(o[1], None)
        else:
            now += o[1]
            due = queue.advance(now)
            want = sorted(k for k, d in pending.items() if d <= now)
            assert len(due) == len(set(due)), "a key was returned twice"
            assert sorted(due) == want, f"advance({now}) returned {sorted(due)}, expected {want}"
            assert [pending[k] for k in due] == sorted(pending[k] for k in due), "not earliest first"
            for k in want:
                del pending[k]
            assert queue.earliest > now, "nothing is due after advance: a call before `earliest` is skipped"
        assert len(queue) == len(pending)
        # `earliest` is a lower bound of every pending deadline (what lets hot paths skip advance).
        assert queue.earliest <= min(pending.values(), default=math.inf)
        # Stale entries (cancelled, rescheduled) stay bounded.
        assert queue.heap_entries() <= 2 * len(pending) + slack + 1
        for k in KEYS:
            assert (k in queue) is (k in pending)
            assert queue.deadline(k) == pending.get(k)
    # Whatever is left fires once time passes every deadline.
    final = max([now, *pending.values()]) + 1.0
    assert sorted(queue.advance(final)) == sorted(pending)
    assert queue.advance(final + 1e4) == [] and len(queue) == 0


def test_deadline_queue_rescheduling_churn_keeps_the_heap_bounded():
    """A grant re-applied every turn reschedules its key: the old entries must not pile up
    until their (far) deadlines pass, and each key fires once, at its last deadline."""
    queue: DeadlineQueue[int] = DeadlineQueue(compact_slack=16)
    for turn in range(10_000):
        queue.schedule(turn % 10, 1e6 + turn)
    assert len(queue) == 10
    assert queue.heap_entries() <= 2 * 10 + 16 + 1
    assert queue.advance(1e6 + 9_994.5) == [0, 1, 2, 3, 4]  # last deadlines 1e6 + 9_990 + k
    assert queue.advance(2e6) == [5, 6, 7, 8, 9]


def test_deadline_queue_rejects_negative_slack():
    with pytest.raises(ValueError):
        DeadlineQueue(compact_slack=-1)
