"""The client's one error type.

Every failed call surfaces as KvHintError carrying the gRPC status code and, when the server
attached a `google.rpc.Status` (trailer `grpc-status-details-bin`), the `google.rpc.ErrorInfo`
reason / domain / metadata. Server contract (kvhint.v1): a malformed request fails with
INVALID_ARGUMENT and ErrorInfo(reason=<kvhint.v1.Reason name, e.g. "REASON_MALFORMED_REQUEST">,
domain="kvhint.v1", metadata={"field": "<path>"}); an unknown operation id is NOT_FOUND.
Client-side problems the server never saw (a wait that timed out) use the same type with the
matching code. Programming errors in arguments (an empty session id) are ValueError instead.
Overload is RESOURCE_EXHAUSTED with ErrorInfo metadata {"cause": "queue_full" | "rate_limited"}
and a google.rpc.RetryInfo: `retry_after` gives its delay in seconds (None without one), and
`is_overloaded` tells the case apart. Nothing of a refused call was applied, so retrying it
(same hint ids) is safe; RetryPolicy(retry_resource_exhausted=True) does so automatically.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Optional

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

STATUS_DETAILS_KEY = "grpc-status-details-bin"


class KvHintError(Exception):
    """A failed kvhint.v1 call.

    Attributes:
        code: the gRPC status code.
        details: the status message from the server (or the client's own description).
        reason: ErrorInfo.reason, e.g. "REASON_TOO_MANY_HINTS"; None without ErrorInfo.
        domain: ErrorInfo.domain, e.g. "kvhint.v1"; None without ErrorInfo.
        metadata: ErrorInfo.metadata (e.g. {"field": "hints[3].selector"}); empty without it.
        method: the RPC that failed ("ApplyHints"), when known.
        address: the server address, when known.
        status_details: every detail of the google.rpc.Status (packed Any messages).
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        *,
        reason: Optional[str] = None,
        domain: Optional[str] = None,
        metadata: Optional[Mapping[str, str]] = None,
        method: Optional[str] = None,
        address: Optional[str] = None,
        status_details: Iterable[any_pb2.Any] = (),
    ) -> None:
        self.code = code
        self.details = details
        self.reason = reason
        self.domain = domain
        self.metadata: dict[str, str] = dict(metadata or {})
        self.method = method
        self.address = address
        self.status_details: list[any_pb2.Any] = list(status_details)
        super().__init__(self._describe())

    @property
    def field(self) -> Optional[str]:
        """ErrorInfo.metadata["field"]: the request field at fault, if the server named one."""
        return self.metadata.get("field")

    @property
    def is_overloaded(self) -> bool:
        """The server refused the call for overload (rate limit or full queue); nothing applied."""
        return self.code == grpc.StatusCode.RESOURCE_EXHAUSTED

    @property
    def retry_after(self) -> Optional[float]:
        """google.rpc.RetryInfo.retry_delay in seconds: when a retry can succeed (None: no RetryInfo)."""
        for detail in self.status_details:
            if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                info = error_details_pb2.RetryInfo()
                detail.Unpack(info)
                return float(info.retry_delay.ToNanoseconds()) / 1e9
        return None

    @property
    def is_unavailable(self) -> bool:
        """The server could not be reached or did not answer in time."""
        return self.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

    def _describe(self) -> str:
        text = f"{self.code.name}: {self.details}" if self.details else self.code.name
        extras = []
        if self.reason:
            extras.append(f"reason={self.reason}")
        if self.field:
            extras.append(f"field={self.field}")
        if extras:
            text += f" [{' '.join(extras)}]"
        return text

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only fields do not survive the default Exception pickling.
        return (
            _rebuild,
            (self.code, self.details, self.reason, self.domain, self.metadata, self.method, self.address,
             tuple((d.type_url, d.value) for d in self.status_details)),
        )

    def __repr__(self) -> str:
        return (
            f"KvHintError(code={self.code.name}, details={self.details!r}, reason={self.reason!r}, "
            f"metadata={self.metadata!r}, method={self.method!r})"
        )

    @classmethod
    def from_rpc_error(
        cls, error: grpc.RpcError, *, method: Optional[str] = None, address: Optional[str] = None
    ) -> "KvHintError":
        """Build from a sync `grpc.RpcError` or a `grpc.aio.AioRpcError` (both are Calls)."""
        code = _call_attr(error, "code") or grpc.StatusCode.UNKNOWN
        details = _call_attr(error, "details") or ""
        status = _rich_status(error)
        reason = domain = None
        metadata: dict[str, str] = {}
        status_details: list[any_pb2.Any] = []
        if status is not None:
            status_details = list(status.details)
            info = error_info_of(status)
            if info is not None:
                reason, domain, metadata = info.reason, info.domain, dict(info.metadata)
        return cls(
            code,
            details,
            reason=reason,
            domain=domain,
            metadata=metadata,
            method=method,
            address=address,
            status_details=status_details,
        )


def _rebuild(
    code: grpc.StatusCode, details: str, reason: Optional[str], domain: Optional[str],
    metadata: dict[str, str], method: Optional[str], address: Optional[str],
    status_details: tuple[tuple[str, bytes], ...] = (),
) -> KvHintError:
    return KvHintError(code, details, reason=reason, domain=domain, metadata=metadata, method=method, address=address,
                       status_details=[any_pb2.Any(type_url=url, value=value) for url, value in status_details])


def _rich_status(error: grpc.RpcError) -> Optional[status_pb2.Status]:
    try:
        status: Optional[status_pb2.Status] = rpc_status.from_call(error)
        return status
    except Exception:  # code/message mismatch, or not a Call: read the trailer ourselves
        return parse_status_details(_call_attr(error, "trailing_metadata") or ())


def _call_attr(error: Any, name: str) -> Any:
    attr = getattr(error, name, None)
    if attr is None:
        return None
    try:
        return attr()
    except Exception:  # a half-initialised call object; treat as absent
        return None


def parse_status_details(trailing_metadata: Iterable[tuple[str, Any]]) -> Optional[status_pb2.Status]:
    """The google.rpc.Status from the `grpc-status-details-bin` trailer, if present and parseable.

    Fallback for `grpc_status.rpc_status.from_call`, which rejects a status whose code or
    message differ from the call's; the ErrorInfo is still worth reporting then.
    """
    for key, value in trailing_metadata:
        if key == STATUS_DETAILS_KEY:
            try:
                return status_pb2.Status.FromString(bytes(value))
            except Exception:
                return None
    return None


def error_info_of(status: status_pb2.Status) -> Optional[error_details_pb2.ErrorInfo]:
    """The first google.rpc.ErrorInfo packed into `status.details`, if any."""
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info
    return None
