"""Events and queries agree: a follower fed from the event stream matches
QueryResidency and ListSessions, session by session and tier by tier.

Randomized over the engine-neutral core with the FakeEngine (one thread: the
test is the engine thread): prompts of several sessions over a small tree of
shared prefixes (stores and prefix hits), anonymous prompts, host offloads,
evictions on both tiers, a device cache reset, a tiny index cap (so the core
forgets sessions), and random hints (Release whole or narrowed, Evict,
Retain, Pin, by session or by hashes). The follower (kvhint_client's
EngineTracker, the code routers run) subscribes with a snapshot at a random
point; the snapshot is taken in pieces of 1-3 items, with traffic between
them, and the stream is built the way watch.py builds it: SnapshotBegin,
then before each piece the events up to its sequence, then its chunks, then
SnapshotEnd and the rest of the events. At the end (a quiescent point) the
follower must agree with the server.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from google.protobuf import duration_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvhint_unit_support import FakeClock, FakeEngine, tiered_engine_info

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_client.follower import EngineTracker, ResidencyIndex
from kvhint_server import KvHintCore, ServerConfig, wire
from kvhint_server.model import RemovalCause, Selector, SelectorKind, Tier
from kvhint_server.snapshot import SnapshotCursor
from kvhint_server.validation import parse_apply_request

DEPTH, FANOUT = 4, 2
PATHS = [p for d in range(1, DEPTH + 1) for p in itertools.product(range(FANOUT), repeat=d)]
HASH = {p: bytes([len(p), *p]) * 4 + bytes(32 - 4 * (len(p) + 1)) for p in PATHS}
LEAVES = [p for p in PATHS if len(p) == DEPTH]
SESSIONS = ["s0", "s1", "s2", "s3"]
TIERS = (Tier.DEVICE, Tier.HOST)
ENGINE = "e"


class SyncEngine(FakeEngine):
    """FakeEngine whose engine thread is the test's own thread."""

    def __init__(self, core: KvHintCore) -> None:
        super().__init__(core, tiered_engine_info(num_device_blocks=64))
        self.thread = threading.current_thread()  # type: ignore[assignment]

    def request_wakeup(self) -> None:
        pass

    def run(self, fn: Any, timeout: float = 10.0) -> Any:
        future = self.core.submit(fn)
        self.core.run_pending()
        return future.result(0)


