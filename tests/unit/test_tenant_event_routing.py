"""Tenants' event streams, routed by the tag each event gets once when published
(tenant_guard.TenantRouter, events.Event.tenants): over the engine-neutral core with the
test as the engine thread (test_follower_consistency's World), as a tenant's subscription
sees them (tenant_guard.WatchScope).

  * A tenant's follower (kvhint_client's EngineTracker) that reconnects with START_RESUME
    at any point never keeps a block that is gone, and holds every copy of a block its
    sessions are members of, though events name at most a few members (patched down to 1
    here so that four sessions exceed it), and though a lower-tier copy may have been made
    before any of the tenant's sessions joined its block.
  * A PinBroken shows each tenant exactly the blocks whose broken grants were its own,
    whatever owner held them (session, continuation, block hashes); unscoped streams
    see it whole.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_server import core as core_module
from kvhint_server import index as index_module
from kvhint_server import wire
from kvhint_server.events import Event, PinBroken
from kvhint_server.model import Selector, SelectorKind, Tier
from kvhint_server.snapshot import SnapshotCursor
from kvhint_server.tenant_guard import WatchScope

from test_follower_consistency import DEPTH, ENGINE, HASH, LEAVES, PATHS, World

TENANTS = {
    "tenants": [
        {"name": "team-a", "session_prefix": "a/", "tokens": ["tok-a"]},
        {"name": "team-b", "session_prefix": "b/", "tokens": ["tok-b"]},
        {"name": "ops", "role": "admin", "tokens": ["tok-admin"]},
    ]
}
SESSIONS = ["a/0", "a/1", "b/0", "b/1"]


def tenants_file() -> str:
    path = Path(tempfile.mkdtemp()) / "tenants.json"
    path.write_text(json.dumps(TENANTS))
    return str(path)


class TenantWorld(World):
    """World whose follower is tenant `name`'s: its snapshot, the events tagged for it with
    foreign ids cut, as WatchHub.stream sends them."""

    def __init__(self, max_index_blocks: int, name: str) -> None:
        super().__init__(max_index_blocks, tenants_file=tenants_file())
        self.tenants = self.config.tenants
        self.tenant = self.tenants.by_name[name]
        self.scope = WatchScope(self.tenant, self.tenants)

    def reconnect(self) -> None:
        """The stream broke; the follower resumes after the last event it got (START_RESUME):
        a new stream, with a new scope."""
        if self.fed is not None and self.cursor is None:
            self.scope = WatchScope(self.tenant, self.tenants)

    def _cursor(self, max_items: int) -> SnapshotCursor:
        return SnapshotCursor(self.queries, max_items, self.scope.owned, self.tenant.owns)

    def _control(self, sequence: int, **payload: Any) -> None:
        chunk = payload.get("snapshot_chunk")
        if chunk is not None:
            self.scope.cut_blocks(chunk.blocks)
        super()._control(sequence, **payload)

    def _deliver_events(self, upto: int) -> None:
        assert self.fed is not None
        events = self.core.bus.read_after(self.fed, upto - self.fed)
        assert events is not None
        for ev in self.scope.visible(events):
            self.tracker.handle(pb.WatchEventsResponse.FromString(self.scope.event_bytes(ev, self.core.bus.epoch)))
        self.fed = upto

    def apply(self, kind: str, arg: Any) -> None:
        if kind == "release":
            self.hint(pb.Hint(selector=pb.Selector(session=pb.SessionSelector(session_id=arg)), release=pb.ReleaseAction()))
        elif kind == "reconnect":
            self.reconnect()
        else:
            super().apply(kind, arg)

    def assert_follower_holds_nothing_gone(self) -> None:
        assert self.follower.tier_blocks(ENGINE, int(Tier.DEVICE)) <= set(self.engine.device)
        assert self.follower.tier_blocks(ENGINE, int(Tier.HOST)) <= self.engine.host
        assert all(self.tenant.owns(s) for s in self.follower.sessions(ENGINE, include_stale=True))

    def _own(self, h: bytes) -> bool:
        """One of the tenant's sessions is a member of `h`."""
        node = self.core.index.node(h)
        return node is not None and any(map(self.tenant.owns, node.sessions))

    def assert_follower_agrees_on_its_sessions(self) -> None:
        """The tenant's sessions and each one's blocks per tier, as QueryResidency answers."""
        page = self.engine.run(lambda: self.queries.sessions("", None, 10_000))
        own = {v.session_id for v in page.sessions if self.tenant.owns(v.session_id)}
        assert self.follower.sessions(ENGINE) == own, "the tenant's sessions"
        for s in own:
            selector = Selector(SelectorKind.SESSION, session_id=s)
            views = self.engine.run(lambda sel=selector: self.queries.residency(sel)).blocks
            for t in (Tier.DEVICE, Tier.HOST):
                server = {v.block_hash for v in views if v.tiers & t.bit}
                assert self.follower.session_blocks(s, ENGINE, tier=int(t)) == server, f"QueryResidency({s}) on {t.name}"

    def assert_follower_holds_its_sessions_blocks(self) -> None:
        """Every copy, on either tier, of a block one of the tenant's sessions is a member of."""
        for tier, held in ((Tier.DEVICE, set(self.engine.device)), (Tier.HOST, self.engine.host)):
            own = {h for h in held if self._own(h)}
            missing = own - self.follower.tier_blocks(ENGINE, int(tier))
            assert not missing, f"{self.tenant.name}'s follower misses {len(missing)} of its sessions' blocks on {tier.name}"


