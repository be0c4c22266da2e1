"""The Share handshake's destination side, seen from the source engine.

Once the shared file tier holds every selected block, a worker thread asks the
destination's own KvHint endpoint to Prefetch those block hashes (hint id
`kvhint-share-<operation id>`, so a retried request is idempotent there) and
waits for that Prefetch operation with the typed client. The Share SUCCEEDS only
when the destination's Prefetch SUCCEEDED, i.e. the data is in its host tier.
The outcome is a `ShareOutcome`; the runtime completes the Share operation with
it on the engine thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_client import KvHintClient
from kvhint_client.config import ConnectionConfig
from kvhint_client.errors import KvHintError
from kvhint_server.model import Reason, parse_enum

# Reasons a destination's refusal keeps; anything else is OPERATION_FAILED.
_KEPT_REASONS = (Reason.RESOURCE_EXHAUSTED, Reason.UNSUPPORTED, Reason.SHUTTING_DOWN)


@dataclass(frozen=True)
class ShareOutcome:
    ok: bool
    reason: Reason = Reason.OPERATION_FAILED
    message: str = ""
    remote_bytes: int = 0
    remote_blocks: int = 0


class SharePeers:
    """One typed client per destination address, shared by the worker threads."""

    def __init__(self, token: str | None) -> None:
        self._token = token
        self._clients: dict[str, KvHintClient] = {}
        self._lock = threading.Lock()

    def client(self, address: str) -> KvHintClient:
        with self._lock:
            c = self._clients.get(address)
            if c is None:
                c = KvHintClient(ConnectionConfig(address, bearer_token=self._token or None, default_timeout=10.0))
                self._clients[address] = c
            return c

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()

    def prefetch_on(
        self,
        destination: str,
        address: str,
        operation_id: str,
        block_hashes: Sequence[bytes],
        deadline: float,
        closed: Callable[[], bool],
    ) -> ShareOutcome:
        """Worker thread: the destination's Prefetch of `block_hashes`, waited for
        until SUCCEEDED/FAILED, the monotonic `deadline`, or `closed()`."""
        def remaining() -> float:
            return deadline - time.monotonic()

        try:
            client = self.client(address)
            hint = pb.Hint(
                hint_id=f"kvhint-share-{operation_id}",
                selector=pb.Selector(block_hashes=pb.BlockHashSelector(block_hashes=list(block_hashes))),
                prefetch=pb.PrefetchAction(),
            )
            hint.prefetch.deadline.FromNanoseconds(int(max(remaining(), 0.1) * 1e9))
            r = client.apply(hint, timeout=max(min(remaining(), 10.0), 0.1))[0]
            if r.outcome in (pb.OUTCOME_ACCEPTED, pb.OUTCOME_CLIPPED) and not r.operation_id:
                return ShareOutcome(True, remote_blocks=len(block_hashes))  # already on its device tier
            if r.outcome == pb.OUTCOME_MISSING:
                return ShareOutcome(False, message=(
                    f"destination {destination} cannot see the shared blocks "
                    "(does it mount the same file tier with the same model and block size?)"))
            if r.outcome != pb.OUTCOME_DEFERRED:
                reason = parse_enum(Reason, r.reason, Reason.OPERATION_FAILED)
                return ShareOutcome(False, reason if reason in _KEPT_REASONS else Reason.OPERATION_FAILED,
                                    f"destination {destination} rejected the prefetch: {r.message}")
            return self._wait(client, destination, r.operation_id, remaining, closed, len(block_hashes))
        except Exception as exc:  # noqa: BLE001 - reported on the operation, never raised
            code = getattr(exc, "code", None)
            code = code() if callable(code) else code
            detail = code.name if isinstance(code, grpc.StatusCode) else f"{type(exc).__name__}: {exc}"
            reason = Reason.DEADLINE_EXCEEDED if "DEADLINE_EXCEEDED" in detail else Reason.OPERATION_FAILED
            return ShareOutcome(False, reason, f"destination {destination} ({address}) unreachable: {detail}")

    @staticmethod
    def _wait(client: KvHintClient, destination: str, operation_id: str, remaining: Callable[[], float],
              closed: Callable[[], bool], selected: int) -> ShareOutcome:
        while True:
            if closed():
                return ShareOutcome(False, Reason.SHUTTING_DOWN, "the engine is shutting down")
            left = remaining()
            if left <= 0:
                return ShareOutcome(False, Reason.DEADLINE_EXCEEDED, f"destination {destination} did not finish in time")
            try:
                # Short waits, so a shutdown is noticed within a second.
                got = client.wait_operation(operation_id, timeout=min(left, 1.0), poll_interval=0.02)
            except KvHintError as exc:
                if exc.code is grpc.StatusCode.DEADLINE_EXCEEDED:
                    continue
                raise
            if got.state == pb.Operation.STATE_SUCCEEDED:
                return ShareOutcome(True, remote_bytes=got.bytes_moved,
                                    remote_blocks=sum(c.blocks for c in got.blocks) or selected)
            reason = parse_enum(Reason, got.reason, Reason.OPERATION_FAILED)
            return ShareOutcome(False, reason, f"destination {destination}: {got.message or 'prefetch failed'}")
