"""EventFollower: keeps a router-side ResidencyIndex current from one or more engines' WatchEvents.

    follower = EventFollower({"e1": "10.0.0.1:50151", "e2": "10.0.0.2:50151"})
    follower.start()
    follower.wait_synced(timeout=10)
    best = follower.index.engines_for_session("agent-7")   # ranked, most resident blocks first

This module holds the runners (EventFollower on threads, AsyncEventFollower on asyncio): they own
the gRPC streams, reconnect and stall detection. The parts without a transport live in their own
modules and are re-exported here:
- kvhint_client.residency_index: ResidencyIndex and its index semantics (no grpc import; a router
  can embed it and feed it itself).
- kvhint_client.follow_tracker: EngineTracker, the per-engine stream state machine (snapshot,
  resume, duplicates, resync and epoch changes; no grpc import).

Runner behaviour per engine, on top of the tracker's stream protocol:
- After a disconnect (engine down, network), resubscribe with START_RESUME from the last
  (epoch, sequence) processed, with exponential backoff while the engine is unreachable.
- A stream silent for longer than `stall_timeout` (default 5 heartbeats + 1 s; heartbeats are
  requested from the server) is treated as a dead connection: cancelled and resumed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Callable, Optional, Union

from kvhint.v1 import kvhint_pb2

from .client import AsyncKvHintClient, KvHintClient, WatchStream
from .config import ConfigLike, ConnectionConfig, RetryPolicy, as_config
from .durations import to_duration
from .errors import KvHintError
from .follow_tracker import EngineStatus, EngineTracker, Verdict
from .residency_index import EngineResidency, EngineResidencyState, ResidencyIndex, apply_to_state

__all__ = [
    "DEFAULT_RECONNECT",
    "AsyncEventFollower",
    "EngineResidency",
    "EngineResidencyState",
    "EngineStatus",
    "EngineTracker",
    "EnginesLike",
    "EventCallback",
    "EventFollower",
    "ResidencyIndex",
    "Verdict",
    "apply_to_state",
]

log = logging.getLogger(__name__)

EventCallback = Callable[[str, kvhint_pb2.WatchEventsResponse], None]
EnginesLike = Union[Mapping[str, ConfigLike], Iterable[ConfigLike]]


def _named_engines(engines: EnginesLike) -> dict[str, ConnectionConfig]:
    if isinstance(engines, Mapping):
        named = {str(name): as_config(cfg) for name, cfg in engines.items()}
    else:
        named = {}
        for item in engines:
            cfg = as_config(item)
            named[cfg.address] = cfg
    if not named:
        raise ValueError("EventFollower needs at least one engine")
    return named


def _stall_timeout(value: Optional[float], heartbeat: float) -> float:
    if value is None:
        return 5 * heartbeat + 1.0
    if value < 0:
        raise ValueError("stall_timeout must be >= 0")
    return value


#: Sleep between reconnects: 0.1 s doubling to 0.5 s. With the channel's own reconnect backoff
#: capped at 0.5 s (kvhint_client.config.RECONNECT_CHANNEL_OPTIONS) a follower is back in the new
#: epoch within about a second of a restarted engine answering SERVING; a reconnect costs a
#: refused TCP connect, so polling a down engine twice a second is cheap.
DEFAULT_RECONNECT = RetryPolicy(max_attempts=1_000_000, initial_backoff=0.1, max_backoff=0.5, multiplier=2.0, jitter=0.2)


# ---------------------------------------------------------------------------------------------
# Thread follower
# ---------------------------------------------------------------------------------------------


class _FollowerBase:
    """What the thread and asyncio followers share: engines, index, trackers, settings."""

    def __init__(
        self,
        engines: EnginesLike,
        index: Optional[ResidencyIndex],
        heartbeat: float,
        reconnect: RetryPolicy,
        on_event: Optional[EventCallback],
        stall_timeout: Optional[float],
    ) -> None:
        self.index = index or ResidencyIndex()
        self._configs = _named_engines(engines)
        # Checked here as every subscription checks it: a heartbeat it refuses used to end each
        # engine's thread (or task) at its first subscription, and the follower never synced.
        to_duration(heartbeat, name="heartbeat")
        self._heartbeat = heartbeat
        self._reconnect = reconnect
        self._on_event = on_event
        self._stall_timeout = _stall_timeout(stall_timeout, heartbeat)
        self._trackers = {name: EngineTracker(name, cfg.address, self.index) for name, cfg in self._configs.items()}

    @property
    def engines(self) -> list[str]:
        return list(self._configs)

    def status(self) -> dict[str, EngineStatus]:
        """engine -> its EngineStatus, the live object the follower keeps updating (see the
        EngineStatus docstring: `last_error` is None while the engine is live, what it recovered
        from is in `previous_error`; `epoch_changes` counts each epoch it moved to, restarts
        included)."""
        return {name: tracker.status for name, tracker in self._trackers.items()}


class EventFollower(_FollowerBase):
    """Follows several engines, one daemon thread each, into `index`.

    engines: {name: address or ConnectionConfig}, or a list of them (named by address).
    heartbeat: the heartbeat period requested from servers (seconds, > 0: ValueError otherwise).
    reconnect: backoff between reconnects (max_attempts is ignored; it retries until stop()).
    on_event: called as on_event(engine, message) for every message, on the engine's thread,
        after the index was updated. Exceptions from it are logged and ignored.
    stall_timeout: seconds without any message after which a stream is cancelled and resumed
        (default 5 * heartbeat + 1; 0 disables).
    """

    def __init__(
        self,
        engines: EnginesLike,
        *,
        index: Optional[ResidencyIndex] = None,
        heartbeat: float = 1.0,
        reconnect: RetryPolicy = DEFAULT_RECONNECT,
        on_event: Optional[EventCallback] = None,
        stall_timeout: Optional[float] = None,
    ) -> None:
        super().__init__(engines, index, heartbeat, reconnect, on_event, stall_timeout)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._streams: dict[str, WatchStream] = {}
        self._last_seen: dict[str, float] = {}
        self._streams_lock = threading.Lock()


    def position(self, engine: str) -> Optional[tuple[str, int]]:
        return self._trackers[engine].position

    def start(self) -> "EventFollower":
        if self._threads:
            raise RuntimeError("EventFollower already started")
        self._stop.clear()
        for name in self._configs:
            thread = threading.Thread(target=self._run, args=(name,), name=f"kvhint-follow-{name}", daemon=True)
            self._threads.append(thread)
        if self._stall_timeout:
            self._threads.append(threading.Thread(target=self._watchdog, name="kvhint-follow-watchdog", daemon=True))
        for thread in self._threads:
            thread.start()
        return self

    def wait_synced(self, timeout: Optional[float] = None) -> bool:
        """Block until every engine is live (snapshot installed, stream up); False on timeout."""
        return self.index.wait_live(self._configs, timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop following: cancel every stream and join the threads (each engine's stream ends, so
        the index no longer counts it live)."""
        self._stop.set()
        with self._streams_lock:
            for stream in self._streams.values():
                stream.cancel()
        for thread in self._threads:
            thread.join(timeout)
        self._threads = []

    def __enter__(self) -> "EventFollower":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _notify(self, engine: str, message: kvhint_pb2.WatchEventsResponse) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(engine, message)
        except Exception:
            log.exception("on_event callback failed for engine %s", engine)

    def _watchdog(self) -> None:
        """Cancel streams that went silent for longer than stall_timeout (they are then resumed)."""
        assert self._stall_timeout
        while not self._stop.wait(min(1.0, self._stall_timeout / 4)):
            now = time.monotonic()
            with self._streams_lock:
                for engine, stream in self._streams.items():
                    if now - self._last_seen.get(engine, now) > self._stall_timeout:
                        log.info("engine %s: no message for %.1fs; reconnecting", engine, self._stall_timeout)
                        self._trackers[engine].status.stalls += 1
                        self._last_seen[engine] = now
                        stream.cancel()

    def _run(self, engine: str) -> None:
        tracker = self._trackers[engine]
        unproductive = 0
        with KvHintClient(self._configs[engine]) as client:
            while not self._stop.is_set():
                start, resume = tracker.subscription()
                error: Optional[BaseException] = None
                stream = client.watch(start, resume=resume, heartbeat=self._heartbeat)
                with self._streams_lock:
                    self._streams[engine] = stream
                    self._last_seen[engine] = time.monotonic()
                if self._stop.is_set():
                    stream.cancel()
                try:
                    for message in stream:
                        self._last_seen[engine] = time.monotonic()
                        verdict = tracker.handle(message)
                        self._notify(engine, message)
                        if verdict is Verdict.RESNAPSHOT:
                            break
                except KvHintError as exc:
                    error = exc
                    log.debug("engine %s stream failed: %s", engine, exc)
                except Exception as exc:  # a bug, not the engine: log it and keep following
                    error = exc
                    log.exception("engine %s: following failed; reconnecting", engine)
                finally:
                    stream.cancel()
                    with self._streams_lock:
                        self._streams.pop(engine, None)
                progressed = tracker.stream_ended(error)
                unproductive = 0 if progressed else unproductive + 1
                self._stop.wait(self._reconnect.backoff(unproductive + 1))


