"""EngineStatus as a dashboard reads it: `last_error` is a current error only (cleared once the
engine is live again, kept in `previous_error`), and `epoch_changes` counts every epoch the
follower moved to, an engine restart noticed through a Resync(CAUSE_EPOCH_CHANGED) included.

A router engineer's trial against two engines saw an engine live again with its old
"UNAVAILABLE: failed to connect" as last_error, and restarts counted in resyncs but never in
epoch_changes. The tracker tests script the messages (no network); the follower tests run the
thread and asyncio followers against a scripted fake server and a real KvHintServer restarted on
its port."""

from __future__ import annotations

import asyncio
import time
from typing import Optional

import grpc
import pytest
from fake_kvhint_server import HANG, FakeKvHint, ev, heartbeat, resync, snapshot, start_fake_server, stored, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhint.v1 import kvhint_pb2
from kvhint_client.config import RetryPolicy
from kvhint_client.errors import KvHintError
from kvhint_client.follower import AsyncEventFollower, EngineTracker, EventFollower, ResidencyIndex, Verdict

DEVICE = kvhint_pb2.TIER_DEVICE
EPOCH_CHANGED, COMPACTED = kvhint_pb2.Resync.CAUSE_EPOCH_CHANGED, kvhint_pb2.Resync.CAUSE_COMPACTED
FAST = RetryPolicy(max_attempts=1_000, initial_backoff=0.02, max_backoff=0.1, jitter=0.0)


def unavailable(text: str = "failed to connect to all addresses") -> KvHintError:
    return KvHintError(grpc.StatusCode.UNAVAILABLE, text)


def epoch_resync(new_epoch: str, seq: int = 0, *, named: bool = True) -> kvhint_pb2.WatchEventsResponse:
    """What a server answers a resume from another epoch (kvhint_server.watch): the envelope and
    current_epoch carry the engine's epoch now; named=False leaves both out."""
    epoch = new_epoch if named else ""
    return ev(epoch, seq, resync=kvhint_pb2.Resync(cause=EPOCH_CHANGED, current_epoch=epoch, message="epoch changed"))


def synced(epoch: str = "E1", seq: int = 10) -> tuple[ResidencyIndex, EngineTracker]:
    index = ResidencyIndex()
    tracker = EngineTracker("e1", "addr", index)
    assert tracker.subscription() == ("snapshot", None)
    for message in snapshot(epoch, seq, {"S1": [(1, [DEVICE])]}):
        tracker.handle(message)
    assert index.is_live("e1")
    return index, tracker


def install(tracker: EngineTracker, epoch: str, seq: int = 5) -> None:
    assert tracker.subscription() == ("snapshot", None)
    for message in snapshot(epoch, seq, {"S": [(9, [DEVICE])]}):
        assert tracker.handle(message) is Verdict.CONTINUE


# -- last_error ------------------------------------------------------------------------------------


def test_last_error_is_cleared_when_a_resumed_stream_goes_live() -> None:
    index, tracker = synced()
    error = unavailable()
    tracker.stream_ended(error)
    status = tracker.status
    assert (status.live, status.last_error, status.previous_error) == (False, str(error), None)
    assert tracker.subscription() == ("resume", ("E1", 10))
    tracker.handle(heartbeat("E1", 10))
    assert status.live and index.is_live("e1")
    assert status.last_error is None, "a live engine shows no current error"
    assert status.previous_error == str(error), "what it recovered from is kept apart"


def test_last_error_is_cleared_when_a_new_snapshot_is_installed() -> None:
    _, tracker = synced()
    error = unavailable()
    tracker.stream_ended(error)
    tracker.subscription()
    assert tracker.handle(epoch_resync("E2")) is Verdict.RESNAPSHOT
    tracker.stream_ended()
    assert tracker.status.last_error == str(error), "not live yet: the error is still current"
    install(tracker, "E2")
    assert tracker.status.live and tracker.status.last_error is None
    assert tracker.status.previous_error == str(error)


def test_last_error_follows_the_latest_failure_while_the_engine_stays_down() -> None:
    _, tracker = synced()
    for attempt in range(3):
        tracker.subscription()
        tracker.stream_ended(unavailable(f"attempt {attempt}"))
        assert tracker.status.last_error == str(unavailable(f"attempt {attempt}"))
        assert not tracker.status.live and tracker.status.previous_error is None


# -- epoch_changes ---------------------------------------------------------------------------------