class World:
    def __init__(self, max_index_blocks: int, **config: Any) -> None:
        self.config = ServerConfig(max_index_blocks=max_index_blocks, **config)
        self.core = KvHintCore(self.config, monotonic=FakeClock())
        self.engine = SyncEngine(self.core)
        self.core.attach(self.engine)
        self.queries = self.core.queries
        self.executor = self.core.executor
        self.follower = ResidencyIndex()
        self.tracker = EngineTracker(ENGINE, "addr", self.follower)
        self.fed: int | None = None  # last sequence handed to the follower (None: not subscribed)
        self.cursor: SnapshotCursor | None = None

    # ---- traffic (adapter-like)
    def request(self, session: str | None, leaf: tuple[int, ...], depth: int) -> None:
        path = [HASH[leaf[:i]] for i in range(1, depth + 1)]
        device = self.engine.device
        j = 0
        while j < len(path) and path[j] in device:
            j += 1
        parent = path[j - 1] if j else None
        if session is not None and j and not self._member(path[j - 1], session):
            self.engine.store(path[:j], session=session, prefix_hit=True)  # the adapter records the hit
        if j < len(path):
            self.engine.store(path[j:], session=session, first_position=j, parent=parent)

    def _member(self, h: bytes, session: str) -> bool:
        node = self.core.index.node(h)
        return node is not None and session in node.sessions

    def offload(self, p: tuple[int, ...]) -> None:
        """A tier's copy of the device-resident blocks of the chain ending at `p` not on the host
        yet, one run of consecutive blocks per store (as the tier feed reports them)."""
        run: list[bytes] = []
        for i in range(1, len(p) + 1):
            h = HASH[p[:i]]
            if h in self.engine.device and h not in self.engine.host:
                if not run:
                    first, parent = i - 1, HASH[p[:i - 1]] if i > 1 else None
                run.append(h)
            elif run:
                self.engine.store(run, tier=Tier.HOST, first_position=first, parent=parent)
                run = []
        if run:
            self.engine.store(run, tier=Tier.HOST, first_position=first, parent=parent)

    def evict(self, p: tuple[int, ...], tier: Tier) -> None:
        held = self.engine.device if tier is Tier.DEVICE else self.engine.host
        if HASH[p] in held:
            self.engine.remove([HASH[p]], tier=tier, cause=RemovalCause.EVICTED)

    def reset_device(self) -> None:
        def clear() -> None:
            self.engine.device.clear()
            self.core.on_cleared(Tier.DEVICE)

        self.engine.run(clear)

    def hint(self, hint: pb.Hint) -> None:
        parsed = parse_apply_request(pb.ApplyHintsRequest(hints=[hint]), self.config, self.core.info)
        self.engine.run(lambda: self.executor.apply_batch(parsed))

    # ---- the follower's stream
    def _deliver_events(self, upto: int) -> None:
        assert self.fed is not None
        events = self.core.bus.read_after(self.fed, upto - self.fed)
        assert events is not None
        for ev in events:
            self.tracker.handle(pb.WatchEventsResponse.FromString(wire.event_bytes(ev, self.core.bus.epoch)))
            self.fed = ev.sequence

    def _control(self, sequence: int, **payload: Any) -> None:
        self.tracker.handle(pb.WatchEventsResponse(epoch=self.core.bus.epoch, sequence=sequence, **payload))

    def subscribe(self, max_items: int) -> None:
        self.tracker.subscription()
        self.cursor = self._cursor(max_items)
        start = self.engine.run(self.cursor.begin)
        self.fed = start.sequence
        self._control(start.sequence, snapshot_begin=pb.SnapshotBegin(num_sessions=start.num_sessions, num_blocks=start.num_blocks))
        if self.cursor.done:
            self._end_snapshot()

    def _cursor(self, max_items: int) -> SnapshotCursor:
        return SnapshotCursor(self.queries, max_items)

    def snapshot_step(self) -> None:
        cursor = self.cursor
        if cursor is None:
            return
        piece = self.engine.run(lambda: cursor.step(float("inf")))
        self._deliver_events(piece.sequence)
        block_size = self.core.info.block_size
        for session_id, views in piece.chunks:
            chunk = pb.SnapshotChunk(session_id=session_id, blocks=[wire.block_info(v, block_size) for v in views])
            self._control(piece.sequence, snapshot_chunk=chunk)
        if piece.done:
            self._end_snapshot()

    def _end_snapshot(self) -> None:
        assert self.fed is not None
        self._control(self.fed, snapshot_end=pb.SnapshotEnd())
        self.cursor = None

    def settle(self) -> None:
        while self.cursor is not None:
            self.snapshot_step()
        self._deliver_events(self.core.bus.last_sequence)

    # ---- a run
    def apply(self, kind: str, arg: Any) -> None:
        """One operation of `operations()`."""
        if kind == "request":
            self.request(*arg)
        elif kind == "offload":
            self.offload(arg)
        elif kind == "evict":
            self.evict(arg, Tier.DEVICE)
        elif kind == "evict_host":
            self.evict(arg, Tier.HOST)
        elif kind == "reset":
            self.reset_device()
        else:
            self.hint(arg)

    def run(self, ops: list[tuple[str, Any]], subscribe_at: int, piece_items: int) -> None:
        """The operations, with a snapshot step after each; the follower subscribes before
        operation `subscribe_at` (or after the last); then everything is delivered."""
        for i, (kind, arg) in enumerate(ops):
            if i == subscribe_at:
                self.subscribe(piece_items)
            self.apply(kind, arg)
            self.snapshot_step()
        if self.fed is None:
            self.subscribe(piece_items)
        self.settle()

    # ---- the check
    def assert_agrees(self) -> None:
        page = self.engine.run(lambda: self.queries.sessions("", None, 10_000))
        listed = {v.session_id: v.counts for v in page.sessions}
        assert self.follower.is_live(ENGINE)
        assert self.follower.sessions(ENGINE) == set(listed), "ListSessions vs follower sessions"
        for s, counts in listed.items():
            selector = Selector(SelectorKind.SESSION, session_id=s)
            views = self.engine.run(lambda sel=selector: self.queries.residency(sel)).blocks
            for t in TIERS:
                server = {v.block_hash for v in views if v.tiers & t.bit}
                assert self.follower.session_blocks(s, ENGINE, tier=int(t)) == server, f"QueryResidency({s}) on {t.name}"
                assert counts.get(t, 0) == len(server), f"ListSessions count of {s} on {t.name}"
        assert self.follower.tier_blocks(ENGINE, int(Tier.DEVICE)) == set(self.engine.device)
        assert self.follower.tier_blocks(ENGINE, int(Tier.HOST)) == self.engine.host
        ranked = {r.engine for s in listed for r in self.follower.engines_for_session(s)}
        assert ranked <= {ENGINE}
        for s in SESSIONS:
            if s not in listed:
                assert self.follower.engines_for_session(s) == [], f"{s} is gone from the server but routed to"


