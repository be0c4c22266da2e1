"""RetentionLedger and DeadlineQueue.

The ledger decides the free-pool class of every block (docs/design.md §4): PINNED >
RETAINED (highest priority wins) > ORDINARY, and a grant whose deadline passed
counts as absent even if no expiry reclaimed it. The deadline queue only does
proactive cleanup, but it must hand back every due key exactly once however
irregularly it is advanced.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvhint_server.model import RetentionClass, RetentionView
from kvhint_server.retention import RetentionLedger
from kvhint_server.deadlines import DeadlineQueue

BLOCKS = [b"\x01", b"\x02", b"\x03", b"\x04"]
OWNERS = ["s:a", "s:b", "c:k", "b:"]


def grant(ledger: RetentionLedger, owner: str, hashes, *, pinned=False, priority=0, deadline=10.0, reuse_at=None):
    # Wall-clock expiry = monotonic deadline + 1000, so the two are distinguishable.
    return ledger.grant(
        owner, hashes, pinned=pinned, priority=priority, deadline=deadline, expires_at=deadline + 1000, reuse_at=reuse_at
    )


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


@pytest.mark.parametrize("pinned", [True, False])
def test_a_sessions_protection_is_reported_until_its_last_equally_strong_grant_ends(pinned):
    """owner_view (a session's retention in ListSessions) reports when the session's strongest
    protection ends: among equally strong grants on its blocks, the one that ends last, whichever
    block holds it. Both blocks take the longer grant in turn, so that the answer cannot depend
    on the order the session's blocks are kept in."""
    cls = RetentionClass.PINNED if pinned else RetentionClass.RETAINED
    for longer in BLOCKS[:2]:
        ledger = RetentionLedger(pin_budget_blocks=10)
        grant(ledger, "s:a", BLOCKS[:2], pinned=pinned, priority=4, deadline=10)
        grant(ledger, "s:a", [longer], pinned=pinned, priority=4, deadline=20)  # extends one of them
        grant(ledger, "s:a", [BLOCKS[2]], priority=1, deadline=30)  # weaker: not the session's protection
        for now in (0.0, 9.9, 10.0, 19.9):
            assert ledger.owner_view("s:a", now) == RetentionView(cls, 0 if pinned else 4, 1020), (longer, now)
        assert ledger.owner_view("s:a", 20.0) == RetentionView(RetentionClass.RETAINED, 1, 1030)


# --------------------------------------------------------------------------- ledger: random sequences

# Grants and steps come twice as often as the other operations, and two times in three are whole or
# quarter seconds (exact in binary, so sums of them meet exactly), so that grants overlap and time
# passes their deadlines within one sequence: an expiry with other grants left on the block, at
# exactly a deadline, equal deadlines, re-grants that extend or shorten. One grant in three is a
# pin (a pin hides the retained grants' order), and the priorities lean to two values, so that
# live retained grants on a block tie.
ttls = st.one_of(st.integers(0, 12).map(float), st.integers(0, 80).map(lambda q: q / 4), st.floats(0.0, 20.0))
steps = st.one_of(st.integers(0, 4).map(float), st.integers(0, 32).map(lambda q: q / 4), st.floats(0.0, 8.0))
pins = st.sampled_from([False, False, True])
priorities = st.one_of(st.integers(0, 1), st.integers(-3, 3))
reuse_in = st.none() | st.integers(0, 15).map(float) | st.floats(0.0, 40.0)

grant_op = st.tuples(
    st.just("grant"),
    st.sampled_from(OWNERS),
    st.lists(st.sampled_from(BLOCKS), min_size=1, max_size=4),
    pins,
    priorities,
    ttls,
    reuse_in,
)
advance_op = st.tuples(st.just("advance"), steps, st.booleans())  # then expire(now), or not
op = st.one_of(
    grant_op,
    advance_op,
    st.tuples(st.just("release"), st.sampled_from(OWNERS), st.none() | st.lists(st.sampled_from(BLOCKS), max_size=3)),
    grant_op,
    advance_op,
    st.tuples(st.just("drop"), st.sampled_from(BLOCKS)),
    st.tuples(st.just("drop_pins"), st.sampled_from(BLOCKS)),
)


class G(NamedTuple):
    """The model's grant (wall-clock expiry = deadline + 1000, as `grant` above)."""

    pinned: bool
    priority: int
    deadline: float
    reuse_at: float | None


def _model_view(grants: dict[tuple[bytes, str], G], h: bytes, now: float, owned=lambda owner: True) -> RetentionView:
    """The strongest unexpired grant on `h` (PINNED > RETAINED by priority; among equals, the one
    that ends last), with the earliest expected reuse among the unexpired grants that set one."""
    live = [g for (b, ow), g in grants.items() if b == h and owned(ow) and g.deadline > now]
    if not live:
        return RetentionView(RetentionClass.ORDINARY)
    reuse_at = min((g.reuse_at for g in live if g.reuse_at is not None), default=None)
    pins = [g.deadline for g in live if g.pinned]
    if pins:
        return RetentionView(RetentionClass.PINNED, 0, max(pins) + 1000, reuse_at)
    top = max(g.priority for g in live)
    return RetentionView(RetentionClass.RETAINED, top, max(g.deadline for g in live if g.priority == top) + 1000, reuse_at)


def _model_owner_view(grants: dict[tuple[bytes, str], G], owner: str, now: float) -> RetentionView:
    """The strongest unexpired grant `owner` holds on any block, and when the last of its equals ends."""
    live = [g for (_, ow), g in grants.items() if ow == owner and g.deadline > now]
    if not live:
        return RetentionView(RetentionClass.ORDINARY)
    strength = max((g.pinned, 0 if g.pinned else g.priority) for g in live)
    end = max(g.deadline for g in live if (g.pinned, 0 if g.pinned else g.priority) == strength)
    return RetentionView(RetentionClass.PINNED if strength[0] else RetentionClass.RETAINED, strength[1], end + 1000)


def _sessions_only(owner: str) -> bool:
    return owner.startswith("s:")


B0, B1, B2, B3 = BLOCKS


# Sequences of 10 or more steps: fewer can seldom both overlap grants and pass their deadlines.
@settings(max_examples=100, deadline=None)
@given(ops=st.lists(op, min_size=10, max_size=25), heaped=st.booleans())
# One owner's grant on a block expires, at exactly its deadline, while others go on; a re-grant
# shortens a pin to a retain and the pin's later deadline no longer counts; the pin budget is taken
# exactly, then given back by that re-grant, a release and a lost device copy (drop_pins), which
# leaves the other owners' retained grants on the block.
@example(ops=[
    ("grant", "s:a", [B0, B1, B2], True, 0, 10.0, None),
    ("grant", "s:b", [B0], False, 1, 6.0, 3.0),
    ("grant", "c:k", [B0, B1, B3], False, 1, 8.0, None),
    ("grant", "s:a", [B1], False, 2, 4.0, 9.0),
    ("advance", 4.0, True),
    ("advance", 2.0, True),
    ("release", "s:a", [B2]), ("drop_pins", B0),
    ("advance", 2.0, True),
], heaped=False)
# A block shared by every owner, with tied priorities and deadlines, loses them one by one.
@example(ops=[
    ("grant", "s:a", [B0], False, 1, 5.0, None),
    ("grant", "s:b", [B0, B1], False, 1, 7.0, 1.0),
    ("grant", "c:k", [B0], False, 1, 7.0, None),
    ("grant", "b:", [B0, B1], False, 0, 9.0, None),
    ("grant", "s:a", [B1], False, 1, 5.0, None),
    ("advance", 5.0, False), ("release", "s:b", [B1]),
    ("advance", 2.0, True), ("advance", 2.0, False),
], heaped=True)
def test_ledger_matches_model(ops, heaped):
    ledger = RetentionLedger(pin_budget_blocks=3)
    if heaped:  # a block with two owners or more is viewed through heaps (see the shared-block tests below)
        ledger.scan_owners = 1
    grants: dict[tuple[bytes, str], G] = {}
    now = 0.0
    for o in ops:
        kind = o[0]
        if kind == "grant":
            _, owner, hashes, pinned, prio, ttl, reuse = o
            reuse_at = None if reuse is None else now + reuse
            grant(ledger, owner, hashes, pinned=pinned, priority=prio, deadline=now + ttl, reuse_at=reuse_at)
            for h in hashes:  # replaces the owner's grant; an expected reuse is clamped to the deadline
                grants[(h, owner)] = G(pinned, prio, now + ttl, None if reuse_at is None else min(reuse_at, now + ttl))
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
        elif kind == "drop_pins":
            _, h = o
            got = ledger.drop_pins(h)
            want = {ow for (b, ow), g in grants.items() if b == h and g.pinned}
            assert sorted(got) == sorted(want), "drop_pins ends the pins on the block, and only them"
            for ow in want:
                del grants[(h, ow)]
        elif kind == "advance":
            now += o[1]
        if kind == "advance" and o[2]:
            got = ledger.expire(now)
            want = [(h, ow) for (h, ow), g in grants.items() if g.deadline <= now]
            assert sorted(got) == sorted(h for h, _ in want), "expire() must return each expired grant's block"
            for key in want:
                del grants[key]
        # The pin budget counts distinct blocks with a pin grant (callers expire() first, so that
        # only unexpired pins count).
        pinned = {h for (h, _), g in grants.items() if g.pinned}
        assert ledger.pinned_blocks == len(pinned)
        assert ledger.pin_headroom() == max(0, 3 - len(pinned))
        # One deadline entry per grant() call with a block still holding its grant: replaced,
        # released and dropped grants take their call out of the queue with its last block.
        assert len(ledger._calls) == len(ledger._deadlines) <= len(grants)
        # Views always follow deadlines, expire() or not.
        for h in BLOCKS:
            assert ledger.is_pinned(h) is (h in pinned)
            assert ledger.view(h, now) == _model_view(grants, h, now)
            assert ledger.view_of(h, now, _sessions_only) == _model_view(grants, h, now, _sessions_only)
            assert set(ledger.owners(h)) == {ow for (b, ow) in grants if b == h}
        for owner in OWNERS:
            assert ledger.owned_by(owner) == {h for (h, ow) in grants if ow == owner}
            assert ledger.owner_view(owner, now) == _model_owner_view(grants, owner, now)
            for h in BLOCKS:
                others_pin = any(g.pinned and g.deadline > now for (b, ow), g in grants.items() if b == h and ow != owner)
                assert ledger.pinned_by_other(h, owner, now) is others_pin


# --------------------------------------------------------------------------- ledger: widely shared blocks

MANY_OWNERS = [f"s:{i}" for i in range(24)]

shared_grant_op = st.tuples(
    st.just("grant"),
    st.lists(st.sampled_from(MANY_OWNERS), min_size=1, max_size=6),
    st.lists(st.sampled_from(BLOCKS[:2]), min_size=1, max_size=2),
    st.booleans(),
    st.one_of(st.integers(0, 1), st.integers(-2, 2)),
    ttls,
    reuse_in,
)
shared_advance_op = st.tuples(st.just("advance"), steps)
# As `op`: grants and steps twice as often, times on a quarter-second grid two times in three.
shared_op = st.one_of(
    shared_grant_op,
    shared_advance_op,
    st.tuples(st.just("release"), st.sampled_from(MANY_OWNERS)),
    shared_grant_op,
    shared_advance_op,
    st.tuples(st.just("drop"), st.sampled_from(BLOCKS[:2])),
    st.tuples(st.just("expire")),
)
probe_times = st.one_of(st.integers(0, 30).map(float), st.integers(0, 120).map(lambda q: q / 4), st.floats(0.0, 60.0))


@settings(max_examples=100, deadline=None)
@given(st.lists(shared_op, min_size=8, max_size=30), st.lists(probe_times, min_size=1, max_size=4))
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
                _, owners, hashes, pinned, prio, ttl, reuse = o
                for owner in owners:
                    ledger.grant(owner, hashes, pinned=pinned, priority=prio, deadline=now + ttl,
                                 expires_at=now + ttl + 1000, reuse_at=None if reuse is None else now + reuse)
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


def test_a_shared_block_regranted_every_turn_keeps_the_scans_answer_and_bounded_heaps():
    """A prefix retained by a few sessions that each re-grant it every turn, under one session's
    long pin: the replaced grants' heap entries sit below the pin, where no view reaches them, so
    only the rebuild on stale entries (RetentionLedger docstring) keeps them from piling up for as
    long as the pin lasts; and the answer stays the scan's through each rebuild."""
    heaped = RetentionLedger(pin_budget_blocks=100)
    heaped.scan_owners = 2
    scanned = RetentionLedger(pin_budget_blocks=100)
    scanned.scan_owners = 1 << 30
    h = BLOCKS[0]
    for ledger in (heaped, scanned):
        ledger.grant("s:pin", [h], pinned=True, priority=0, deadline=149.0, expires_at=1149.0)
    for turn in range(300):
        now = turn / 2
        owner = MANY_OWNERS[turn % 5]
        for ledger in (heaped, scanned):
            ledger.grant(owner, [h], pinned=False, priority=turn % 3, deadline=now + 3 + turn % 4,
                         expires_at=now + 1003 + turn % 4, reuse_at=now + turn % 5)
        for t in (now, now + 2.5):  # under the pin (but for the last turns)
            assert heaped.view(h, t) == scanned.view(h, t), (turn, t)
        heaps = heaped._heaps.get(h)
        assert (heaps is not None) is (turn >= 1)  # heaps from the third owner on
        live = len(heaped.grants[h])
        assert heaps is None or (len(heaps.strong) <= 2 * live + 17 and len(heaps.reuse) <= 2 * live + 17), turn
    # Past the pin, the retained grants order the block as the scan says.
    for t in (now, now + 1.5, now + 3, now + 4.5, now + 6):
        assert heaped.view(h, t) == scanned.view(h, t), t


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