# ---------------------------------------------------------------------------------------------
# asyncio follower
# ---------------------------------------------------------------------------------------------


class AsyncEventFollower(_FollowerBase):
    """asyncio twin of EventFollower: one task per engine, same index and semantics.
    `await start()` inside a running loop; `await stop()` to cancel (as EventFollower.stop(), it
    leaves every engine not live in the index)."""

    def __init__(
        self,
        engines: EnginesLike,
        *,
        index: Optional[ResidencyIndex] = None,
        heartbeat: float = 1.0,
        reconnect: RetryPolicy = DEFAULT_RECONNECT,
        on_event: Optional[EventCallback] = None,
        stall_timeout: Optional[float] = None,
    ) -> None:
        super().__init__(engines, index, heartbeat, reconnect, on_event, stall_timeout)
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False


    async def start(self) -> "AsyncEventFollower":
        if self._tasks:
            raise RuntimeError("AsyncEventFollower already started")
        self._stopping = False
        self._tasks = [asyncio.create_task(self._run(name), name=f"kvhint-follow-{name}") for name in self._configs]
        return self

    async def wait_synced(self, timeout: Optional[float] = None, poll: float = 0.02) -> bool:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not all(self.index.is_live(e) for e in self._configs):
            if deadline is not None and loop.time() >= deadline:
                return False
            await asyncio.sleep(poll)
        return True

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def __aenter__(self) -> "AsyncEventFollower":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _run(self, engine: str) -> None:
        tracker = self._trackers[engine]
        unproductive = 0
        async with AsyncKvHintClient(self._configs[engine]) as client:
            while not self._stopping:
                start, resume = tracker.subscription()
                error: Optional[BaseException] = None
                stream = client.watch(start, resume=resume, heartbeat=self._heartbeat)
                messages = stream.__aiter__()
                try:
                    while True:
                        try:
                            message = await asyncio.wait_for(anext(messages), self._stall_timeout or None)
                        except StopAsyncIteration:
                            break
                        except asyncio.TimeoutError:
                            log.info("engine %s: no message for %.1fs; reconnecting", engine, self._stall_timeout)
                            tracker.status.stalls += 1
                            break
                        if self._stopping:
                            # stop() cancelled this task while a message arrived: before Python
                            # 3.12, wait_for then returns the message and swallows the
                            # cancellation, and this loop would follow on, stop() never returning.
                            break
                        verdict = tracker.handle(message)
                        if self._on_event is not None:
                            try:
                                self._on_event(engine, message)
                            except Exception:
                                log.exception("on_event callback failed for engine %s", engine)
                        if verdict is Verdict.RESNAPSHOT:
                            break
                except KvHintError as exc:
                    error = exc
                except asyncio.CancelledError:  # stop(): the engine is no longer followed, so not live
                    tracker.stream_ended(None)
                    raise
                except Exception as exc:  # a bug, not the engine: log it and keep following
                    error = exc
                    log.exception("engine %s: following failed; reconnecting", engine)
                finally:
                    stream.cancel()
                progressed = tracker.stream_ended(error)
                unproductive = 0 if progressed else unproductive + 1
                await asyncio.sleep(self._reconnect.backoff(unproductive + 1))