@st.composite
def tenant_traffic(draw: Any) -> list[tuple[str, Any]]:
    ops: list[tuple[str, Any]] = []
    for _ in range(draw(st.integers(1, 30))):
        kind = draw(st.sampled_from(["request", "request", "request", "anonymous", "offload", "offload", "evict", "evict",
                                     "evict_host", "release", "reset", "reconnect", "reconnect"]))
        if kind in ("request", "anonymous"):
            session = draw(st.sampled_from(SESSIONS)) if kind == "request" else None
            ops.append(("request", (session, draw(st.sampled_from(LEAVES)), draw(st.integers(1, DEPTH)))))
        elif kind == "release":
            ops.append(("release", draw(st.sampled_from(SESSIONS))))
        elif kind in ("reset", "reconnect"):
            ops.append((kind, None))
        else:
            ops.append((kind, draw(st.sampled_from(PATHS))))
    return ops


_EXAMPLE_LEAF = LEAVES[0]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    ops=tenant_traffic(),
    subscribe_at=st.integers(0, 30),
    piece_items=st.integers(1, 3),
    max_index_blocks=st.sampled_from([6, 1_000]),
    name=st.sampled_from(["team-a", "team-b"]),
)
# b/0 joins a block a/0 admitted; the stream resumes; the removal names a/0 alone.
@example(ops=[("request", ("a/0", _EXAMPLE_LEAF, 1)), ("request", ("b/0", _EXAMPLE_LEAF, 1)), ("reconnect", None),
              ("evict", _EXAMPLE_LEAF[:1])], subscribe_at=0, piece_items=1, max_index_blocks=1_000, name="team-b")
# b/0 is released (its blocks stay cached), the stream resumes, then the blocks go.
@example(ops=[("request", ("b/0", _EXAMPLE_LEAF, 1)), ("release", "b/0"), ("reconnect", None),
              ("evict", _EXAMPLE_LEAF[:1])], subscribe_at=0, piece_items=1, max_index_blocks=1_000, name="team-b")
# An anonymous store names the members of its last block, b/0 among them: the follower holds its
# first block too, which b/0 left with its last copy (the removal names its admitting a/0 alone).
@example(ops=[("request", ("a/0", _EXAMPLE_LEAF, 2)), ("request", ("b/0", _EXAMPLE_LEAF, 2)), ("evict", _EXAMPLE_LEAF[:1]),
              ("request", (None, _EXAMPLE_LEAF, 2)), ("reconnect", None), ("evict", _EXAMPLE_LEAF[:1])],
         subscribe_at=0, piece_items=1, max_index_blocks=1_000, name="team-b")
# a/0 and b/0 share a block; its host copy (an offload, no request) names one member: both
# tenants' followers must hold it.
@example(ops=[("request", ("a/0", _EXAMPLE_LEAF, 1)), ("request", ("b/0", _EXAMPLE_LEAF, 1)), ("offload", _EXAMPLE_LEAF[:1])],
         subscribe_at=0, piece_items=1, max_index_blocks=1_000, name="team-b")
# b/0's block stays in the index through its host copy while the device is reset; a/0 stores it
# on the device again, and the event names a/0 alone: team-b's follower must hold the new copy.
@example(ops=[("request", ("b/0", _EXAMPLE_LEAF, 1)), ("offload", _EXAMPLE_LEAF[:1]), ("reset", None),
              ("request", ("a/0", _EXAMPLE_LEAF, 1))], subscribe_at=0, piece_items=1, max_index_blocks=1_000, name="team-b")
def test_a_resumed_tenant_follower_holds_what_its_sessions_hold_and_nothing_gone(ops, subscribe_at, piece_items, max_index_blocks, name):
    with mock.patch.object(index_module, "MAX_MEMBERS_REPORTED", 1), mock.patch.object(core_module, "MAX_MEMBERS_REPORTED", 1):
        world = TenantWorld(max_index_blocks, name)
        world.run(ops, subscribe_at, piece_items)
        world.assert_follower_holds_nothing_gone()
        world.assert_follower_holds_its_sessions_blocks()
        world.assert_follower_agrees_on_its_sessions()
        # Nothing is kept for blocks that are gone: after a reset and the host's evictions too.
        world.reset_device()
        for p in PATHS:
            world.evict(p, Tier.HOST)
        assert world.core._shown_tenants == {}


