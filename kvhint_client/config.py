"""Connection settings for KvHintClient / AsyncKvHintClient (and the follower / fleet built on them).

Contracts:
- The bearer token travels as `authorization: Bearer <token>` call metadata (plaintext or TLS).
- `default_timeout` is the deadline of every unary call, spanning all its retry attempts; a
  per-call `timeout=` overrides it. `None` means no deadline. Streams (WatchEvents) have no
  deadline unless one is passed to `watch()`. Every timeout (default_timeout, a per-call or
  stream `timeout=`, FleetClient.apply's, the CLI's --timeout) must be a number of seconds > 0
  and at most MAX_TIMEOUT_S (2**31 s, about 68 years): inf, nan and larger values raise
  ValueError naming the argument (gRPC would otherwise fail such a call DEADLINE_EXCEEDED
  without sending it). For no deadline, use `default_timeout=None`.
- RetryPolicy retries ONLY on UNAVAILABLE (the request never reached a servicer or the
  connection broke). DEADLINE_EXCEEDED, INVALID_ARGUMENT and every other code surface at once.
  ApplyHints retries are idempotent because the client gives every hint without a `hint_id` a
  uuid4 id before the first attempt (server contract: a repeated id returns the first result,
  `replayed=true`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import grpc

DEFAULT_ADDRESS = "127.0.0.1:50151"
#: Environment variable read by `ConnectionConfig.from_env()` and the CLI.
ADDRESS_ENV = "KVHINT_ADDRESS"
TOKEN_ENV = "KVHINT_TOKEN"

PemSource = Union[bytes, str, Path]

#: Channel options every client channel gets unless `channel_options` sets the same key.
#: gRPC's defaults (first reconnect after 1 s, growing 1.6x to 120 s) leave a channel that
#: watched a server go away tens of seconds behind once it is back; with these, a channel
#: retries the connection at least every ~0.5 s (+-20% jitter), so a client or follower sees
#: a restarted engine within about a second of it answering SERVING.
#: `grpc.min_reconnect_backoff_ms` stays at its default: gRPC uses it as the shortest time one
#: connection attempt may take (20 s), and lowering it would abort slow TLS handshakes.
RECONNECT_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
)


#: The longest timeout a call takes, in seconds (2**31 s, about 68 years). gRPC keeps a deadline
#: as int64 nanoseconds since the epoch: a timeout of a few billion seconds overflows it, and the
#: call fails DEADLINE_EXCEEDED without being sent.
MAX_TIMEOUT_S = float(2**31)


def check_timeout(value: float, name: str) -> float:
    """`value` as a float when it is a number of seconds in (0, MAX_TIMEOUT_S]; ValueError naming
    the argument `name` otherwise (inf and nan included)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(
            f"{name} must be a finite number of seconds > 0 and at most {MAX_TIMEOUT_S:.0f} (about 68 years), got {value!r}"
        )
    return float(value)


def _read_pem(source: Optional[PemSource]) -> Optional[bytes]:
    """PEM bytes as given, or read from a path (str or Path)."""
    if source is None or isinstance(source, bytes):
        return source
    return Path(source).read_bytes()