def test_a_restart_seen_through_an_epoch_changed_resync_counts_once() -> None:
    """The trial's restart: the stream breaks, the resume is answered Resync(EPOCH_CHANGED), the
    follower re-snapshots into the new epoch."""
    _, tracker = synced("E1")
    tracker.stream_ended(unavailable())
    assert tracker.subscription() == ("resume", ("E1", 10))
    assert tracker.handle(epoch_resync("E2")) is Verdict.RESNAPSHOT
    assert tracker.status.epoch_changes == 1
    tracker.stream_ended()
    install(tracker, "E2")
    status = tracker.status
    assert (status.resyncs, status.epoch_changes, status.snapshots, status.epoch) == (1, 1, 2, "E2")


def test_an_unnamed_epoch_changed_resync_counts_once_with_its_snapshot() -> None:
    _, tracker = synced("E1")
    tracker.stream_ended(unavailable())
    tracker.subscription()
    tracker.handle(epoch_resync("", named=False))
    assert tracker.status.epoch_changes == 1
    tracker.stream_ended()
    install(tracker, "E2")
    assert tracker.status.epoch_changes == 1


def test_a_new_epoch_found_only_by_the_snapshot_counts() -> None:
    """A refused resume (or a resync for another cause) re-snapshots without naming an epoch: the
    installed snapshot's new epoch is the change."""
    _, tracker = synced("E1")
    tracker.stream_ended(KvHintError(grpc.StatusCode.FAILED_PRECONDITION, "resume refused"))
    install(tracker, "E2")
    assert tracker.status.epoch_changes == 1
    tracker.handle(resync("E2", 5))  # CAUSE_COMPACTED, same epoch
    tracker.stream_ended()
    install(tracker, "E2", 7)
    assert tracker.status.epoch_changes == 1, "a re-snapshot in the same epoch is no change"


def test_the_first_epoch_and_same_epoch_resyncs_are_not_changes() -> None:
    _, tracker = synced("E1")
    assert tracker.status.epoch_changes == 0
    tracker.handle(resync("E1", 10))
    tracker.stream_ended()
    install(tracker, "E1", 12)
    assert (tracker.status.resyncs, tracker.status.epoch_changes) == (1, 0)


def test_an_epoch_changed_resync_before_the_first_snapshot_is_not_a_change() -> None:
    index = ResidencyIndex()
    tracker = EngineTracker("e1", "addr", index)
    tracker.subscription()
    tracker.handle(epoch_resync("E0"))
    tracker.stream_ended()
    install(tracker, "E1")
    assert tracker.status.epoch_changes == 0


# -- a property over random runs -------------------------------------------------------------------

ACTIONS = st.lists(st.sampled_from(["connect", "refused", "event", "restart", "silent_restart", "drop", "compacted"]),
                   max_size=40)


