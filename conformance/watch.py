"""A WatchEvents subscription read on a background thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc

from kvhint.v1 import kvhint_pb2 as pb
from kvhint.v1 import kvhint_pb2_grpc as pbg

from .model import CaseFailed

CONTROL = frozenset({"heartbeat", "snapshot_begin", "snapshot_chunk", "snapshot_end", "resync"})


class Collector:
    """Collects every message of one WatchEvents stream until stopped or the stream ends."""

    def __init__(self, channel: grpc.Channel, request: pb.WatchEventsRequest, *, timeout: float = 300.0) -> None:
        self.call = pbg.KvHintServiceStub(channel).WatchEvents(request, timeout=timeout)
        self.messages: list[pb.WatchEventsResponse] = []
        self.error: grpc.RpcError | None = None
        self.ended = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="conformance-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for message in self.call:
                self.messages.append(message)
        except grpc.RpcError as err:
            if not (self._stopping and err.code() == grpc.StatusCode.CANCELLED):
                self.error = err
        finally:
            self.ended.set()

    def wait_for(self, predicate: Callable[[list[pb.WatchEventsResponse]], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(list(self.messages)):
                return
            if self.ended.is_set():
                break
            time.sleep(0.02)
        if predicate(list(self.messages)):
            return
        state = "the stream ended" if self.ended.is_set() else f"waited {timeout:.0f}s"
        error = f" ({self.error.code().name}: {self.error.details()})" if self.error is not None else ""
        raise CaseFailed(f"WatchEvents: {what} not seen; {state}{error} after {len(self.messages)} messages")

    def wait_sequence(self, sequence: int, timeout: float = 20.0) -> None:
        """Until a message at or past `sequence` arrived (event or heartbeat)."""
        self.wait_for(lambda ms: any(m.sequence >= sequence for m in ms), timeout, f"a message with sequence >= {sequence}")

    def wait_ended(self, timeout: float = 10.0) -> bool:
        return self.ended.wait(timeout)

    def stop(self) -> list[pb.WatchEventsResponse]:
        self._stopping = True
        self.call.cancel()
        self.ended.wait(5)
        return list(self.messages)

    def events(self) -> list[pb.WatchEventsResponse]:
        return [m for m in self.messages if m.WhichOneof("payload") not in CONTROL]


def kind(message: pb.WatchEventsResponse) -> str:
    return message.WhichOneof("payload") or "<none>"