@dataclass(frozen=True)
class TlsConfig:
    """TLS for the channel. PEM values are bytes, or paths to read them from.

    root_certificates: CA bundle to verify the server (None: the system roots).
    certificate_chain / private_key: client certificate for mutual TLS (both or neither).
    server_name_override: the name to verify the server certificate against (the
        `grpc.ssl_target_name_override` channel option), for addressing by IP.
    """

    root_certificates: Optional[PemSource] = None
    certificate_chain: Optional[PemSource] = None
    private_key: Optional[PemSource] = None
    server_name_override: Optional[str] = None

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("TLS client authentication needs both certificate_chain and private_key")

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read_pem(self.root_certificates),
            private_key=_read_pem(self.private_key),
            certificate_chain=_read_pem(self.certificate_chain),
        )

    def channel_options(self) -> list[tuple[str, str]]:
        if self.server_name_override:
            return [("grpc.ssl_target_name_override", self.server_name_override)]
        return []


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter, for UNAVAILABLE only.

    Attempt n (1-based) that fails with UNAVAILABLE is followed by a sleep of
    min(max_backoff, initial_backoff * multiplier**(n-1)) scaled by a random factor in
    [1 - jitter, 1 + jitter], unless n == max_attempts or the call's deadline would pass.

    With `retry_resource_exhausted`, a RESOURCE_EXHAUSTED failure that carries a
    google.rpc.RetryInfo (server overload: nothing was applied) is retried after exactly that
    delay, within the same max_attempts and deadline, and only if the delay is at most
    `max_retry_after` seconds.
    """

    max_attempts: int = 4
    initial_backoff: float = 0.1
    max_backoff: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2
    retry_resource_exhausted: bool = False
    max_retry_after: float = 10.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if self.initial_backoff < 0 or self.max_backoff < 0:
            raise ValueError("backoff must be >= 0")
        if self.multiplier < 1:
            raise ValueError("multiplier must be >= 1")
        if not 0 <= self.jitter <= 1:
            raise ValueError("jitter must be in [0, 1]")
        if self.max_retry_after < 0:
            raise ValueError("max_retry_after must be >= 0")

    @classmethod
    def disabled(cls) -> "RetryPolicy":
        """One attempt, no retries."""
        return cls(max_attempts=1)

    def backoff(self, failed_attempt: int, rng: Optional[random.Random] = None) -> float:
        """Seconds to sleep after the `failed_attempt`-th attempt (1-based) failed. Any count: a
        follower passes its count of failed reconnects, which grows for as long as an engine is
        down (the growth is capped at `max_backoff` before it can overflow a float)."""
        try:
            grown = self.initial_backoff * float(self.multiplier) ** max(0, failed_attempt - 1)
        except OverflowError:  # multiplier ** n past the float range: long past the cap
            grown = math.inf if self.initial_backoff > 0 else 0.0
        base = min(self.max_backoff, grown)
        if self.jitter:
            base *= 1 + (rng or random).uniform(-self.jitter, self.jitter)
        return max(0.0, base)

    @staticmethod
    def retryable(code: grpc.StatusCode) -> bool:
        """True only for UNAVAILABLE."""
        return bool(code == grpc.StatusCode.UNAVAILABLE)


# gRPC target schemes passed through as they are (gRPC's naming doc): the address is the resolver's.
TARGET_SCHEMES = ("dns", "unix", "unix-abstract", "ipv4", "ipv6", "vsock", "xds", "google-c2p")
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.%a-zA-Z]+\]|[^:\[\]/\s]+):([0-9]+)")
_SCHEME = re.compile(r"([a-z][a-z0-9+.-]*):")


def check_address(address: str) -> None:
    """Raise ValueError unless `address` names a server a channel can reach: HOST:PORT with a
    port in 1..65535 (an IPv6 host in brackets, `[::1]:50151`), or a gRPC target with one of
    TARGET_SCHEMES (`unix:/path`, `dns:///host:port`, ...), passed through as it is. gRPC itself
    takes `127.0.0.1:99999` as port 34463 (99999 - 65536), a URL as a host name, and a host
    without a port as port 443, and then retries the wrong target for ever; so a client refuses
    them here, before it connects anywhere."""
    if not address:
        raise ValueError("address must not be empty")
    scheme = _SCHEME.match(address)
    if scheme is not None and scheme.group(1) in TARGET_SCHEMES and not _HOST_PORT.fullmatch(address):
        return
    if "://" in address:
        raise ValueError(f"address {address!r}: a gRPC address is HOST:PORT (or a gRPC target such as "
                         "unix:/path), not a URL")
    m = _HOST_PORT.fullmatch(address)
    if m is None:
        raise ValueError(f"address {address!r}: expected HOST:PORT (IPv6 as [ADDR]:PORT), or a gRPC target "
                         f"with a scheme ({', '.join(s + ':' for s in TARGET_SCHEMES[:3])} ...)")
    port = int(m.group(2))
    if not 1 <= port <= 65535:
        raise ValueError(f"address {address!r}: the port must be in 1..65535")


@dataclass(frozen=True)
class ConnectionConfig:
    """Where and how to reach one KvHint server.

    address: "host:port", port 1..65535 ("[::1]:port" for IPv6), or a gRPC target with a scheme
        ("unix:/path", "dns:///host:port"; TARGET_SCHEMES); anything else raises ValueError
        (`check_address`).
    tls: None for a plaintext channel.
    bearer_token: sent as `authorization: Bearer <token>` on every call.
    default_timeout: seconds per unary call (across retries), at most MAX_TIMEOUT_S; None for no
        deadline.
    retry: the UNAVAILABLE retry policy of unary calls.
    metadata: extra call metadata sent on every call.
    channel_options: extra gRPC channel options; they win over RECONNECT_CHANNEL_OPTIONS.
    """

    address: str = DEFAULT_ADDRESS
    tls: Optional[TlsConfig] = None
    bearer_token: Optional[str] = None
    default_timeout: Optional[float] = 10.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    metadata: tuple[tuple[str, str], ...] = ()
    channel_options: tuple[tuple[str, Union[str, int]], ...] = ()

    def __post_init__(self) -> None:
        check_address(self.address)
        if self.default_timeout is not None:
            check_timeout(self.default_timeout, "default_timeout")

    @classmethod
    def from_env(cls, **overrides: object) -> "ConnectionConfig":
        """Config from KVHINT_ADDRESS / KVHINT_TOKEN, with keyword overrides."""
        values: dict[str, object] = {"address": os.environ.get(ADDRESS_ENV, DEFAULT_ADDRESS)}
        token = os.environ.get(TOKEN_ENV)
        if token:
            values["bearer_token"] = token
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]

    def replace(self, **changes: object) -> "ConnectionConfig":
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata sent on every call: the bearer token, then `metadata`."""
        items = list(self.metadata)
        if self.bearer_token:
            items.insert(0, ("authorization", f"Bearer {self.bearer_token}"))
        return tuple(items)

    def all_channel_options(self) -> list[tuple[str, Union[str, int]]]:
        options: list[tuple[str, Union[str, int]]] = list(self.channel_options)
        given = {key for key, _ in options}
        options.extend(option for option in RECONNECT_CHANNEL_OPTIONS if option[0] not in given)
        if self.tls is not None:
            options.extend(self.tls.channel_options())
        return options


ConfigLike = Union[ConnectionConfig, str]


def as_config(config: ConfigLike) -> ConnectionConfig:
    """A ConnectionConfig, or an address string turned into one with default settings."""
    if isinstance(config, ConnectionConfig):
        return config
    return ConnectionConfig(address=config)