@settings(max_examples=300, deadline=None)
@given(actions=ACTIONS)
def test_status_counts_epochs_and_errors_as_documented(actions: list[str]) -> None:
    """Random engine restarts, broken streams, refused resumes and resyncs. After every step:
    `live` implies no last_error, last_error is the latest failure since the engine was last
    live, and epoch_changes is the number of epoch transitions among the epochs of the messages
    handled since the first snapshot (epochs never repeat, so: distinct epochs seen - 1)."""
    index = ResidencyIndex()
    tracker = EngineTracker("e", "addr", index)
    engine_epoch, engine_seq, restarts = "E0", 0, 0
    connected = False
    seen: list[str] = []  # the epochs of handled messages, from the first installed snapshot on
    expected_error: Optional[str] = None
    failures = 0

    def handle(message: kvhint_pb2.WatchEventsResponse) -> Verdict:
        verdict = tracker.handle(message)
        if seen or message.WhichOneof("payload") == "snapshot_end":
            seen.append(message.epoch)
        return verdict

    def fail(code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        nonlocal failures, expected_error, connected
        failures += 1
        error = KvHintError(code, f"failure {failures}")
        tracker.stream_ended(error)
        expected_error, connected = str(error), False

    for action in actions:
        if action in ("restart", "silent_restart"):
            restarts += 1
            engine_epoch, engine_seq = f"E{restarts}", 0
            if action == "restart" and connected:
                fail()  # the process died: the stream breaks
        elif action == "connect" and not connected:
            start, resume = tracker.subscription()
            if start == "snapshot":
                for message in snapshot(engine_epoch, engine_seq, {"S": [(1, [DEVICE])]}):
                    handle(message)
                connected, expected_error = True, None
            elif resume[0] != engine_epoch:
                assert handle(epoch_resync(engine_epoch, engine_seq)) is Verdict.RESNAPSHOT
                tracker.stream_ended()
            else:
                handle(heartbeat(engine_epoch, engine_seq))
                connected, expected_error = True, None
        elif action == "refused" and not connected:
            tracker.subscription()
            fail(grpc.StatusCode.FAILED_PRECONDITION)
        elif action == "event" and connected:
            engine_seq += 1
            if handle(stored(engine_epoch, engine_seq, [engine_seq], "S")) is Verdict.RESNAPSHOT:
                tracker.stream_ended()
                connected = False
        elif action == "drop" and connected:
            fail()
        elif action == "compacted" and connected:
            assert handle(resync(engine_epoch, engine_seq)) is Verdict.RESNAPSHOT
            tracker.stream_ended()
            connected = False

        status = tracker.status
        assert status.live == connected == index.is_live("e")
        assert not (status.live and status.last_error is not None), "a live engine with a current error"
        assert status.last_error == expected_error
        transitions = sum(1 for a, b in zip(seen, seen[1:]) if a != b)
        assert status.epoch_changes == transitions == max(0, len(set(seen)) - 1)


# -- the followers ---------------------------------------------------------------------------------


def restart_script() -> list[list]:
    """The trial's restart as a server shows it: E1 stream breaks; the resume from E1 is answered
    Resync(EPOCH_CHANGED) by the new E2 process; the follower's snapshot is of E2."""
    return [
        [*snapshot("E1", 10, {"S1": [(1, [DEVICE])]}), ("abort", grpc.StatusCode.UNAVAILABLE)],
        [epoch_resync("E2", 3)],
        [*snapshot("E2", 3, {"S2": [(2, [DEVICE])]}), HANG],
    ]


def assert_recovered_into_e2(status, requests) -> None:
    assert [r.start for r in requests] == [kvhint_pb2.WatchEventsRequest.START_SNAPSHOT,
                                           kvhint_pb2.WatchEventsRequest.START_RESUME,
                                           kvhint_pb2.WatchEventsRequest.START_SNAPSHOT]
    assert status.live and status.epoch == "E2"
    assert status.last_error is None, f"live again, yet shows the error {status.last_error!r}"
    assert status.previous_error is not None and "UNAVAILABLE" in status.previous_error
    assert (status.resyncs, status.epoch_changes) == (1, 1)


def test_thread_follower_status_after_an_engine_restart() -> None:
    servicer = FakeKvHint()
    servicer.watch_scripts = restart_script()
    server = start_fake_server(servicer)
    follower = EventFollower({"e1": server.address}, heartbeat=0.2, reconnect=FAST)
    try:
        follower.start()
        assert wait_until(lambda: len(servicer.watch_requests) == 3 and follower.index.is_live("e1"))
        assert_recovered_into_e2(follower.status()["e1"], servicer.watch_requests)
    finally:
        follower.stop()
        server.stop()


def test_async_follower_status_after_an_engine_restart() -> None:
    servicer = FakeKvHint()
    servicer.watch_scripts = restart_script()
    server = start_fake_server(servicer)

    async def main() -> None:
        follower = AsyncEventFollower({"e1": server.address}, heartbeat=0.2, reconnect=FAST)
        await follower.start()
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while not (len(servicer.watch_requests) == 3 and follower.index.is_live("e1")) and loop.time() < deadline:
                await asyncio.sleep(0.02)
            assert_recovered_into_e2(follower.status()["e1"], servicer.watch_requests)
        finally:
            await follower.stop()

    try:
        asyncio.run(main())
    finally:
        server.stop()


@pytest.mark.timeout(60)
def test_a_real_server_restarted_on_its_port() -> None:
    """A KvHintServer stopped (the follower fails to connect) and a new one, a new epoch, started on
    the same port: the follower ends live in the new epoch, one epoch change, no current error."""
    from test_reconnect import Engine  # one engine lifetime: core, fake engine, sidecar
    first = Engine("127.0.0.1:0")
    address = f"127.0.0.1:{first.port}"
    follower = EventFollower({"e": address}, heartbeat=0.2, reconnect=FAST)
    second: Optional[Engine] = None
    try:
        follower.start()
        assert follower.wait_synced(10)
        old_epoch = first.core.bus.epoch
        first.stop()
        status = follower.status()["e"]
        assert wait_until(lambda: status.last_error is not None and not status.live, timeout=10)
        time.sleep(0.3)  # a few failed connects
        second = Engine(address)
        new_epoch = second.core.bus.epoch
        assert new_epoch != old_epoch
        assert wait_until(lambda: status.live and status.epoch == new_epoch, timeout=10)
        assert status.last_error is None and status.previous_error is not None
        assert status.epoch_changes == 1, (status.resyncs, status.snapshots, status.epoch_changes)
    finally:
        follower.stop()
        if second is not None:
            second.stop()
