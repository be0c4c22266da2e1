"""A tenant's WatchEvents stream remembers only what it sent, and forgets it when the
blocks go, whatever the stream's filter (tenant_guard.WatchScope); over loopback gRPC
with the fake engine."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_server import tenant_guard
from kvhint_server.model import Tier

from kvhint_unit_support import Harness, gate_engine_steps, h, local_engine_info

TENANTS = {
    "tenants": [
        {"name": "team-a", "session_prefix": "a/", "tokens": ["tok-a"]},
        {"name": "team-b", "session_prefix": "b/", "tokens": ["tok-b"]},
        {"name": "ops", "role": "admin", "tokens": ["tok-admin"]},
    ]
}
A, B = (("authorization", "Bearer tok-a"),), (("authorization", "Bearer tok-b"),)


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


def recorded_scopes(monkeypatch) -> list[tenant_guard.WatchScope]:  # type: ignore[no-untyped-def]
    """Every WatchScope built from now on (one per tenant stream), to read its memory."""
    scopes: list[tenant_guard.WatchScope] = []
    init = tenant_guard.WatchScope.__init__

    def record(self, *a, **k) -> None:  # type: ignore[no-untyped-def]
        init(self, *a, **k)
        scopes.append(self)

    monkeypatch.setattr(tenant_guard.WatchScope, "__init__", record)
    return scopes


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


def test_a_tenant_stream_forgets_blocks_that_are_gone_whatever_its_filter(hx: Harness, monkeypatch) -> None:
    """Memory per tenant stream stays bounded by the blocks still resident: after every
    block is gone (evicted after a Release, or a prefix-cache reset), a stream of
    every filter kind holds nothing for them."""
    scopes = recorded_scopes(monkeypatch)
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
            hx.engine.remove(blocks[:20])  # evicted after the Release: the removal names no session
            clear_device(hx)  # the rest go with a prefix-cache reset
            settle(hx)
        assert len(scopes) == 3
        assert [len(s._delivered) for s in scopes] == [0, 0, 0]
        # What a stream was sent it still follows: B's stored block's removal reaches it.
        hx.engine.store([h(5)], session="b/s")
        settle(hx)
        assert [len(s._delivered) for s in scopes] == [1, 1, 1]
        hx.engine.remove([h(5)])
        settle(hx)
        assert [len(s._delivered) for s in scopes] == [0, 0, 0]
        deadline = time.monotonic() + 10  # sent by the server; the client thread reads it a little later
        while True:
            removed = [bytes(x) for m in list(streams[0].got) if m.HasField("blocks_removed") for x in m.blocks_removed.block_hashes]
            if h(5) in removed or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert h(5) in removed
    finally:
        for s in streams:
            s.close()


def test_a_snapshot_then_a_reset_leaves_nothing_remembered(hx: Harness, monkeypatch) -> None:
    scopes = recorded_scopes(monkeypatch)
    hx.engine.store([h(i) for i in range(1, 30)], session="b/snap")
    b = Stream(hx, B, start=pb.WatchEventsRequest.START_SNAPSHOT)
    try:
        hx.wait_subscribers(1)
        assert len(scopes[0]._delivered) == 29
        clear_device(hx)
        settle(hx)
        assert len(scopes[0]._delivered) == 0
    finally:
        b.close()


def test_shutdown_during_a_snapshot_ends_the_stream_with_a_shutting_down_resync() -> None:
    """The server stops while a snapshot's next engine task is queued (the engine is in a
    long forward pass): the client gets Resync(SHUTTING_DOWN), not an UNKNOWN error."""
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
            it = iter(hs.stub.WatchEvents(pb.WatchEventsRequest(start=pb.WatchEventsRequest.START_SNAPSHOT), timeout=10))
            got = []
            if not stall_before_begin:
                got.append(next(it))
                got.append(next(it))
                running.clear()
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
