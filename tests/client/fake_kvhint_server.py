"""An in-process fake kvhint.v1 server for the client tests (engine-neutral: no vLLM).

FakeKvHint implements KvHintServiceServicer with scriptable behaviour:
- `fail_next[method]`: status codes to abort the next calls of a method with (consumed in order);
  `apply_then_fail`: apply the batch, then abort with this code once (a reply lost after the
  server acted), to test that retries replay through hint ids;
- `abort[method] = (code, message, reason, metadata)`: every call aborts, with an ErrorInfo;
- `delay[method]`: seconds to sleep before answering (deadline tests);
- ApplyHints remembers hint ids and replays their first result with `replayed=True`;
  `outcome_for(hint)` decides each result (default ACCEPTED);
- QueryResidency / ListSessions page through `blocks` / `sessions` with opaque tokens;
- GetOperation walks `operations[id]` (a list of states, the last one repeats);
- WatchEvents plays `watch_scripts` (one list per call, in order): each item is a
  WatchEventsResponse to send, `("abort", code)`, or HANG (block until the client cancels);
  with no script left the call hangs. Every request is recorded in `watch_requests`.
Every call's invocation metadata is recorded in `metadata_seen`.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Callable, Optional

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from kvhint.v1 import kvhint_pb2, kvhint_pb2_grpc

HANG = "hang"
SERVICE = "kvhint.v1.KvHintService"


def abort_with_error_info(context: grpc.ServicerContext, code: grpc.StatusCode, message: str,
                          reason: str = "", metadata: Optional[dict[str, str]] = None) -> None:
    status = status_pb2.Status(code=code.value[0], message=message)
    if reason:
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.ErrorInfo(reason=reason, domain="kvhint.v1", metadata=metadata or {}))
        status.details.append(detail)
    context.abort_with_status(rpc_status.to_status(status))


def accepted(hint: kvhint_pb2.Hint) -> kvhint_pb2.HintResult:
    return kvhint_pb2.HintResult(
        hint_id=hint.hint_id,
        outcome=kvhint_pb2.OUTCOME_ACCEPTED,
        affected_blocks=[kvhint_pb2.TierBlockCount(tier=kvhint_pb2.TIER_DEVICE, blocks=2)],
    )


class FakeKvHint(kvhint_pb2_grpc.KvHintServiceServicer):
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: dict[str, int] = {}
        self.fail_next: dict[str, list[grpc.StatusCode]] = {}
        self.apply_then_fail: Optional[grpc.StatusCode] = None
        self.abort: dict[str, tuple[grpc.StatusCode, str, str, dict[str, str]]] = {}
        self.delay: dict[str, float] = {}
        self.metadata_seen: list[dict[str, str]] = []
        self.outcome_for: Callable[[kvhint_pb2.Hint], kvhint_pb2.HintResult] = accepted
        self.applied: list[kvhint_pb2.Hint] = []
        self.results_by_id: dict[str, kvhint_pb2.HintResult] = {}
        self.epoch = "E1"
        self.sequence = 100
        self.blocks: list[kvhint_pb2.BlockInfo] = []
        self.sessions: list[kvhint_pb2.SessionInfo] = []
        self.operations: dict[str, list[int]] = {}
        self.watch_scripts: list[list[Any]] = []
        self.watch_requests: list[kvhint_pb2.WatchEventsRequest] = []
        self.capabilities = kvhint_pb2.GetCapabilitiesResponse(
            protocol_version="kvhint.v1", engine="fake", engine_version="0.0", block_size=16,
            num_device_blocks=128, block_hash_encoding="sha256", epoch="E1", event_replay_window=1000,
            actions=[kvhint_pb2.ActionSupport(action=kvhint_pb2.ACTION_PIN, supported=True,
                                              selectors=[kvhint_pb2.SELECTOR_KIND_SESSION], supports_range=True)],
            tiers=[kvhint_pb2.TierInfo(tier=kvhint_pb2.TIER_DEVICE, medium="GPU", capacity_blocks=128)],
        )
        self._closing = threading.Event()

    # -- plumbing ----------------------------------------------------------------------------------

    def _enter(self, method: str, context: grpc.ServicerContext) -> None:
        with self.lock:
            self.calls[method] = self.calls.get(method, 0) + 1
            self.metadata_seen.append({k: v for k, v in context.invocation_metadata()})
            pending = self.fail_next.get(method)
            code = pending.pop(0) if pending else None
        if method in self.delay:
            time.sleep(self.delay[method])
        if code is not None:
            context.abort(code, f"injected {code.name}")
        if method in self.abort:
            code, message, reason, metadata = self.abort[method]
            abort_with_error_info(context, code, message, reason, metadata)

    def count(self, method: str) -> int:
        with self.lock:
            return self.calls.get(method, 0)

    def close(self) -> None:
        self._closing.set()

    # -- RPCs ----------------------------------------------------------------------------------------

    def GetCapabilities(self, request, context):
        self._enter("GetCapabilities", context)
        return self.capabilities

    def ApplyHints(self, request, context):
        self._enter("ApplyHints", context)
        results = []
        with self.lock:
            for hint in request.hints:
                if hint.hint_id and hint.hint_id in self.results_by_id:
                    replay = kvhint_pb2.HintResult()
                    replay.CopyFrom(self.results_by_id[hint.hint_id])
                    replay.replayed = True
                    results.append(replay)
                    continue
                result = self.outcome_for(hint)
                self.applied.append(hint)
                if hint.hint_id:
                    self.results_by_id[hint.hint_id] = result
                results.append(result)
            self.sequence += 1
            fail, self.apply_then_fail = self.apply_then_fail, None
        if fail is not None:
            context.abort(fail, "reply lost")
        return kvhint_pb2.ApplyHintsResponse(results=results, epoch=self.epoch, applied_at_sequence=self.sequence)

    def QueryResidency(self, request, context):
        self._enter("QueryResidency", context)
        size = request.page_size or 256
        start = int(request.page_token or 0)
        page = self.blocks[start:start + size]
        totals: dict[int, int] = {}
        for block in self.blocks:
            for tier in block.tiers:
                totals[tier] = totals.get(tier, 0) + 1
        token = str(start + size) if start + size < len(self.blocks) else ""
        return kvhint_pb2.QueryResidencyResponse(
            blocks=page, next_page_token=token, as_of_epoch=self.epoch, as_of_sequence=self.sequence,
            totals=[kvhint_pb2.TierBlockCount(tier=t, blocks=n) for t, n in sorted(totals.items())],
        )

    def ListSessions(self, request, context):
        self._enter("ListSessions", context)
        matching = sorted((s for s in self.sessions if s.session_id.startswith(request.session_id_prefix)),
                          key=lambda s: s.session_id)
        size = request.page_size or 256
        start = int(request.page_token or 0)
        token = str(start + size) if start + size < len(matching) else ""
        return kvhint_pb2.ListSessionsResponse(sessions=matching[start:start + size], next_page_token=token,
                                               as_of_epoch=self.epoch, as_of_sequence=self.sequence)

    def GetOperation(self, request, context):
        self._enter("GetOperation", context)
        with self.lock:
            states = self.operations.get(request.operation_id)
            if states is None:
                context.abort(grpc.StatusCode.NOT_FOUND, f"unknown operation {request.operation_id}")
            state = states.pop(0) if len(states) > 1 else states[0]
        return kvhint_pb2.GetOperationResponse(operation=kvhint_pb2.Operation(
            operation_id=request.operation_id, state=state, action=kvhint_pb2.ACTION_DEMOTE))

    def WatchEvents(self, request, context):
        self._enter("WatchEvents", context)
        with self.lock:
            self.watch_requests.append(request)
            script = self.watch_scripts.pop(0) if self.watch_scripts else [HANG]
        for item in script:
            if isinstance(item, kvhint_pb2.WatchEventsResponse):
                yield item
            elif item == HANG:
                while context.is_active() and not self._closing.is_set():
                    time.sleep(0.02)
                return
            elif isinstance(item, tuple) and item[0] == "abort":
                context.abort(item[1], "injected stream failure")


@dataclass
class RunningServer:
    server: grpc.Server
    servicer: FakeKvHint
    health: health.HealthServicer
    address: str

    def stop(self) -> None:
        self.servicer.close()
        self.server.stop(grace=None).wait()


def start_fake_server(servicer: Optional[FakeKvHint] = None, port: int = 0) -> RunningServer:
    servicer = servicer or FakeKvHint()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    kvhint_pb2_grpc.add_KvHintServiceServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    if bound == 0:
        raise RuntimeError(f"could not bind 127.0.0.1:{port}")
    server.start()
    return RunningServer(server, servicer, health_servicer, f"127.0.0.1:{bound}")


# -- event construction helpers -----------------------------------------------------------------------


def h(n: int) -> bytes:
    """A readable 8-byte block hash."""
    return n.to_bytes(8, "big")


def ev(epoch: str, seq: int, **payload: Any) -> kvhint_pb2.WatchEventsResponse:
    return kvhint_pb2.WatchEventsResponse(epoch=epoch, sequence=seq, **payload)


def stored(epoch: str, seq: int, hashes: list[int], session: str = "", tier: int = kvhint_pb2.TIER_DEVICE,
           members: tuple[str, ...] = (), prefix_hit: bool = False) -> kvhint_pb2.WatchEventsResponse:
    return ev(epoch, seq, blocks_stored=kvhint_pb2.BlocksStored(
        tier=tier, block_hashes=[h(x) for x in hashes], prefix_hit=prefix_hit,
        coordinates=kvhint_pb2.SessionCoordinates(session_id=session, member_session_ids=[session, *members] if session else list(members))))


def removed(epoch: str, seq: int, hashes: list[int], tier: int = kvhint_pb2.TIER_DEVICE) -> kvhint_pb2.WatchEventsResponse:
    return ev(epoch, seq, blocks_removed=kvhint_pb2.BlocksRemoved(tier=tier, block_hashes=[h(x) for x in hashes]))


def snapshot(epoch: str, seq: int, sessions: dict[str, list[tuple[int, list[int]]]]) -> list[kvhint_pb2.WatchEventsResponse]:
    """SnapshotBegin, one chunk per session {session: [(hash, [tiers])]}, SnapshotEnd at `seq`."""
    out = [ev(epoch, seq, snapshot_begin=kvhint_pb2.SnapshotBegin(num_sessions=len(sessions)))]
    for session_id, entries in sessions.items():
        out.append(ev(epoch, seq, snapshot_chunk=kvhint_pb2.SnapshotChunk(
            session_id=session_id,
            blocks=[kvhint_pb2.BlockInfo(block_hash=h(x), tiers=tiers, position=i) for i, (x, tiers) in enumerate(entries)])))
    out.append(ev(epoch, seq, snapshot_end=kvhint_pb2.SnapshotEnd()))
    return out


def heartbeat(epoch: str, seq: int) -> kvhint_pb2.WatchEventsResponse:
    return ev(epoch, seq, heartbeat=kvhint_pb2.Heartbeat())


def resync(epoch: str, seq: int, cause: int = kvhint_pb2.Resync.CAUSE_COMPACTED) -> kvhint_pb2.WatchEventsResponse:
    return ev(epoch, seq, resync=kvhint_pb2.Resync(cause=cause, current_epoch=epoch, message="history compacted"))


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Poll `predicate` until true or `timeout` seconds passed; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
