"""Server configuration: bounds, limits and the listen address.

Every field can be set from the environment (`KVHINT_<FIELD>` upper-cased, for
example KVHINT_MAX_TTL_S=600), so the in-engine sidecar is configurable without
touching vLLM's own flags.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

DEFAULT_ADDRESS = "127.0.0.1:50151"


@dataclass(frozen=True)
class ServerConfig:
    # gRPC listen address (host:port). Port 0 picks a free port.
    address: str = DEFAULT_ADDRESS
    # TTLs above this are capped (CLIPPED/TTL_CAPPED).
    max_ttl_s: float = 3600.0
    # Pinned blocks at most, as a fraction of the device pool.
    pin_budget_fraction: float = 0.5
    # Hints per ApplyHints batch; more is INVALID_ARGUMENT.
    max_hints_per_batch: int = 256
    # Longest session_id / continuation_id / destination, in bytes.
    max_id_length: int = 256
    # Longest hint_id, in bytes.
    max_hint_id_length: int = 128
    # Block hashes per BlockHashSelector.
    max_block_hashes_per_selector: int = 4096
    # Largest page for paginated RPCs, and the default page.
    max_page_size: int = 1024
    default_page_size: int = 256
    # Hint ids remembered for idempotency.
    idempotency_window: int = 100_000
    # Events kept for WatchEvents resumption.
    event_replay_window: int = 10_000
    # Events a subscriber whose send is blocked may fall behind before it is
    # ended with a SUBSCRIBER_OVERFLOW resync; "blocked" means one send has
    # waited on gRPC flow control for subscriber_stall_s.
    subscriber_buffer: int = 4096
    subscriber_stall_s: float = 0.5
    # Default WatchEvents heartbeat period.
    heartbeat_interval_s: float = 1.0
    # How long an RPC waits for the engine thread before failing UNAVAILABLE.
    engine_task_timeout_s: float = 30.0
    # Blocks the SessionPrefixIndex tracks at most. Past it, the least recently
    # active sessions are forgotten (as if released) until 90% remain; this
    # bounds memory when a lower tier never evicts (a persistent file tier).
    max_index_blocks: int = 1_000_000
    # Operations (deferred work) remembered after completion.
    operation_history: int = 10_000
    # Graceful-shutdown grace period.
    shutdown_grace_s: float = 2.0
    # Serve TLS when both are set (PEM file paths).
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # When set, every RPC except health must carry `authorization: Bearer <token>`.
    auth_token: str = ""

    @classmethod
    def from_env(cls, **overrides: object) -> ServerConfig:
        """Defaults, then KVHINT_* environment variables, then `overrides`."""
        values: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            env = "KVHINT_GRPC_ADDRESS" if f.name == "address" else f"KVHINT_{f.name.upper()}"
            raw = os.environ.get(env)
            if raw is None:
                continue
            kind = type(f.default)
            try:
                values[f.name] = kind(raw)
            except ValueError as exc:
                raise ValueError(f"{env}={raw!r}: expected {kind.__name__}") from exc
        values.update(overrides)
        return dataclasses.replace(cls(), **values)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        if not 0.0 <= self.pin_budget_fraction <= 1.0:
            raise ValueError("pin_budget_fraction must be within [0, 1]")
        if self.max_ttl_s <= 0:
            raise ValueError("max_ttl_s must be positive")
        if self.subscriber_buffer > self.event_replay_window:
            object.__setattr__(self, "subscriber_buffer", self.event_replay_window)
        for name in ("max_hints_per_batch", "max_id_length", "max_hint_id_length", "event_replay_window",
                     "idempotency_window", "max_page_size", "default_page_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
