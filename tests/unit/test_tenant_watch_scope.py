"""A tenant's WatchEvents streams over loopback gRPC with the fake engine: what they are sent
(tenant_guard.WatchScope, by the tenant tag each event got when published), what the server
keeps for them (nothing per stream; the core's memory of blocks shown to tenants goes with
the blocks), and how many a tenant may open (KVHINT_MAX_WATCH_STREAMS_PER_TENANT)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from google.protobuf import duration_pb2

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_server import core as core_module
from kvhint_server import index as index_module
from kvhint_server.config import ServerConfig
from kvhint_server.model import Tier

from kvhint_unit_support import Harness, error_info, gate_engine_steps, h, local_engine_info, pin

TENANTS = {
    "tenants": [
        {"name": "team-a", "session_prefix": "a/", "tokens": ["tok-a"]},
        {"name": "team-b", "session_prefix": "b/", "tokens": ["tok-b"]},
        {"name": "ops", "role": "admin", "tokens": ["tok-admin"]},
    ]
}
A, B = (("authorization", "Bearer tok-a"),), (("authorization", "Bearer tok-b"),)
ADMIN = (("authorization", "Bearer tok-admin"),)


@pytest.fixture
def hx(tmp_path: Path) -> Iterator[Harness]:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(TENANTS))
    harness = Harness(local_engine_info(num_device_blocks=4096), tenants_file=str(path), event_replay_window=100000)
    try:
        yield harness
    finally:
        harness.close()


class Stream:
    """One WatchEvents call read on a thread."""

    def __init__(self, hx: Harness, who, **req) -> None:
        self.got: list[pb.WatchEventsResponse] = []
        self.call = hx.stub.WatchEvents(pb.WatchEventsRequest(**req), metadata=who, timeout=30)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for msg in self.call:
                self.got.append(msg)
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(5)


def settle(hx: Harness) -> None:
    """Every subscriber has read up to the latest event."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        subs = list(hx.server.servicer.hub._subs)
        if subs and all(s.cursor == hx.bus.last_sequence for s in subs):
            return
        time.sleep(0.01)
    raise AssertionError("subscribers did not catch up")


def release(hx: Harness, session: str) -> None:
    hint = pb.Hint(selector=pb.Selector(session=pb.SessionSelector(session_id=session)), release=pb.ReleaseAction())
    hx.stub.ApplyHints(pb.ApplyHintsRequest(hints=[hint]), metadata=B, timeout=10)


def clear_device(hx: Harness) -> None:
    """A prefix-cache reset: every device block goes, one AllBlocksCleared."""
    def do() -> None:
        hx.engine.device.clear()
        hx.core.on_cleared(Tier.DEVICE)

    hx.engine.run(do)


def test_after_a_prefix_cache_reset_another_tenants_removal_of_the_same_content_is_not_shown(hx: Harness) -> None:
    """B saw h(1) stored before a reset. After the reset only A's session holds h(1); A's
    removal of it is none of B's business (it would tell B what A had cached)."""
    b = Stream(hx, B)
    hx.wait_subscribers(1)
    hx.engine.store([h(1)], session="b/y")
    clear_device(hx)
    release(hx, "b/y")
    hx.engine.store([h(1)], session="a/x")
    hx.engine.remove([h(1)])
    hx.engine.store([h(7)], session="b/end")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(
        m.HasField("blocks_stored") and m.blocks_stored.coordinates.session_id == "b/end" for m in b.got
    ):
        time.sleep(0.01)
    b.close()
    kinds = [m.WhichOneof("payload") for m in b.got]
    assert "all_blocks_cleared" in kinds
    removed = [bytes(x) for m in b.got if m.HasField("blocks_removed") for x in m.blocks_removed.block_hashes]
    assert removed == []


def shown(hx: Harness) -> dict[bytes, frozenset[str]]:
    """The core's memory of blocks shown to tenants that none of their sessions holds (engine thread)."""
    return hx.engine.run(lambda: dict(hx.core._shown_tenants))


def removed(stream: Stream) -> list[bytes]:
    return [bytes(x) for m in list(stream.got) if m.HasField("blocks_removed") for x in m.blocks_removed.block_hashes]


