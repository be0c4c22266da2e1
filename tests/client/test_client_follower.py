"""EventFollower / ResidencyIndex: snapshot, events, resume, resync and epoch changes.

The first tests drive the per-engine state machine with scripted messages (no network); the
last ones run the thread and asyncio followers against fake servers."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from fake_kvhint_server import (
    HANG,
    FakeKvHint,
    ev,
    h,
    heartbeat,
    removed,
    resync,
    snapshot,
    start_fake_server,
    stored,
    wait_until,
)

from kvhint.v1 import kvhint_pb2
from kvhint_client.config import RetryPolicy
from kvhint_client.errors import KvHintError
from kvhint_client.follower import AsyncEventFollower, EngineTracker, EventFollower, ResidencyIndex, Verdict

DEVICE, HOST = kvhint_pb2.TIER_DEVICE, kvhint_pb2.TIER_HOST
FAST = RetryPolicy(max_attempts=1_000, initial_backoff=0.02, max_backoff=0.1, jitter=0.0)
START = kvhint_pb2.WatchEventsRequest


def feed(tracker: EngineTracker, messages) -> list[Verdict]:
    return [tracker.handle(m) for m in messages]


def synced_tracker(index: ResidencyIndex, engine: str = "e1") -> EngineTracker:
    tracker = EngineTracker(engine, "addr", index)
    assert tracker.subscription() == ("snapshot", None)
    feed(tracker, snapshot("E1", 10, {"S1": [(1, [DEVICE]), (2, [DEVICE, HOST])], "S2": [(2, [DEVICE])]}))
    return tracker


def test_snapshot_is_installed_at_snapshot_end() -> None:
    index = ResidencyIndex()
    tracker = EngineTracker("e1", "addr", index)
    tracker.subscription()
    messages = snapshot("E1", 10, {"S1": [(1, [DEVICE]), (2, [DEVICE, HOST])], "S2": [(2, [DEVICE])]})
    feed(tracker, messages[:-1])
    assert not index.is_live("e1") and index.engines_for_session("S1") == [], "nothing visible mid-snapshot"
    tracker.handle(messages[-1])
    assert index.is_live("e1") and tracker.position == ("E1", 10)
    assert index.session_blocks("S1", "e1") == {h(1), h(2)}
    assert index.session_blocks("S1", "e1", tier="host") == {h(2)}
    assert index.engines_for_block(h(2), tier=HOST) == {"e1"}
    assert index.sessions() == {"S1", "S2"}


def test_events_update_membership_and_tiers() -> None:
    index = ResidencyIndex()
    tracker = synced_tracker(index)
    feed(tracker, [
        stored("E1", 11, [3, 4], "S3"),
        stored("E1", 12, [1], "S4", prefix_hit=True),        # a hit establishes membership
        removed("E1", 13, [2], tier=DEVICE),                   # host copy of 2 remains
        removed("E1", 14, [3]),                                # last copy: leaves S3
    ])
    assert index.session_blocks("S3", "e1") == {h(4)}
    assert index.session_blocks("S4", "e1") == {h(1)}
    assert index.session_blocks("S1", "e1") == {h(1), h(2)}
    assert index.session_blocks("S1", "e1", tier=DEVICE) == {h(1)}
    assert index.session_blocks("S2", "e1") == {h(2)}, "still a member while the host copy lives"
    feed(tracker, [removed("E1", 15, [2], tier=HOST)])
    assert "S2" not in index.sessions() and index.engines_for_block(h(2)) == set()
    assert tracker.position == ("E1", 15)


def test_all_blocks_cleared_empties_the_tier_only() -> None:
    index = ResidencyIndex()
    tracker = synced_tracker(index)
    tracker.handle(ev("E1", 11, all_blocks_cleared=kvhint_pb2.AllBlocksCleared(tier=DEVICE)))
    assert index.tier_blocks("e1", "device") == frozenset()
    assert index.session_blocks("S1", "e1") == {h(2)} and "S2" in index.sessions()


def test_duplicates_are_skipped_and_heartbeats_advance() -> None:
    index = ResidencyIndex()
    tracker = synced_tracker(index)
    feed(tracker, [stored("E1", 11, [7], "S7"), removed("E1", 11, [7]), heartbeat("E1", 20)])
    assert index.session_blocks("S7", "e1") == {h(7)}, "the replayed sequence 11 was ignored"
    assert tracker.status.duplicates_skipped == 1 and tracker.position == ("E1", 20)
    tracker.handle(stored("E1", 25, [8], "S8"))
    assert tracker.status.sequence_gaps == 1


def test_disconnect_resumes_from_last_processed_position() -> None:
    index = ResidencyIndex()
    tracker = synced_tracker(index)
    tracker.handle(stored("E1", 11, [3], "S3"))
    assert tracker.stream_ended(KvHintError(grpc.StatusCode.UNAVAILABLE, "gone")) is True
    assert not index.is_live("e1")
    assert index.engines_for_session("S3") == [] and index.engines_for_session("S3", include_stale=True)
    assert tracker.subscription() == ("resume", ("E1", 11))
    tracker.handle(heartbeat("E1", 11))
    assert index.is_live("e1")


def test_interrupted_snapshot_is_retaken() -> None:
    index = ResidencyIndex()
    tracker = EngineTracker("e1", "addr", index)
    tracker.subscription()
    feed(tracker, snapshot("E1", 10, {"S1": [(1, [DEVICE])]})[:-1])
    assert tracker.stream_ended(KvHintError(grpc.StatusCode.UNAVAILABLE, "gone")) is False
    assert tracker.subscription() == ("snapshot", None)


def test_resync_discards_state_and_requests_a_snapshot() -> None:
    index = ResidencyIndex()
    tracker = synced_tracker(index)
    assert tracker.handle(resync("E1", 10)) is Verdict.RESNAPSHOT
    assert index.sessions(include_stale=True) == set() and not index.is_live("e1")
    tracker.stream_ended()
    assert tracker.subscription() == ("snapshot", None)


def test_epoch_change_discards_state_and_requests_a_snapshot() -> None:
    index = ResidencyIndex()
    tracker = synced_tracker(index)
    assert tracker.handle(stored("E2", 1, [9], "S9")) is Verdict.RESNAPSHOT
    assert index.session_blocks("S9", "e1") == frozenset() and index.sessions(include_stale=True) == set()
    assert tracker.status.epoch_changes == 1
    tracker.stream_ended()
    assert tracker.subscription() == ("snapshot", None)


def test_engines_for_session_ranks_by_resident_blocks() -> None:
    index = ResidencyIndex()
    for engine, entries in {"a": [(1, [DEVICE])], "b": [(1, [HOST]), (2, [HOST])], "c": [(1, [DEVICE]), (2, [DEVICE])]}.items():
        tracker = EngineTracker(engine, engine, index)
        tracker.subscription()
        feed(tracker, snapshot("E", 1, {"S": entries}))
    ranked = index.engines_for_session("S")
    assert [(r.engine, r.blocks) for r in ranked] == [("c", 2), ("b", 2), ("a", 1)]
    assert ranked[0].by_tier == {DEVICE: 2}
    assert [r.engine for r in index.engines_for_session("S", tier="host")] == ["b"]
    assert index.session_residency("S")["b"] == {HOST: frozenset({h(1), h(2)})}


# -- threads against fake servers --------------------------------------------------------------------


def test_follower_snapshot_resume_resync_and_epoch_change() -> None:
    servicer = FakeKvHint()
    servicer.watch_scripts = [
        # 1: snapshot, one event, then the connection breaks
        [*snapshot("E1", 10, {"S1": [(1, [DEVICE])]}), stored("E1", 11, [2], "S2"), ("abort", grpc.StatusCode.UNAVAILABLE)],
        # 2: resumed; one event, then the history is gone
        [removed("E1", 12, [1]), resync("E1", 12)],
        # 3: fresh snapshot, still E1; then a message from a new epoch (engine restarted)
        [*snapshot("E1", 20, {"S3": [(3, [HOST])]}), stored("E2", 1, [9], "S9")],
        # 4: snapshot of the new epoch; stay connected
        [*snapshot("E2", 5, {"S4": [(4, [DEVICE])]}), HANG],
    ]
    server = start_fake_server(servicer)
    seen: list[str] = []
    follower = EventFollower({"e1": server.address}, heartbeat=0.2, reconnect=FAST,
                             on_event=lambda engine, m: seen.append(f"{engine}:{m.WhichOneof('payload')}"))
    try:
        follower.start()
        assert wait_until(lambda: len(servicer.watch_requests) == 4 and follower.index.is_live("e1"))
        index = follower.index
        assert index.sessions() == {"S4"} and index.session_blocks("S4", "e1") == {h(4)}
        requests = servicer.watch_requests
        assert [r.start for r in requests] == [START.START_SNAPSHOT, START.START_RESUME, START.START_SNAPSHOT,
                                               START.START_SNAPSHOT]
        assert (requests[1].resume_epoch, requests[1].resume_after_sequence) == ("E1", 11)
        assert requests[0].heartbeat_interval.nanos == 200_000_000
        status = follower.status()["e1"]
        assert (status.snapshots, status.resyncs, status.epoch_changes) == (3, 1, 1)
        assert follower.position("e1") == ("E2", 5)
        assert "e1:resync" in seen and "e1:blocks_stored" in seen
    finally:
        follower.stop()
        server.stop()


def test_follower_waits_for_an_engine_that_is_down() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    follower = EventFollower([f"127.0.0.1:{port}"], reconnect=FAST)
    server = None
    try:
        follower.start()
        assert wait_until(lambda: follower.status()[f"127.0.0.1:{port}"].connects >= 2, timeout=5)
        assert not follower.wait_synced(timeout=0.1)
        servicer = FakeKvHint()
        servicer.watch_scripts = [[*snapshot("E1", 3, {"S": [(1, [DEVICE])]}), HANG]]
        server = start_fake_server(servicer, port=port)
        assert follower.wait_synced(timeout=10)
        assert [r.engine for r in follower.index.engines_for_session("S")] == [f"127.0.0.1:{port}"]
    finally:
        follower.stop()
        if server is not None:
            server.stop()


# No wait between reconnects: 1100 failed reconnects take well under a second against a closed port.
NO_WAIT = RetryPolicy(max_attempts=10**6, initial_backoff=0.0, max_backoff=0.0, jitter=0.0)


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_an_engine_down_for_more_than_a_thousand_reconnects_is_followed_when_it_is_back() -> None:
    """With the default policy 1024 failed reconnects are about 8 minutes of an engine being down
    (a redeploy). The backoff of the 1025th once overflowed a float and ended the engine's thread
    for good: the engine was never followed again."""
    port = _closed_port()
    follower = EventFollower([f"127.0.0.1:{port}"], reconnect=NO_WAIT)
    server = None
    try:
        follower.start()
        assert wait_until(lambda: follower.status()[f"127.0.0.1:{port}"].connects >= 1100, timeout=30)
        servicer = FakeKvHint()
        servicer.watch_scripts = [[*snapshot("E1", 3, {"S": [(1, [DEVICE])]}), HANG]]
        server = start_fake_server(servicer, port=port)
        assert follower.wait_synced(timeout=10)
    finally:
        follower.stop()
        if server is not None:
            server.stop()


def test_the_async_follower_also_outlasts_a_thousand_failed_reconnects() -> None:
    port = _closed_port()
    servicer = FakeKvHint()
    servicer.watch_scripts = [[*snapshot("E1", 3, {"S": [(1, [DEVICE])]}), HANG]]
    servers = []

    async def scenario() -> None:
        follower = AsyncEventFollower({"e1": f"127.0.0.1:{port}"}, reconnect=NO_WAIT)
        await follower.start()
        try:
            for _ in range(3000):
                if follower.status()["e1"].connects >= 1100:
                    break
                await asyncio.sleep(0.01)
            assert follower.status()["e1"].connects >= 1100
            servers.append(start_fake_server(servicer, port=port))
            assert await follower.wait_synced(timeout=10)
        finally:
            await follower.stop()

    try:
        asyncio.run(scenario())
    finally:
        for server in servers:
            server.stop()


def test_follower_over_two_engines_answers_router_queries() -> None:
    servers = []
    for sessions in ({"S": [(1, [DEVICE]), (2, [DEVICE])], "T": [(5, [DEVICE])]}, {"S": [(1, [HOST])]}):
        servicer = FakeKvHint()
        servicer.watch_scripts = [[*snapshot("E", 1, sessions), HANG]]
        servers.append(start_fake_server(servicer))
    follower = EventFollower({"a": servers[0].address, "b": servers[1].address}, reconnect=FAST)
    try:
        with follower:
            assert follower.wait_synced(timeout=10)
            assert [(r.engine, r.blocks) for r in follower.index.engines_for_session("S")] == [("a", 2), ("b", 1)]
            assert follower.index.engines_for_block(h(1)) == {"a", "b"}
            assert follower.index.engines_for_block(h(1), tier="device") == {"a"}
            assert follower.index.session_blocks("T", "a") == {h(5)}
    finally:
        for server in servers:
            server.stop()


def test_async_follower_resumes_after_disconnect() -> None:
    servicer = FakeKvHint()
    servicer.watch_scripts = [
        [*snapshot("E1", 10, {"S1": [(1, [DEVICE])]}), ("abort", grpc.StatusCode.UNAVAILABLE)],
        [stored("E1", 11, [2], "S2"), HANG],
    ]
    server = start_fake_server(servicer)

    async def scenario() -> None:
        follower = AsyncEventFollower({"e1": server.address}, reconnect=FAST)
        await follower.start()
        try:
            for _ in range(500):
                if follower.index.session_blocks("S2", "e1"):
                    break
                await asyncio.sleep(0.02)
            assert follower.index.is_live("e1")
            assert follower.index.sessions() == {"S1", "S2"}
            assert servicer.watch_requests[1].start == START.START_RESUME
            assert servicer.watch_requests[1].resume_after_sequence == 10
        finally:
            await follower.stop()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_stopping_either_follower_leaves_its_engines_not_live() -> None:
    """After stop(), the index no longer routes to an engine from state frozen at stop time: the
    asyncio follower used to leave it live (its cancelled task skipped stream_ended)."""

    def serve():
        servicer = FakeKvHint()
        servicer.watch_scripts = [[*snapshot("E1", 5, {"S": [(1, [DEVICE])]}), HANG]]
        return start_fake_server(servicer)

    async def scenario(address: str) -> tuple[bool, bool, list[str], bool]:
        follower = AsyncEventFollower({"e": address}, reconnect=FAST)
        await follower.start()
        synced = await follower.wait_synced(10)
        await follower.stop()
        return synced, follower.index.is_live("e"), [r.engine for r in follower.index.engines_for_session("S")], follower.status()["e"].live

    server = serve()
    try:
        assert asyncio.run(scenario(server.address)) == (True, False, [], False)
    finally:
        server.stop()
    server = serve()
    try:
        follower = EventFollower({"e": server.address}, reconnect=FAST)
        follower.start()
        assert follower.wait_synced(10)
        follower.stop()
        assert not follower.index.is_live("e") and not follower.index.engines_for_session("S")
    finally:
        server.stop()


def test_silent_stream_is_cancelled_and_resumed() -> None:
    servicer = FakeKvHint()
    servicer.watch_scripts = [
        [*snapshot("E1", 10, {"S1": [(1, [DEVICE])]}), HANG],     # then silence: no heartbeats
        [heartbeat("E1", 10), stored("E1", 11, [2], "S2"), HANG],
    ]
    server = start_fake_server(servicer)
    follower = EventFollower({"e1": server.address}, reconnect=FAST, stall_timeout=0.3)
    try:
        follower.start()
        assert wait_until(lambda: bool(follower.index.session_blocks("S2", "e1")), timeout=10)
        assert follower.status()["e1"].stalls >= 1
        resumed = servicer.watch_requests[1]
        assert (resumed.start, resumed.resume_epoch, resumed.resume_after_sequence) == (START.START_RESUME, "E1", 10)
    finally:
        follower.stop()
        server.stop()


def test_async_silent_stream_is_cancelled_and_resumed() -> None:
    servicer = FakeKvHint()
    servicer.watch_scripts = [
        [*snapshot("E1", 10, {"S1": [(1, [DEVICE])]}), HANG],
        [stored("E1", 11, [2], "S2"), HANG],
    ]
    server = start_fake_server(servicer)

    async def scenario() -> None:
        async with AsyncEventFollower({"e1": server.address}, reconnect=FAST, stall_timeout=0.3) as follower:
            for _ in range(500):
                if follower.index.session_blocks("S2", "e1"):
                    break
                await asyncio.sleep(0.02)
            assert follower.index.session_blocks("S2", "e1") == {h(2)}
            assert follower.status()["e1"].stalls >= 1
            assert servicer.watch_requests[1].start == START.START_RESUME

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_refused_resume_falls_back_to_a_snapshot() -> None:
    index = ResidencyIndex()
    tracker = synced_tracker(index)
    tracker.stream_ended(KvHintError(grpc.StatusCode.CANCELLED, "server going away"))
    assert tracker.subscription() == ("resume", ("E1", 10))
    tracker.stream_ended(KvHintError(grpc.StatusCode.INVALID_ARGUMENT, "bad resume epoch"))
    assert tracker.subscription() == ("snapshot", None)


def test_async_stop_is_not_lost_when_a_message_arrives_with_it(monkeypatch) -> None:
    """stop() while a message has just been read: on Python < 3.12 asyncio.wait_for (the stall
    timeout) returns that message and swallows the cancellation, and the follower used to keep
    following, so `await stop()` never returned while the engine kept streaming."""
    import kvhint_client.follower as follower_module

    queue: asyncio.Queue = asyncio.Queue()

    class Stream:
        def __aiter__(self):
            return self._messages()

        async def _messages(self):
            for message in snapshot("E1", 1, {"S": [(1, [DEVICE])]}):
                yield message
            while True:
                yield await queue.get()

        def cancel(self) -> None:
            pass

    class Client:
        def __init__(self, config) -> None:
            pass

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc) -> None:
            pass

        def watch(self, start, *, resume=None, heartbeat=None) -> Stream:
            return Stream()

    monkeypatch.setattr(follower_module, "AsyncKvHintClient", Client)

    async def scenario() -> tuple[bool, bool]:
        follower = AsyncEventFollower({"e1": "127.0.0.1:1"}, reconnect=FAST, stall_timeout=30)
        await follower.start()
        assert await follower.wait_synced(timeout=5)
        queue.put_nowait(heartbeat("E1", 2))
        await asyncio.sleep(0)  # the message is read; the follower has not resumed yet
        stopping = asyncio.ensure_future(follower.stop())
        done, _ = await asyncio.wait({stopping}, timeout=2)
        if not done:  # clean up: a second stop() cancels the task for good
            await follower.stop()
            await stopping
        return bool(done), follower.index.is_live("e1")

    assert asyncio.run(scenario()) == (True, False), "stop() must return and leave the engine not live"


@pytest.mark.parametrize("follower_class", [EventFollower, AsyncEventFollower])
@pytest.mark.parametrize("bad", [0, -1.0])
def test_a_heartbeat_no_subscription_can_ask_for_is_refused_at_construction(follower_class, bad) -> None:
    """Every subscription refuses a heartbeat <= 0 (ValueError). The follower used to accept it:
    each engine's thread (or task) then ended at its first subscription, and the follower never
    synced, with nothing raised to the caller."""
    with pytest.raises(ValueError, match="heartbeat must be > 0 seconds"):
        follower_class({"e1": "127.0.0.1:1"}, heartbeat=bad)
