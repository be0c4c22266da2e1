"""Grants that outlive the device copy on a lower tier that honours retention
(kvhint.v1 TierInfo.honours_retention, RetainAction): an evicted block's retained grants last
while such a tier holds a copy, so they keep ordering that tier's eviction when the lower copy is
the only one left; pins still end with the device copy; Evict, a broken pin or a device reset
(for pins) end them as before. On the fake engine, through ApplyHints and QueryResidency over
real gRPC; without the tier advertising it, grants end with the device copy as before."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kvhint_server.model import RemovalCause, Tier
from kvhint_unit_support import Harness, h, pin, retain, session_sel, tiered_engine_info

from kvhint.v1 import kvhint_pb2 as pb

R = pb.RetentionState
BLOCKS = [h(i) for i in range(4)]


def honouring_info():
    info = tiered_engine_info()
    tiers = tuple(dataclasses.replace(t, honours_retention=True) if t.tier is Tier.HOST else t for t in info.tiers)
    return dataclasses.replace(info, tiers=tiers)


def stored_on_both(harness, session: str = "s", blocks=BLOCKS) -> None:
    harness.engine.store(blocks, session=session)
    harness.engine.store(blocks, tier=Tier.HOST)


def classes(harness, session: str = "s") -> dict[bytes, int]:
    resp = harness.stub.QueryResidency(pb.QueryResidencyRequest(selector=session_sel(session)), timeout=5)
    return {b.block_hash: b.retention.retention_class for b in resp.blocks}


def affected(result: pb.HintResult) -> dict[int, int]:
    return {c.tier: c.blocks for c in result.affected_blocks}


def release(session: str) -> pb.Hint:
    return pb.Hint(selector=session_sel(session), release=pb.ReleaseAction())


def test_an_evicted_retained_block_keeps_its_grant_while_the_honouring_host_tier_holds_it(make_harness):
    harness = make_harness(info=honouring_info())
    stored_on_both(harness)
    (first,) = harness.apply(retain("s", 60, priority=3)).results
    assert first.outcome == pb.OUTCOME_ACCEPTED and affected(first) == {pb.TIER_DEVICE: 4}
    harness.engine.remove(BLOCKS[2:])  # evicted from the device; the host still holds them
    assert set(classes(harness).values()) == {R.CLASS_RETAINED}
    # A refresh reaches the host-only blocks too, counted on the tier that holds them.
    (again,) = harness.apply(retain("s", 60, priority=3)).results
    assert again.outcome == pb.OUTCOME_ACCEPTED and affected(again) == {pb.TIER_DEVICE: 2, pb.TIER_HOST: 2}
    harness.engine.store(BLOCKS[2:], tier=Tier.DISK)  # keeps the membership; does not honour retention
    harness.engine.remove(BLOCKS[2:], tier=Tier.HOST)  # the last copy the grant protects: it ends
    got = classes(harness)
    assert [got[b] for b in BLOCKS] == [R.CLASS_RETAINED] * 2 + [R.CLASS_ORDINARY] * 2
    (released,) = harness.apply(release("s")).results
    assert affected(released) == {pb.TIER_DEVICE: 2}


def test_a_demoted_blocks_grant_lasts_on_the_host_and_its_release_counts_there(make_harness):
    harness = make_harness(info=honouring_info())
    stored_on_both(harness)
    harness.apply(retain("s", 60))
    harness.engine.remove(BLOCKS, cause=RemovalCause.DEMOTED)
    assert set(classes(harness).values()) == {R.CLASS_RETAINED}
    (released,) = harness.apply(release("s")).results
    assert released.outcome == pb.OUTCOME_ACCEPTED and affected(released) == {pb.TIER_HOST: 4}
    assert harness.engine.run(lambda: dict(harness.core.ledger.grants)) == {}


def test_without_an_honouring_tier_grants_end_with_the_device_copy(make_harness):
    harness = make_harness(info=tiered_engine_info())  # the host tier keeps its own order
    stored_on_both(harness)
    harness.apply(retain("s", 60))
    harness.engine.remove(BLOCKS)
    assert set(classes(harness).values()) == {R.CLASS_ORDINARY}
    (again,) = harness.apply(retain("s", 60)).results
    assert again.outcome == pb.OUTCOME_MISSING  # nothing on a tier the grant would protect


@pytest.mark.parametrize("cause", [RemovalCause.EVICT_HINT, RemovalCause.PIN_BROKEN, RemovalCause.REPLACED])
def test_removals_other_than_eviction_end_the_grant_even_with_a_host_copy(make_harness, cause):
    harness = make_harness(info=honouring_info())
    stored_on_both(harness)
    harness.apply(retain("s", 60))
    harness.engine.remove(BLOCKS, cause=cause)
    assert set(classes(harness).values()) == {R.CLASS_ORDINARY}


def test_pins_end_with_the_device_copy_and_give_back_their_budget(make_harness):
    harness = make_harness(info=honouring_info())
    stored_on_both(harness)
    harness.apply(retain("s", 60, priority=1, hint_id="r"))
    harness.apply(pb.Hint(hint_id="p", selector=session_sel("s"), pin=pin("s", 60).pin))
    assert harness.engine.run(lambda: harness.core.ledger.pinned_blocks) == 4
    harness.engine.remove(BLOCKS)
    assert harness.engine.run(lambda: harness.core.ledger.pinned_blocks) == 0
    # The session's Pin replaced its Retain (one grant per owner and block): nothing is left.
    assert set(classes(harness).values()) == {R.CLASS_ORDINARY}
    (pinned,) = harness.apply(pin("s", 60)).results
    assert pinned.outcome == pb.OUTCOME_MISSING  # a Pin selects device copies only


def test_another_owners_retain_outlives_a_pin_on_the_same_block(make_harness):
    harness = make_harness(info=honouring_info())
    stored_on_both(harness)
    by_hash = pb.Selector(block_hashes=pb.BlockHashSelector(block_hashes=BLOCKS))
    ttl = retain("s", 60).retain.ttl
    harness.apply(pb.Hint(selector=by_hash, retain=pb.RetainAction(priority=5, ttl=ttl)))
    harness.apply(pin("s", 60))
    harness.engine.remove(BLOCKS)
    assert harness.engine.run(lambda: harness.core.ledger.pinned_blocks) == 0
    assert set(classes(harness).values()) == {R.CLASS_RETAINED}


def test_clearing_the_tiers(make_harness):
    harness = make_harness(info=honouring_info())
    stored_on_both(harness)
    harness.engine.store([h(9)], session="t")  # device only
    harness.apply(retain("s", 60), retain("t", 60))
    harness.engine.remove(BLOCKS[:2])
    # A device reset keeps the retained grants of blocks the host holds, and ends the rest.
    harness.engine.run(lambda: harness.core.on_cleared(Tier.DEVICE))
    assert set(classes(harness).values()) == {R.CLASS_RETAINED}
    # A host reset ends the grants that outlived their device copies.
    harness.engine.run(lambda: harness.core.on_cleared(Tier.HOST))
    ledger_blocks = harness.engine.run(lambda: set(harness.core.ledger.grants))
    assert ledger_blocks == set()


# ---------------------------------------------------------------------- the invariant

# Grants and evictions come twice as often as the other steps, and a sequence has three steps or
# more: fewer seldom grant before they evict.
OPS = st.lists(
    st.tuples(
        st.sampled_from([
            "retain", "retain_hashes", "evict", "demote", "evict_hint", "pin", "release", "store_device", "store_host", "drop_host",
            "retain", "retain_hashes", "evict", "demote",
        ]),
        st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True),
    ),
    min_size=3,
    max_size=16,
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=OPS, honours=st.booleans())
# Another owner's Retain under the session's Pin: it outlives the pin where an eviction leaves the
# honouring host a copy, and ends with an Evict, or with an eviction that leaves no host copy.
@example(ops=[("retain_hashes", [0, 1, 2, 3]), ("pin", [0]), ("evict", [0]), ("evict_hint", [1]), ("drop_host", [2]),
              ("demote", [2, 3]), ("retain", [0]), ("drop_host", [0]), ("store_device", [0, 1]), ("retain", [0])], honours=True)
def test_a_grant_protects_a_copy_it_can_order_and_a_pin_a_device_copy(ops, honours):
    """From a session stored on the device and the host, after every step: each block holding a grant has a device copy, or (with an honouring host
    tier) a host copy; each pinned block has a device copy; and a block evicted from the device
    while the honouring host held it kept its retained grants (a pin ends), while any other
    removal from the device ended every grant on it."""
    harness = Harness(info=honouring_info() if honours else tiered_engine_info())
    try:
        _run_ops(harness, ops, honours)
    finally:
        harness.close()
    assert not harness.engine.violations


def _run_ops(harness: Harness, ops, honours: bool) -> None:
    engine, core = harness.engine, harness.core
    stored_on_both(harness)
    for op, idx in ops:
        blocks = [BLOCKS[i] for i in idx]
        if op == "store_device":
            engine.store(blocks, session="s")
        elif op == "store_host":
            engine.store(blocks, tier=Tier.HOST)
        elif op in ("evict", "demote", "evict_hint"):
            cause = {"evict": RemovalCause.EVICTED, "demote": RemovalCause.DEMOTED, "evict_hint": RemovalCause.EVICT_HINT}[op]
            on_device = [b for b in blocks if b in engine.device]
            # Per block: does an unexpired retained (not pinned) grant hold it? (TTLs are 60 s.)
            retained = engine.run(lambda: {
                b: any(not g.pinned for g in core.ledger.grants.get(b, {}).values()) for b in on_device
            })
            engine.remove(on_device, cause=cause)
            after = engine.run(lambda: {b: core.ledger.view(b, core.monotonic()).cls for b in on_device})
            for b in on_device:
                kept = honours and cause is not RemovalCause.EVICT_HINT and b in engine.host
                assert after[b].name == ("RETAINED" if kept and retained[b] else "ORDINARY"), (op, b)
        elif op == "drop_host":
            engine.remove([b for b in blocks if b in engine.host], tier=Tier.HOST)
        elif op == "retain":
            harness.apply(retain("s", 60, priority=2))
        elif op == "retain_hashes":  # another owner's grant on some of the session's blocks
            by_hash = pb.Selector(block_hashes=pb.BlockHashSelector(block_hashes=blocks))
            harness.apply(pb.Hint(selector=by_hash, retain=pb.RetainAction(priority=5, ttl=retain("s", 60).retain.ttl)))
        elif op == "pin":
            harness.apply(pin("s", 60))
        else:
            harness.apply(release("s"))
        granted, pinned_now = engine.run(lambda: (set(core.ledger.grants), {b for b in BLOCKS if core.ledger.is_pinned(b)}))
        for b in granted:
            assert b in engine.device or (honours and b in engine.host), (op, b)
        assert pinned_now <= set(engine.device), op
