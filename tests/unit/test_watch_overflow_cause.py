"""Which Resync cause a WatchEvents subscriber that falls behind gets (watch.py's module docstring).

An operator trial: raw streams that stopped reading while events were published fast ended with
Resync(COMPACTED), blaming the replay window, instead of SUBSCRIBER_OVERFLOW. The stall rule
(blocked for `subscriber_stall_s` and more than `subscriber_buffer` behind) had not fired yet
when the ring passed the stream's cursor, and a live cursor passed by the ring was reported as
COMPACTED, the cause the proto keeps for a requested sequence older than the window.

These tests drive WatchHub.stream in-process, on a private event loop whose clock is a fake:
taking the generator's next message is the client reading (gRPC taking it off flow control);
not taking it leaves the generator suspended at its `yield`, as a send blocked on flow control
is. Events are published straight on the core's bus (publish never waits for the loop), so
every interleaving is the test's, and time moves only when the test moves it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from google.protobuf import duration_pb2
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_server.config import ServerConfig
from kvhint_server.core import KvHintCore
from kvhint_server.events import AllBlocksCleared
from kvhint_server.model import Tier
from kvhint_server.queries import Queries
from kvhint_server.watch import WatchHub

QUIET = duration_pb2.Duration(seconds=60)  # no heartbeats: the fake clock never reaches one anyway
OVERFLOW, COMPACTED = pb.Resync.CAUSE_SUBSCRIBER_OVERFLOW, pb.Resync.CAUSE_COMPACTED


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class InProcessWatch:
    """A WatchHub over a real core's bus, on a loop that runs only when the test pumps it."""

    def __init__(self, **config: Any) -> None:
        self.clock = FakeClock()
        self.loop = asyncio.new_event_loop()
        self.loop.time = self.clock  # type: ignore[method-assign]  # loop time: sending_since and the stall rule
        self.config = ServerConfig(**config)
        self.core = KvHintCore(self.config)
        self.bus = self.core.bus
        self.hub = WatchHub(self.core, Queries(self.core), self.config, self.loop)

    def publish(self, n: int) -> None:
        for _ in range(n):
            self.bus.publish(AllBlocksCleared(Tier.DEVICE))

    def settle(self) -> None:
        """Run every loop callback that is due (the hub's dispatch after a publish)."""
        for _ in range(5):
            self.loop.run_until_complete(asyncio.sleep(0))

    def open(self, **request: Any) -> Stream:
        return Stream(self, self.hub.stream(pb.WatchEventsRequest(heartbeat_interval=QUIET, **request)))

    def close(self) -> None:
        self.hub.close()
        self.settle()
        self.loop.close()


class Stream:
    """One subscription: `read()` is the client taking one message off the stream."""

    def __init__(self, watch: InProcessWatch, gen: Any) -> None:
        self.watch, self.gen = watch, gen
        self.pending: asyncio.Future[Any] | None = None
        self.ended = False

    def read(self) -> pb.WatchEventsResponse | None:
        """The next message as the client sees it; None while the stream has nothing to send
        (it waits for a publish). Raises StopAsyncIteration once the stream ended."""
        if self.pending is None:
            self.pending = self.watch.loop.create_task(self.gen.__anext__())
        self.watch.settle()
        if not self.pending.done():
            return None
        task, self.pending = self.pending, None
        try:
            msg = task.result()
        except StopAsyncIteration:
            self.ended = True
            raise
        return msg if isinstance(msg, pb.WatchEventsResponse) else pb.WatchEventsResponse.FromString(msg)

    def rest(self) -> list[pb.WatchEventsResponse]:
        """Read until the stream ends (it must end: a resync)."""
        out: list[pb.WatchEventsResponse] = []
        while True:
            try:
                msg = self.read()
            except StopAsyncIteration:
                return out
            assert msg is not None, f"the stream waits for events after {len(out)} messages instead of ending"
            out.append(msg)