def _session_hint(draw: Any) -> pb.Hint:
    session = draw(st.sampled_from(SESSIONS))
    sel = pb.Selector(session=pb.SessionSelector(session_id=session))
    kind = draw(st.sampled_from(["release", "release_narrowed", "evict", "retain", "pin", "evict_hashes", "release_hashes"]))
    if kind == "release":
        return pb.Hint(selector=sel, release=pb.ReleaseAction())
    if kind == "release_narrowed":
        return pb.Hint(selector=sel, release=pb.ReleaseAction(), max_blocks=1)
    if kind == "evict":
        return pb.Hint(selector=sel, evict=pb.EvictAction())
    ttl = duration_pb2.Duration(seconds=30)
    if kind == "retain":
        return pb.Hint(selector=sel, retain=pb.RetainAction(ttl=ttl, priority=1))
    if kind == "pin":
        return pb.Hint(selector=sel, pin=pb.PinAction(ttl=ttl))
    hashes = draw(st.lists(st.sampled_from(PATHS), min_size=1, max_size=3))
    by_hash = pb.Selector(block_hashes=pb.BlockHashSelector(block_hashes=[HASH[p] for p in hashes]))
    if kind == "evict_hashes":
        return pb.Hint(selector=by_hash, evict=pb.EvictAction())
    return pb.Hint(selector=by_hash, release=pb.ReleaseAction())


@st.composite
def operations(draw: Any) -> list[tuple[str, Any]]:
    ops = []
    for _ in range(draw(st.integers(1, 30))):
        kind = draw(st.sampled_from(["request", "request", "request", "anonymous", "offload", "evict", "evict_host", "hint", "hint", "reset"]))
        if kind in ("request", "anonymous"):
            session = draw(st.sampled_from(SESSIONS)) if kind == "request" else None
            ops.append(("request", (session, draw(st.sampled_from(LEAVES)), draw(st.integers(1, DEPTH)))))
        elif kind == "hint":
            ops.append(("hint", _session_hint(draw)))
        elif kind == "reset":
            ops.append(("reset", None))
        else:
            ops.append((kind, draw(st.sampled_from(PATHS))))
    return ops


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    ops=operations(),
    subscribe_at=st.integers(0, 30),
    piece_items=st.integers(1, 3),
    max_index_blocks=st.sampled_from([6, 12, 1_000]),
)
def test_follower_agrees_with_queries_after_any_traffic_and_hints(ops, subscribe_at, piece_items, max_index_blocks):
    world = World(max_index_blocks)
    world.run(ops, subscribe_at, piece_items)
    world.assert_agrees()


def test_release_is_visible_to_the_follower():
    """The rel-a reproduction: after Release the server reports no blocks and
    drops the session; so must the follower, while the blocks stay cached."""
    world = World(1_000)
    world.subscribe(3)
    world.settle()
    world.request("rel-a", LEAVES[0], 3)
    world.settle()
    assert [r.blocks for r in world.follower.engines_for_session("rel-a")] == [3]
    world.hint(pb.Hint(selector=pb.Selector(session=pb.SessionSelector(session_id="rel-a")), release=pb.ReleaseAction()))
    world.settle()
    world.assert_agrees()
    assert world.follower.engines_for_session("rel-a") == []
    assert len(world.follower.tier_blocks(ENGINE, "device")) == 3, "the released blocks stay cached"
    # The same prompt again: a prefix hit re-joins the blocks.
    world.request("rel-a", LEAVES[0], 3)
    world.settle()
    world.assert_agrees()
    assert [r.blocks for r in world.follower.engines_for_session("rel-a")] == [3]
