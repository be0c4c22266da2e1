"""Deferred operations (DEFERRED hints): state, completion and lookup.

An operation is created PENDING when a hint is DEFERRED. Whoever performs the
work moves it to RUNNING and finally completes it exactly once (SUCCEEDED or
FAILED); completion publishes an OperationCompleted event. The last `history`
operations to finish are remembered (those in flight neither count nor go).
Thread-safe.
"""

from __future__ import annotations

import enum
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field, replace

from .events import EventBus, OperationCompleted
from .model import Action, Reason, Tier


class OperationState(enum.IntEnum):
    PENDING = 1
    RUNNING = 2
    SUCCEEDED = 3
    FAILED = 4

    @property
    def done(self) -> bool:
        return self in (OperationState.SUCCEEDED, OperationState.FAILED)


@dataclass(frozen=True, slots=True)
class Operation:
    operation_id: str
    hint_id: str
    action: Action
    state: OperationState
    created_at: float
    sessions: tuple[str, ...] = ()
    reason: Reason = Reason.UNSPECIFIED
    message: str = ""
    completed_at: float | None = None
    blocks: dict[Tier, int] = field(default_factory=dict)
    bytes_moved: int = 0
    destination: str = ""
    # The tenant whose hint started it ("" without tenancy or from an admin): with tenancy, that
    # tenant alone may read it (GetOperation) and get its OperationCompleted event.
    scope: str = ""


class OperationRegistry:
    def __init__(self, bus: EventBus, history: int = 10_000) -> None:
        self._bus = bus
        self._history = history
        self._ops: dict[str, Operation] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()  # finished ids, oldest first
        self._lock = threading.Lock()

    def create(self, hint_id: str, action: Action, sessions: tuple[str, ...] = (), destination: str = "", scope: str = "") -> Operation:
        op = Operation(
            operation_id="op-" + uuid.uuid4().hex[:16],
            hint_id=hint_id,
            action=action,
            state=OperationState.PENDING,
            created_at=time.time(),
            sessions=sessions,
            destination=destination,
            scope=scope,
        )
        with self._lock:
            self._ops[op.operation_id] = op
        return op

    def discard(self, operation_id: str) -> None:
        """Forget an operation that never started (no event is published)."""
        with self._lock:
            op = self._ops.get(operation_id)
            if op is not None and not op.state.done:
                del self._ops[operation_id]

    def get(self, operation_id: str) -> Operation | None:
        with self._lock:
            return self._ops.get(operation_id)

    def running(self, operation_id: str) -> None:
        with self._lock:
            op = self._ops.get(operation_id)
            if op is not None and op.state is OperationState.PENDING:
                self._ops[operation_id] = replace(op, state=OperationState.RUNNING)

    def complete(
        self,
        operation_id: str,
        *,
        ok: bool,
        reason: Reason = Reason.UNSPECIFIED,
        message: str = "",
        blocks: dict[Tier, int] | None = None,
        bytes_moved: int = 0,
    ) -> Operation | None:
        """Finish an operation once; later calls are ignored (returns None)."""
        with self._lock:
            op = self._ops.get(operation_id)
            if op is None or op.state.done:
                return None
            op = replace(
                op,
                state=OperationState.SUCCEEDED if ok else OperationState.FAILED,
                reason=Reason.UNSPECIFIED if ok else (reason or Reason.OPERATION_FAILED),
                message=message,
                completed_at=time.time(),
                blocks=dict(blocks or {}),
                bytes_moved=bytes_moved,
            )
            self._ops[operation_id] = op
            self._finished[operation_id] = None
            self._trim()
        self._bus.publish(OperationCompleted(op), sessions=op.sessions)
        return op

    def pending(self) -> list[Operation]:
        with self._lock:
            return [op for op in self._ops.values() if not op.state.done]

    def _trim(self) -> None:
        """Forget the oldest finished operations past the history. Unfinished ones neither
        count nor go: the history is of finished operations (KVHINT_OPERATION_HISTORY), so
        operations in flight do not shorten it, and one that never finishes does not stop
        the others from going."""
        while len(self._finished) > self._history:
            op_id, _ = self._finished.popitem(last=False)
            del self._ops[op_id]
