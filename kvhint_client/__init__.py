"""kvhint_client: the typed Python client for kvhint.v1 (session-aware KV-cache control).

Modules:
    config     ConnectionConfig, TlsConfig, RetryPolicy
    errors     KvHintError (the one error type)
    builders   session() / continuation() / blocks() -> Target -> .pin() .retain() ... -> Hint
    client     KvHintClient (blocking), AsyncKvHintClient (grpc.aio)
    results    ApplyResult, Residency, HealthReport
    follower   EventFollower / AsyncEventFollower keeping a ResidencyIndex from WatchEvents
    residency_index  ResidencyIndex alone (no grpc import: embed it in a router)
    follow_tracker   EngineTracker, the transport-free per-engine WatchEvents state machine
    fleet      FleetClient: route hints to the engines holding a session
    envelope   vLLM KvHintsEnvelope <-> Hints
    proto_json JSON view of messages (bytes as hex)
    cli        the `kvhint` command line

Generated messages: `from kvhint.v1 import kvhint_pb2`.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .builders import Target, blocks, continuation, event_filter, session
    from .client import AsyncKvHintClient, AsyncWatchStream, KvHintClient, WatchStream
    from .config import ConnectionConfig, RetryPolicy, TlsConfig
    from .errors import KvHintError
    from .results import ApplyResult, HealthReport, Residency

#: Name -> submodule. Loaded on first access (PEP 562), so that importing a transport-free module
#: (residency_index, follow_tracker, builders, names) does not import grpc.
_LAZY = {
    **dict.fromkeys(("Target", "blocks", "continuation", "event_filter", "session"), "builders"),
    **dict.fromkeys(("AsyncKvHintClient", "AsyncWatchStream", "KvHintClient", "WatchStream"), "client"),
    **dict.fromkeys(("ConnectionConfig", "RetryPolicy", "TlsConfig"), "config"),
    "KvHintError": "errors",
    **dict.fromkeys(("ApplyResult", "HealthReport", "Residency"), "results"),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "ApplyResult",
    "AsyncKvHintClient",
    "AsyncWatchStream",
    "ConnectionConfig",
    "HealthReport",
    "KvHintClient",
    "KvHintError",
    "Residency",
    "RetryPolicy",
    "Target",
    "TlsConfig",
    "WatchStream",
    "blocks",
    "continuation",
    "event_filter",
    "session",
]
