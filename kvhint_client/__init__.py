"""kvhint_client: the typed Python client for kvhint.v1 (session-aware KV-cache control).

Modules:
    config     ConnectionConfig, TlsConfig, RetryPolicy
    errors     KvHintError (the one error type)
    builders   session() / continuation() / blocks() -> Target -> .pin() .retain() ... -> Hint
    client     KvHintClient (blocking), AsyncKvHintClient (grpc.aio)
    results    ApplyResult, Residency, HealthReport
    follower   EventFollower / AsyncEventFollower keeping a ResidencyIndex from WatchEvents
    fleet      FleetClient: route hints to the engines holding a session
    envelope   vLLM KvHintsEnvelope <-> Hints
    proto_json JSON view of messages (bytes as hex)
    cli        the `kvhint` command line

Generated messages: `from kvhint.v1 import kvhint_pb2`.
"""

from .builders import Target, blocks, continuation, event_filter, session
from .client import AsyncKvHintClient, AsyncWatchStream, KvHintClient, WatchStream
from .config import ConnectionConfig, RetryPolicy, TlsConfig
from .errors import KvHintError
from .results import ApplyResult, HealthReport, Residency

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
