"""Helpers for event-stream tests: a background WatchEvents collector and a
subscriber for vLLM's own ZMQ KV-event publisher."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc

from kvhint.v1 import kvhint_pb2 as pb
from kvhint.v1 import kvhint_pb2_grpc as pbg


class Collector:
    """Reads a WatchEvents stream on a thread until stopped or the stream ends."""

    def __init__(self, address: str, request: pb.WatchEventsRequest) -> None:
        self.channel = grpc.insecure_channel(address)
        self.call = pbg.KvHintServiceStub(self.channel).WatchEvents(request)
        self.messages: list[pb.WatchEventsResponse] = []
        self.error: grpc.RpcError | None = None
        self.ended = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for msg in self.call:
                self.messages.append(msg)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.CANCELLED:
                self.error = err
        finally:
            self.ended.set()

    def wait_for(self, predicate: Callable[[list[pb.WatchEventsResponse]], bool], timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self.messages):
                return
            if self.ended.is_set():
                break
            time.sleep(0.02)
        assert predicate(self.messages), f"condition not met; {len(self.messages)} messages, ended={self.ended.is_set()}"

    def wait_sequence(self, sequence: int, timeout: float = 20.0) -> None:
        """Until an event or heartbeat at or past `sequence` arrived."""
        self.wait_for(lambda ms: any(m.sequence >= sequence for m in ms), timeout)

    def stop(self) -> list[pb.WatchEventsResponse]:
        self.call.cancel()
        self.ended.wait(5)
        self.channel.close()
        return self.messages

    def events(self) -> list[pb.WatchEventsResponse]:
        control = {"heartbeat", "snapshot_begin", "snapshot_chunk", "snapshot_end", "resync"}
        return [m for m in self.messages if m.WhichOneof("payload") not in control]


def latest_sequence(stub: pbg.KvHintServiceStub) -> int:
    """The current sequence, read through a no-op ApplyHints (a MISSING release)."""
    response = stub.ApplyHints(
        pb.ApplyHintsRequest(
            hints=[pb.Hint(selector=pb.Selector(session=pb.SessionSelector(session_id="__probe__")), release=pb.ReleaseAction())]
        )
    )
    return response.applied_at_sequence


def block_hash_int(h: bytes) -> int:
    return int.from_bytes(h, "big")


class ZmqKvEvents:
    """Subscriber for vLLM's ZMQ KV events, collecting batches on a thread.

    Bind it before the engine starts: with a concrete host in the endpoint,
    vLLM's PUB socket connects to us, and a subscriber bound later may miss
    the first batches.
    """

    def __init__(self, endpoint: str, topic: str = "kv") -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.bind(endpoint)
        self.batches: list[object] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            if self._sub.poll(50, zmq.POLLIN):
                _topic, _seq, payload = self._sub.recv_multipart()
                self.batches.append(self._decoder.decode(payload))

    def events_since(self, mark: int) -> list[object]:
        return [e for b in self.batches[mark:] for e in b.events]  # type: ignore[attr-defined]

    def settle(self, quiet_s: float = 1.0, timeout: float = 30.0) -> None:
        """Wait until no batch arrived for `quiet_s`."""
        deadline = time.monotonic() + timeout
        count, since = len(self.batches), time.monotonic()
        while time.monotonic() < deadline and time.monotonic() - since < quiet_s:
            time.sleep(0.05)
            if len(self.batches) != count:
                count, since = len(self.batches), time.monotonic()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sub.close(0)
        self._ctx.term()