@pytest.fixture
def make_watch() -> Iterator[Any]:
    made: list[InProcessWatch] = []

    def make(**config: Any) -> InProcessWatch:
        w = InProcessWatch(**config)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


def _resync(msgs: list[pb.WatchEventsResponse]) -> pb.Resync:
    assert msgs and msgs[-1].WhichOneof("payload") == "resync", f"expected a Resync last, got {msgs[-1:]}"
    assert all(m.WhichOneof("payload") != "resync" for m in msgs[:-1])
    return msgs[-1].resync


def test_a_stalled_subscriber_the_window_passes_before_its_stall_is_seen_gets_subscriber_overflow(make_watch):
    """The trial's shape with the defaults' proportions (buffer 4096 of a 10,000-event window, cut
    to 41 of 100): the client reads 3 events, then stops; the publisher is fast, so the ring passes
    the stream's cursor well within `subscriber_stall_s`. When the client reads again it drains the
    events the stream had taken from the ring, then gets SUBSCRIBER_OVERFLOW, not COMPACTED."""
    w = make_watch(event_replay_window=100, subscriber_buffer=41)
    stream = w.open()
    assert stream.read() is None  # subscribed at sequence 0, waiting
    w.publish(5)
    got = [stream.read() for _ in range(3)]
    assert [m.sequence for m in got] == [1, 2, 3]
    # The client stops reading; the stream is suspended handing over event 4. 0.1 s (a fake
    # second, far below the 0.5 s stall) sees 200 events published, two windows' worth.
    w.clock.now += 0.1
    w.publish(200)
    w.settle()
    assert not any(sub.overflowed for sub in w.hub._subs), "the stall rule could not fire yet (0.1 s < 0.5 s)"
    rest = stream.rest()
    assert [m.sequence for m in rest[:-1]] == [4, 5], "what the stream had read from the ring arrives, in order"
    resync = _resync(rest)
    assert resync.cause == OVERFLOW, f"got {pb.Resync.Cause.Name(resync.cause)}: the replay window is blamed for a slow consumer"
    assert resync.oldest_sequence == w.bus.oldest_sequence == 106 and resync.current_epoch == w.bus.epoch
    assert w.hub.subscribers == 0


def test_a_stalled_subscriber_the_stall_rule_cuts_off_first_still_gets_subscriber_overflow(make_watch):
    """The stall rule itself is unchanged: more than `subscriber_buffer` behind for less than
    `subscriber_stall_s` is not cut off; blocked past the stall, the next publish marks it
    overflowed, it reads nothing more from the ring, and once the client drains it gets
    SUBSCRIBER_OVERFLOW (the window never passed it)."""
    w = make_watch(event_replay_window=100, subscriber_buffer=10, subscriber_stall_s=0.5)
    stream = w.open()
    assert stream.read() is None
    w.publish(2)
    assert [stream.read().sequence for _ in range(2)] == [1, 2]  # then the client stops
    w.clock.now += 0.4
    w.publish(20)  # 20 behind, buffer 10, blocked 0.4 s
    w.settle()
    assert not any(sub.overflowed for sub in w.hub._subs)
    w.clock.now += 0.2
    w.publish(1)  # blocked 0.6 s
    w.settle()
    assert [sub.overflowed for sub in w.hub._subs] == [True]
    rest = stream.rest()
    assert len(rest) == 1 and _resync(rest).cause == OVERFLOW
    assert w.bus.oldest_sequence == 1, "the window never passed it: the stall rule decided"


