"""RPC-level errors: a gRPC status plus a google.rpc.ErrorInfo detail.

Malformed requests fail the whole RPC with INVALID_ARGUMENT; the ErrorInfo
carries a kvhint.v1 Reason name (e.g. "REASON_MALFORMED_REQUEST"), domain
"kvhint.v1", and metadata {"field": <path of the offending field>}.
Overload (kvhint_server/overload.py) fails with RESOURCE_EXHAUSTED: ErrorInfo
reason REASON_RESOURCE_EXHAUSTED with metadata {"cause": "queue_full" |
"rate_limited"}, plus a google.rpc.RetryInfo (retry_delay) when a retry can
succeed.
"""

from __future__ import annotations

import math

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from .model import Reason

DOMAIN = "kvhint.v1"
#: Characters of client input an error message may quote (see `excerpt`).
EXCERPT_CHARS = 32

_CODE_OF = {
    grpc.StatusCode.INVALID_ARGUMENT: code_pb2.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND: code_pb2.NOT_FOUND,
    grpc.StatusCode.UNAVAILABLE: code_pb2.UNAVAILABLE,
    grpc.StatusCode.FAILED_PRECONDITION: code_pb2.FAILED_PRECONDITION,
    grpc.StatusCode.DEADLINE_EXCEEDED: code_pb2.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL: code_pb2.INTERNAL,
    grpc.StatusCode.PERMISSION_DENIED: code_pb2.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: code_pb2.RESOURCE_EXHAUSTED,
}


def excerpt(value: str | bytes, limit: int = EXCERPT_CHARS) -> str:
    """How an error message quotes client input: repr of at most `limit`
    characters, plus the full size when cut. Every message that names a
    client-supplied string goes through this, so an oversized id can never
    blow up an error (gRPC carries the message twice: grpc-message and
    grpc-status-details-bin, both under the metadata size limit)."""
    if len(value) <= limit:
        return repr(value)
    unit = "bytes" if isinstance(value, bytes) else "chars"
    return f"{value[:limit]!r}... ({len(value)} {unit})"


class RpcError(Exception):
    """Raised inside the servicer; converted to a gRPC status by the handler."""

    def __init__(
        self,
        code: grpc.StatusCode,
        reason: Reason,
        message: str,
        field: str = "",
        *,
        metadata: dict[str, str] | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.field = field
        self.metadata = dict(metadata or {})
        # Seconds after which a retry can succeed (google.rpc.RetryInfo); None: no RetryInfo.
        self.retry_after = retry_after

    def to_status(self) -> grpc.Status:
        info = error_details_pb2.ErrorInfo(reason=f"REASON_{self.reason.name}", domain=DOMAIN)
        info.metadata.update(self.metadata)
        if self.field:
            info.metadata["field"] = self.field
        detail = any_pb2.Any()
        detail.Pack(info)
        details = [detail]
        if self.retry_after is not None:
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(math.ceil(self.retry_after * 1e9))
            retry = any_pb2.Any()
            retry.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
            details.append(retry)
        status = status_pb2.Status(code=_CODE_OF[self.code], message=self.message, details=details)
        return rpc_status.to_status(status)


def invalid_argument(message: str, field: str, reason: Reason = Reason.MALFORMED_REQUEST) -> RpcError:
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, reason, message, field)


def not_found(message: str, field: str) -> RpcError:
    return RpcError(grpc.StatusCode.NOT_FOUND, Reason.NOT_FOUND, message, field)


def unavailable(reason: Reason, message: str) -> RpcError:
    """UNAVAILABLE (retryable) with the real cause: SHUTTING_DOWN when the engine
    stopped, DEADLINE_EXCEEDED when it did not reach a step boundary in time."""
    return RpcError(grpc.StatusCode.UNAVAILABLE, reason, message)


def resource_exhausted(message: str, cause: str, retry_after: float | None) -> RpcError:
    """Overload: RESOURCE_EXHAUSTED, ErrorInfo cause, RetryInfo when `retry_after` is finite."""
    finite = retry_after is not None and math.isfinite(retry_after)
    return RpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.RESOURCE_EXHAUSTED, message,
        metadata={"cause": cause}, retry_after=retry_after if finite else None,
    )