@pytest.mark.parametrize("before", [[], [("reset", None)]], ids=["by a prefix hit", "by a store after a device reset"])
@pytest.mark.parametrize("offloaded_by", [None, "b/0"], ids=["anonymous", "another tenant's session"])
def test_a_tenant_that_joins_a_block_after_its_offload_is_told_of_the_host_copy(before: list, offloaded_by: str | None) -> None:
    """The host copy was made while none of team-a's sessions was a member of the block, so its
    BlocksStored did not reach team-a; when a/0 joins the block, team-a's follower is told of it,
    and no other tenant is."""
    with mock.patch.object(index_module, "MAX_MEMBERS_REPORTED", 1), mock.patch.object(core_module, "MAX_MEMBERS_REPORTED", 1):
        world = TenantWorld(1_000, "team-a")
        ops = [("request", (offloaded_by, _EXAMPLE_LEAF, 2)), ("offload", _EXAMPLE_LEAF[:1]), *before,
               ("request", ("a/0", _EXAMPLE_LEAF, 2))]
        world.run(ops, 0, 1)
        h = HASH[_EXAMPLE_LEAF[:1]]
        assert h in world.engine.host and world._own(h)
        assert h in world.follower.tier_blocks(ENGINE, int(Tier.HOST))
        assert world.follower.session_blocks("a/0", ENGINE, tier=int(Tier.HOST)) == {h}
        # Another tenant's session joining is told too, and only its own tenant is.
        last = world.core.bus.last_sequence
        world.request("b/1", _EXAMPLE_LEAF, 2)
        host_events = [e for e in world.core.bus.read_after(last, 100) if e.tier is Tier.HOST]
        assert [(e.payload.block_hashes, e.payload.prefix_hit, e.tenants) for e in host_events] == [((h,), True, frozenset({"team-b"}))]
        # The host copy's removal reaches team-a's follower.
        world.evict(_EXAMPLE_LEAF[:1], Tier.HOST)
        world.settle()
        assert h not in world.follower.tier_blocks(ENGINE, int(Tier.HOST))


# ---------------------------------------------------------------- PinBroken

BLOCKS = [bytes([i]) * 32 for i in range(1, 7)]
# Owner keys of grants, each with the tenant whose stream must hear of its break ("" = nobody's).
OWNERS = [("s:a/x", "team-a"), ("c:a/cont", "team-a"), ("b:team-a", "team-a"), ("s:b/y", "team-b"),
          ("b:team-b", "team-b"), ("b:", ""), ("s:shared", ""), ("b:ops", "")]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    grants=st.lists(st.tuples(st.sampled_from(OWNERS), st.sets(st.sampled_from(BLOCKS), min_size=1)), min_size=1, max_size=6),
    broken=st.lists(st.sampled_from(BLOCKS), min_size=1, max_size=6, unique=True),
    ended_by_the_engine_thread=st.booleans(),
)
@example(grants=[(OWNERS[2], {BLOCKS[0]}), (OWNERS[4], {BLOCKS[1]})], broken=BLOCKS[:2], ended_by_the_engine_thread=True)
def test_a_pin_broken_shows_each_tenant_its_own_broken_blocks(grants, broken, ended_by_the_engine_thread):
    """Pins held by session, continuation or block hashes, of two tenants and of nobody's, break
    in one allocation (one PinBroken, as the vLLM adapter publishes). Team-a's stream shows the
    broken blocks a grant of team-a's was on, and no other; team-b's likewise; an admin's the
    event as it was published."""
    world = World(1_000, tenants_file=tenants_file())
    core, tenants = world.core, world.config.tenants
    for (owner, _), blocks in grants:
        core.ledger.grant(owner, sorted(blocks), pinned=True, priority=0, deadline=1e12, expires_at=1e12)

    def break_pins() -> None:
        if ended_by_the_engine_thread:  # the adapter: grants end at once, booked later
            core.record(core.on_pin_broken, broken, len(broken), core.drop_grants(broken))
        else:
            core.on_pin_broken(broken, len(broken))

    world.engine.run(break_pins)
    world.core.settle()
    (ev,) = [e for e in core.bus.read_after(0, 1000) if isinstance(e.payload, PinBroken)]
    held = {t: [h for h in broken if any(o[1] == t and h in blocks for o, blocks in grants)] for t in ("team-a", "team-b")}
    for t, mine in held.items():
        assert _seen(ev, WatchScope(tenants.by_name[t], tenants), core.bus.epoch) == (mine or None), t
    whole = pb.WatchEventsResponse.FromString(wire.event_bytes(ev, core.bus.epoch)).pin_broken
    assert list(whole.block_hashes) == broken
    assert set(whole.session_ids) == {o[2:] for (o, _), blocks in grants if o.startswith("s:") and blocks & set(broken)}


def _seen(ev: Event, scope: WatchScope, epoch: str) -> list[bytes] | None:
    """The blocks of the PinBroken a tenant's stream is sent (None: not sent); no foreign ids."""
    if not scope.visible([ev]):
        return None
    msg = pb.WatchEventsResponse.FromString(scope.event_bytes(ev, epoch)).pin_broken
    assert all(scope.tenant.owns(s) for s in msg.session_ids)
    return list(msg.block_hashes)