def test_a_resume_whose_position_the_window_passes_before_the_first_read_gets_compacted(make_watch, monkeypatch):
    """A START_RESUME position inside the window when requested, which the engine thread's
    publishing pushes out before the stream's first read of the ring: the request was for events
    no longer kept, COMPACTED, as for one older than the window when requested."""
    w = make_watch(event_replay_window=10, subscriber_buffer=5)
    w.publish(12)  # kept: 3..12
    real_read_after, bursts = w.bus.read_after, [20]

    def read_after_a_burst(sequence: int, limit: int) -> Any:
        while bursts:  # the engine thread publishes between the request's check and the first read
            w.publish(bursts.pop())
        return real_read_after(sequence, limit)

    monkeypatch.setattr(w.bus, "read_after", read_after_a_burst)
    stream = w.open(start=pb.WatchEventsRequest.START_RESUME, resume_epoch=w.bus.epoch, resume_after_sequence=5)
    rest = stream.rest()
    assert len(rest) == 1
    assert _resync(rest).cause == COMPACTED and rest[0].resync.oldest_sequence == 23


@example(window=8, buffer=8, read=1, held=0, burst=9, stalled=False)  # one past the window: lost
@example(window=8, buffer=8, read=1, held=0, burst=8, stalled=False)  # the window just full: kept
@example(window=100, buffer=41, read=3, held=2, burst=200, stalled=False)  # the trial's shape
@example(window=8, buffer=3, read=2, held=1, burst=3, stalled=True)  # stall rule inside the window
@example(window=8, buffer=3, read=2, held=1, burst=2, stalled=True)  # stalled, at the buffer: kept
@settings(max_examples=150, deadline=None)
@given(
    window=st.integers(2, 40),
    buffer=st.integers(1, 40),
    read=st.integers(1, 6),
    held=st.integers(0, 6),
    burst=st.integers(0, 90),
    stalled=st.booleans(),
)
def test_a_live_subscriber_that_falls_behind_gets_every_event_or_a_gapless_prefix_then_overflow(
    window, buffer, read, held, burst, stalled
):
    """A live (START_NOW) subscriber: `read + held` events are published, the client reads `read`
    of them and stops (the stream holds the other `held`, taken from the ring before the stop),
    `burst` more are published (after `subscriber_stall_s` when `stalled`, before it otherwise),
    then the client drains. Whatever the window, buffer, burst and stall:
      * blocked past the stall and more than the buffer behind at the burst's publish: cut off,
        it reads nothing more from the ring: one Resync(SUBSCRIBER_OVERFLOW), nothing else;
      * otherwise, if the burst passed the window: the events it held, in order, then one
        Resync(SUBSCRIBER_OVERFLOW) (never COMPACTED: it requested no position);
      * otherwise every event, in order, and the stream stays open."""
    assume(read + held <= window)  # all kept when the client starts reading
    w = InProcessWatch(event_replay_window=window, subscriber_buffer=buffer, subscriber_stall_s=0.5)
    try:
        stream = w.open()
        assert stream.read() is None
        w.publish(read + held)
        assert [stream.read().sequence for _ in range(read)] == list(range(1, read + 1))
        if stalled:
            w.clock.now += 0.6
        w.publish(burst)
        w.settle()
        msgs, ended = _drain(stream)
        cut_off = stalled and burst > 0 and held + burst > min(buffer, window)
        lost = burst > window
        events = [m.sequence for m in msgs if m.WhichOneof("payload") != "resync"]
        if cut_off:
            assert ended and events == [] and _resync(msgs).cause == OVERFLOW
        elif lost:
            assert ended and events == list(range(read + 1, read + held + 1))
            resync = _resync(msgs)
            assert resync.cause == OVERFLOW, f"got {pb.Resync.Cause.Name(resync.cause)} for a live subscriber"
            assert resync.oldest_sequence == w.bus.oldest_sequence > read + held + 1
        else:
            assert not ended and events == list(range(read + 1, read + held + burst + 1))
    finally:
        w.close()


def _drain(stream: Stream) -> tuple[list[pb.WatchEventsResponse], bool]:
    """Read until the stream waits for events (False) or ends (True)."""
    out: list[pb.WatchEventsResponse] = []
    while True:
        try:
            msg = stream.read()
        except StopAsyncIteration:
            return out, True
        if msg is None:
            return out, False
        out.append(msg)