def wait_for(cond, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    """Sent by the server; the client thread reads it a little later."""
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_tenant_stream_sees_its_released_blocks_go_and_nothing_is_kept_after(hx: Harness) -> None:
    """B's follower keeps a released session's blocks resident (MembershipChanged: they stay
    cached), so their later eviction, which names no session, still reaches B's stream. The
    memory behind it, and behind every other filter kind, is gone once the blocks are."""
    streams = []
    for i, flt in enumerate([pb.EventFilter(),
                             pb.EventFilter(kinds=[pb.EVENT_KIND_BLOCKS_STORED]),
                             pb.EventFilter(session_ids=["b/s"])]):
        streams.append(Stream(hx, B, filter=flt))
        hx.wait_subscribers(i + 1)
    try:
        for r in range(3):
            blocks = [h(1000 + 100 * r + i) for i in range(40)]
            hx.engine.store(blocks, session="b/s")
            release(hx, "b/s")
            assert set(shown(hx)) == set(blocks)
            hx.engine.remove(blocks[:20])  # evicted after the Release: the removal names no session
            wait_for(lambda b=blocks: set(b[:20]) <= set(removed(streams[0])))
            assert set(blocks[:20]) <= set(removed(streams[0]))
            clear_device(hx)  # the rest go with a prefix-cache reset
            settle(hx)
            assert shown(hx) == {}
        assert removed(streams[1]) == [] and removed(streams[2]) == []  # their filters pass none of these
        hx.engine.store([h(5)], session="b/s")
        hx.engine.remove([h(5)])
        wait_for(lambda: h(5) in removed(streams[0]) and h(5) in removed(streams[2]))
        assert h(5) in removed(streams[0]) and h(5) in removed(streams[2])
        assert shown(hx) == {}
    finally:
        for s in streams:
            s.close()


def test_a_snapshot_a_release_then_a_reset_leaves_nothing_remembered(hx: Harness) -> None:
    hx.engine.store([h(i) for i in range(1, 30)], session="b/snap")
    b = Stream(hx, B, start=pb.WatchEventsRequest.START_SNAPSHOT)
    try:
        hx.wait_subscribers(1)
        release(hx, "b/snap")
        assert len(shown(hx)) == 29
        clear_device(hx)
        assert shown(hx) == {}
        wait_for(lambda: any(m.HasField("all_blocks_cleared") for m in list(b.got)))
        assert any(m.HasField("all_blocks_cleared") for m in b.got)
    finally:
        b.close()


def hashes_sel(*hs: bytes) -> pb.Selector:
    return pb.Selector(block_hashes=pb.BlockHashSelector(block_hashes=list(hs)))


def apply(hx: Harness, who, *hints: pb.Hint) -> list[pb.HintResult]:  # type: ignore[no-untyped-def]
    return list(hx.stub.ApplyHints(pb.ApplyHintsRequest(hints=list(hints)), metadata=who, timeout=10).results)


def broken_pins(stream: Stream) -> list[list[bytes]]:
    return [[bytes(x) for x in m.pin_broken.block_hashes] for m in list(stream.got) if m.HasField("pin_broken")]


def test_a_tenant_hears_of_every_pin_of_its_own_that_breaks_and_of_no_other(hx: Harness) -> None:
    """Team-a pins by block hashes and by continuation (grants named by no session), team-b by
    session; one allocation breaks them all (one PinBroken, as the vLLM adapter publishes).
    Each tenant's stream shows its own broken blocks alone; an admin's the whole event."""
    ttl = duration_pb2.Duration(seconds=60)
    hx.engine.store([h(1), h(2)], session="a/s")
    hx.engine.store([h(3)], session="a/s2", continuation="a/cont")
    hx.engine.store([h(4), h(5)], session="b/secret")
    pins = apply(hx, A, pb.Hint(selector=hashes_sel(h(1), h(2)), pin=pb.PinAction(ttl=ttl)),
                 pb.Hint(selector=pb.Selector(continuation=pb.ContinuationSelector(continuation_id="a/cont")),
                         pin=pb.PinAction(ttl=ttl)))
    pins += apply(hx, B, pin("b/secret", 60))
    assert [r.outcome for r in pins] == [pb.OUTCOME_ACCEPTED] * 3
    streams = [Stream(hx, who) for who in (A, B, ADMIN)]
    hx.wait_subscribers(3)
    try:
        hx.engine.run(lambda: hx.core.on_pin_broken([h(1), h(4), h(2), h(3), h(5)], 5))
        wait_for(lambda: all(broken_pins(s) for s in streams))
        assert [broken_pins(s) for s in streams] == [
            [[h(1), h(2), h(3)]], [[h(4), h(5)]], [[h(1), h(4), h(2), h(3), h(5)]],
        ]
        assert b"b/secret" not in b"".join(m.SerializeToString() for m in streams[0].got)
    finally:
        for s in streams:
            s.close()


def test_a_resumed_stream_sees_a_shared_block_go_though_the_removal_names_none_of_its_sessions(
    hx: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follower reconnects with START_RESUME right after the last event it got (the
    documented way to continue without a gap); then a block its session shares with team-a's
    goes, and the removal names team-a's session alone (events name a few members: 16, here
    1, so that two sessions are enough). The resumed stream must report the block gone."""
    monkeypatch.setattr(index_module, "MAX_MEMBERS_REPORTED", 1)
    monkeypatch.setattr(core_module, "MAX_MEMBERS_REPORTED", 1)
    hx.engine.store([h(1)], session="a/x")
    first = Stream(hx, B, heartbeat_interval=duration_pb2.Duration(nanos=100_000_000))
    hx.wait_subscribers(1)
    hx.engine.store([h(1)], session="b/y", prefix_hit=True)
    wait_for(lambda: any(m.HasField("blocks_stored") for m in list(first.got)))
    first.close()
    last = max(m.sequence for m in first.got if m.HasField("blocks_stored"))
    assert last == hx.bus.last_sequence
    resumed = Stream(hx, B, start=pb.WatchEventsRequest.START_RESUME, resume_epoch=hx.bus.epoch, resume_after_sequence=last)
    try:
        hx.wait_subscribers(1)
        hx.engine.remove([h(1)])
        assert "b/y" not in hx.bus.read_after(last, 1)[0].sessions
        wait_for(lambda: removed(resumed))
        assert removed(resumed) == [h(1)]
        assert b"a/x" not in b"".join(m.SerializeToString() for m in resumed.got)
    finally:
        resumed.close()


def refusal(hx: Harness, who) -> grpc.RpcError | None:  # type: ignore[no-untyped-def]
    """Open a stream; the error it fails with at once (None: it stays open, and is closed)."""
    call = hx.stub.WatchEvents(pb.WatchEventsRequest(heartbeat_interval=duration_pb2.Duration(nanos=100_000_000)),
                               metadata=who, timeout=10)
    try:
        next(iter(call))  # a heartbeat: the stream is open
        return None
    except grpc.RpcError as err:
        return err
    finally:
        call.cancel()


def test_watch_streams_are_bounded_per_tenant_and_in_all(hx: Harness) -> None:
    """A tenant that opens streams up to its bound is refused the next with RESOURCE_EXHAUSTED
    naming the limit, while another tenant still opens one; past the server's bound everyone
    is refused; a closed stream gives its slot back."""
    assert (ServerConfig().max_watch_streams, ServerConfig().max_watch_streams_per_tenant) == (1024, 64)
    hub = hx.server.servicer.hub
    assert (hub.max_streams, hub.max_streams_per_tenant) == (1024, 64)  # the config's
    hub.max_streams_per_tenant, hub.max_streams = 2, 3
    a_streams = [Stream(hx, A), Stream(hx, A)]
    hx.wait_subscribers(2)
    try:
        err = refusal(hx, A)
        assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        info = error_info(err)
        assert info.reason == "REASON_RESOURCE_EXHAUSTED"
        assert dict(info.metadata) == {"cause": "tenant_watch_streams", "limit": "2"}
        b_stream = Stream(hx, B)
        hx.wait_subscribers(3)
        err = refusal(hx, ADMIN)
        assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(error_info(err).metadata) == {"cause": "watch_streams", "limit": "3"}
        b_stream.close()
        wait_for(lambda: hub._open == 2)
        assert refusal(hx, ADMIN) is None
        a_streams.pop().close()
        wait_for(lambda: hub._open == 1)
        assert refusal(hx, A) is None
    finally:
        for s in a_streams:
            s.close()


def test_shutdown_during_a_snapshot_ends_the_stream_with_a_shutting_down_resync(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server stops while a snapshot's next engine task is queued (the engine is in a
    long forward pass): the client gets Resync(SHUTTING_DOWN), not an UNKNOWN error."""
    monkeypatch.setattr(core_module, "SLICE_BUDGET_S", 0.0)  # one snapshot slice per engine step
    for stall_before_begin in (True, False):
        hs = Harness()
        running = gate_engine_steps(hs)
        try:
            for i in range(20):
                hs.engine.store([h(100 + i)], session=f"s{i}")
            hs.server.servicer.hub.snapshot_max_items = 1
            if stall_before_begin:
                running.clear()
                time.sleep(0.05)
            else:
                # Held by the engine thread itself once the snapshot's first slice has run, so
                # the next slice is queued behind the hold: held from this thread after reading
                # two messages, a loaded machine could let the whole snapshot finish first.
                submit_slice = hs.core.submit_slice

                def first_slice_then_hold(fn, **kw):  # type: ignore[no-untyped-def]
                    def step(deadline: float):  # type: ignore[no-untyped-def]
                        try:
                            return fn(deadline)
                        finally:
                            running.clear()

                    return submit_slice(step, **kw)

                hs.core.submit_slice = first_slice_then_hold  # type: ignore[method-assign]
            it = iter(hs.stub.WatchEvents(pb.WatchEventsRequest(start=pb.WatchEventsRequest.START_SNAPSHOT), timeout=10))
            got = []
            if not stall_before_begin:
                got.append(next(it))  # SnapshotBegin
                got.append(next(it))  # the first slice's chunk
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and hs.core.pending_tasks() == 0:
                time.sleep(0.01)
            assert hs.core.pending_tasks() == 1
            hs.server.stop(grace=1.0)
            got.extend(it)  # no grpc.RpcError
            last = got[-1]
            assert last.HasField("resync"), [m.WhichOneof("payload") for m in got]
            assert last.resync.cause == pb.Resync.CAUSE_SHUTTING_DOWN
        finally:
            running.set()
            hs.channel.close()
            hs.server.stop(grace=0.2)
            hs.engine.stop()
