"""Server configuration: bounds, limits, the listen address and its security.

Every field can be set from the environment (`KVHINT_<FIELD>` upper-cased, for
example KVHINT_MAX_TTL_S=600; the address is KVHINT_GRPC_ADDRESS), so the
in-engine sidecar is configurable without touching vLLM's own flags.

Contract: a ServerConfig that exists is valid. Construction checks every
field (numbers finite and in range, TLS certificate and key together, readable
and loadable as gRPC loads them, a parseable address, a header-safe token) and raises ConfigError
naming the environment variable of the offending field, whether the value
came from the environment or from code. `check_environment()` is the one
entry point the launcher and the scheduler call before vLLM loads anything.

Exposure rule: a listen address that is not loopback needs TLS or a bearer
token; KVHINT_ALLOW_INSECURE_REMOTE=1 lifts the refusal, and the server then
logs a warning at start.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import math
import os
import re
import ssl
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger("kvhint.config")

DEFAULT_ADDRESS = "127.0.0.1:50151"
ENV_PREFIX = "KVHINT_"
_ENV_OF = {"address": "KVHINT_GRPC_ADDRESS"}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
#: KVHINT_* variables read outside ServerConfig (not typos).
OTHER_VARIABLES = frozenset({
    "KVHINT_ADDRESS", "KVHINT_TOKEN",  # the client and CLI
    "KVHINT_SHARE_PEERS", "KVHINT_TIER_OP_TIMEOUT_S",  # engine_integration.tiers.settings
    "KVHINT_MODEL_CACHE", "KVHINT_GPU_MEMORY_UTILIZATION", "KVHINT_ENGINE_FORBIDDEN",  # tests, benchmarks, demo
    "KVHINT_ENFORCE_EAGER",  # engine_integration.served: test engines and gpu_check --cpu skip torch.compile
    "KVHINT_ENGINE_DTYPE",  # engine_integration.served: test engines and gpu_check --cpu serve float32
    "KVHINT_ENGINE_EXECUTOR",  # engine_integration.served: test engines and gpu_check --cpu run the model in EngineCore
    "KVHINT_ENGINE_CORE_START",  # engine_integration.launcher: test engines fork EngineCore instead of spawning it
    "KVHINT_TEST_ENGINE_STARTS",  # tests/shared_engines.py: how many engines the test fixtures start at once
    "KVHINT_BENCH_ENFORCE_EAGER",  # bench.step_overhead: both engines eager (scripts/gpu_bundle/run.sh)
    "KVHINT_GPU_BUNDLE_CACHE", "KVHINT_GPU_BUNDLE_STORE", "KVHINT_GPU_BUNDLE_PARTS",  # scripts/gpu_bundle/
    "KVHINT_GPU_BUNDLE_SMOKE", "KVHINT_GPU_BUNDLE_LIMIT_S",
    "KVHINT_GPU_CHECK_NOTE",  # scripts/gpu_check.py: a line for the results header (the bundle's run.sh sets it)
})


class ConfigError(ValueError):
    """A KvHint setting is invalid. The message names the environment variable."""


def env_name(field_name: str) -> str:
    """The environment variable of a ServerConfig field."""
    return _ENV_OF.get(field_name, ENV_PREFIX + field_name.upper())


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
    # Longest session_id / continuation_id / destination / operation_id /
    # WatchEvents epoch and filter id, in bytes.
    max_id_length: int = 256
    # Longest hint_id, in bytes.
    max_hint_id_length: int = 128
    # Block hashes per BlockHashSelector.
    max_block_hashes_per_selector: int = 4096
    # Block hashes over all of one ApplyHints batch's selectors: a batch's engine
    # work grows with them, and it runs as one engine-thread task.
    max_block_hashes_per_batch: int = 4096
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
    # active sessions, and continuations recorded longer ago than they were active,
    # are forgotten (as if released) until 90% remain; this bounds memory when a
    # lower tier never evicts (a persistent file tier).
    max_index_blocks: int = 1_000_000
    # Sessions the index tracks at most: past it the least recently active go (as
    # above) until 90% remain. Sessions that read a hot shared prefix stay members of
    # its blocks, which are rarely evicted, so the block bound alone does not bound them.
    max_index_sessions: int = 100_000
    # Continuation ids the index tracks at most: past it the oldest are forgotten
    # until 90% remain (a continuation whose blocks were evicted moves to its
    # nearest resident ancestor, often a shared prefix, and would stay there).
    max_index_continuations: int = 1_000_000
    # Operations (deferred work) remembered after completion.
    operation_history: int = 10_000
    # Graceful-shutdown grace period.
    shutdown_grace_s: float = 2.0
    # Serve TLS (PEM file paths; both or neither).
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # When set, every RPC except health must carry `authorization: Bearer <token>`.
    auth_token: str = ""
    # Serve a non-loopback address with neither TLS nor a token (refused
    # otherwise; a warning is logged at start when this is used).
    allow_insecure_remote: bool = False
    # Serve Prometheus /metrics on this HOST:PORT from the sidecar itself
    # (empty: only through vLLM's /metrics in multiprocess mode; see
    # kvhint_server/metrics.py). Data-parallel rank r uses port + r.
    metrics_address: str = ""
    # Tenants file (JSON; kvhint_server/tenancy.py): tenants with tokens or mTLS
    # client identities, session namespaces and budgets. Empty: no tenancy.
    tenants_file: str = ""
    # PEM bundle of CAs whose client certificates are accepted (mTLS); with
    # it, clients must present a certificate. Needs TLS.
    tls_client_ca_file: str = ""
    # Overload (kvhint_server/overload.py). Engine-thread tasks from RPCs that
    # may be queued at once; past it an RPC fails RESOURCE_EXHAUSTED with
    # RetryInfo, having changed nothing.
    max_pending_tasks: int = 1024
    # WatchEvents streams open at once (snapshots included), in all and, with
    # tenancy, per tenant (admins included); past either a new stream fails
    # RESOURCE_EXHAUSTED at once (kvhint_server/watch.py).
    max_watch_streams: int = 1024
    max_watch_streams_per_tenant: int = 64
    # Engine time per step for queued RPC tasks, in ms (at least one task per
    # step runs; the rest waits for the next step). 0: no budget.
    step_apply_budget_ms: float = 10.0
    # Per-principal token bucket: hints per second (ApplyHints costs one per
    # hint, QueryResidency/ListSessions/WatchEvents one per call) and burst
    # (0: one second's worth). 0 rate: unlimited.
    rate_limit_hints_per_s: float = 0.0
    rate_limit_burst: int = 0
    # Where the index and event bookkeeping of residency changes runs
    # (kvhint_server/journal.py): "inline" on the engine thread inside vLLM's
    # block-pool calls; "deferred" journaled there and settled by the
    # sidecar's settler thread (and before any hint, query or snapshot, so
    # those see every change); "auto" deferred where the engine thread waits
    # on a device while the settler runs (any platform but vLLM's CPU
    # platform, and async scheduling) and inline on the CPU platform's
    # synchronous scheduler. Deferred falls back to inline while lower tiers
    # are attached.
    residency_bookkeeping: str = "auto"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> ServerConfig:
        """Defaults, then KVHINT_* variables of `environ` (default os.environ),
        then `overrides`. Raises ConfigError naming the variable."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(env_name(f.name))
            if raw is not None:
                values[f.name] = _parse(f.name, type(f.default), raw)
        values.update(overrides)
        return dataclasses.replace(cls(), **values)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_field(f.name, getattr(self, f.name))
        # Derived caps: a default above its maximum means the maximum.
        if self.default_page_size > self.max_page_size:
            object.__setattr__(self, "default_page_size", self.max_page_size)
        if self.subscriber_buffer > self.event_replay_window:
            object.__setattr__(self, "subscriber_buffer", self.event_replay_window)
        _check_tls(self.tls_cert_file, self.tls_key_file)
        _check_tenancy(self)
        if self.rate_limit_burst and not self.rate_limit_hints_per_s:
            raise ConfigError(
                f"{env_name('rate_limit_burst')}={self.rate_limit_burst} needs {env_name('rate_limit_hints_per_s')} > 0 "
                "(without a rate nobody is limited and the burst would be ignored)"
            )
        if self.metrics_address and _same_listener(self.address, self.metrics_address):
            raise ConfigError(
                f"{env_name('metrics_address')}={self.metrics_address!r} is the gRPC listen address "
                f"({env_name('address')}={self.address!r}); give /metrics a port of its own"
            )
        if self.insecure_remote and not self.allow_insecure_remote:
            raise ConfigError(
                f"{env_name('address')}={self.address!r} is not a loopback address and neither TLS "
                f"({env_name('tls_cert_file')} + {env_name('tls_key_file')}) nor {env_name('auth_token')} is set: "
                f"anyone who can reach it could change the cache. Set one, or {env_name('allow_insecure_remote')}=1 "
                "to serve it unauthenticated anyway"
            )

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_file)

    @property
    def insecure_remote(self) -> bool:
        """Served beyond this host with neither TLS nor a token."""
        return not is_loopback(self.address) and not self.tls and not self.auth_token and not self.tenants_file

    @property
    def tenants(self):  # -> tenancy.Tenants | None
        """The validated tenants file (None without KVHINT_TENANTS_FILE)."""
        return self.__dict__.get("_tenants")


def is_loopback(address: str) -> bool:
    """Whether a gRPC listen address is reachable only from this host
    (loopback IPs, `localhost`, unix sockets). Wildcards and names are not."""
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _parse(name: str, kind: type, raw: str) -> object:
    """An environment string as the field's type; ConfigError naming the variable."""
    env = env_name(name)
    if kind is bool:
        if raw.strip().lower() in _TRUE:
            return True
        if raw.strip().lower() in _FALSE:
            return False
        raise ConfigError(f"{env}={raw!r}: expected 1/0, true/false, yes/no or on/off")
    try:
        return kind(raw.strip()) if kind in (int, float) else kind(raw)
    except ValueError:
        raise ConfigError(f"{env}={raw!r}: expected {'an integer' if kind is int else 'a number'}") from None


# Upper bounds every value must fit on the wire: counts go into uint32/int32
# fields (Limits), seconds into google.protobuf.Duration (+-10,000 years).
MAX_COUNT = 2**31 - 1
MAX_SECONDS = 315_576_000_000.0
# The shutdown grace is also a thread wait (KvHintServer.stop joins its thread for the grace
# + 10 s), and a longer one raises OverflowError at shutdown.
MAX_SHUTDOWN_GRACE_S = threading.TIMEOUT_MAX - 10.0
# (low, high, low inclusive) per numeric field; the default is "> 0" up to
# MAX_SECONDS for `*_s` fields and MAX_COUNT for the rest.
# A WatchEvents heartbeat period, the server's default or a subscriber's request (watch.py clamps
# a request to it): below 0.1 s heartbeats flood every stream and busy the sidecar's loop.
MIN_HEARTBEAT_S, MAX_HEARTBEAT_S = 0.1, 60.0
_RANGES: dict[str, tuple[float, float, bool]] = {
    "heartbeat_interval_s": (MIN_HEARTBEAT_S, MAX_HEARTBEAT_S, True),
    "pin_budget_fraction": (0.0, 1.0, True),
    "shutdown_grace_s": (0.0, MAX_SHUTDOWN_GRACE_S, True),
    "operation_history": (0.0, MAX_COUNT, True),
    "step_apply_budget_ms": (0.0, 3_600_000.0, True),
    "rate_limit_hints_per_s": (0.0, 1e9, True),
    "rate_limit_burst": (0.0, MAX_COUNT, True),
}
_SECRET = frozenset({"auth_token"})
BOOKKEEPING_MODES = ("auto", "inline", "deferred")


def resolve_bookkeeping(mode: str, async_scheduling: bool, device: bool) -> str:
    """The residency bookkeeping an engine runs for `mode` (ServerConfig.residency_bookkeeping):
    `auto` is deferred where the engine thread waits on a device each step, so the settler has
    a wait to fill (`device`: any platform but vLLM's CPU platform; or async scheduling), and
    inline on the CPU platform's synchronous scheduler; other modes are themselves. The one
    rule for KvHintScheduler and scripts/gpu_check.py (which checks what an engine ran)."""
    if mode != "auto":
        return mode
    return "deferred" if async_scheduling or device else "inline"


def _check_field(name: str, value: object) -> None:
    env = env_name(name)
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        shown = repr(value)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{env}={shown} must be a finite number")
        default = (0.0, MAX_SECONDS if name.endswith("_s") else MAX_COUNT, False)
        low, high, inclusive = _RANGES.get(name, default)
        if value < low or (value == low and not inclusive) or value > high:
            raise ConfigError(f"{env}={shown} must be {'>=' if inclusive else '>'} {low:g} and <= {high:g}")
    elif isinstance(value, str):
        if name == "address" or (name == "metrics_address" and value):
            _check_address(value, env, unix=name == "address")
        elif name == "residency_bookkeeping" and value not in BOOKKEEPING_MODES:
            raise ConfigError(f"{env}={value!r}: expected one of {', '.join(BOOKKEEPING_MODES)}")
        elif name in _SECRET and value and not (value.isascii() and value.isprintable() and " " not in value):
            raise ConfigError(f"{env} must be printable ASCII without spaces (it travels in an HTTP/2 header)")


_WILDCARDS = ("0.0.0.0", "::", "[::]", "")


def _same_listener(a: str, b: str) -> bool:
    """Two HOST:PORT listen addresses that would bind the same socket (the same non-zero port on
    the same host, or on a wildcard host)."""
    if a.startswith("unix") or b.startswith("unix"):
        return a == b
    host_a, _, port_a = a.rpartition(":")
    host_b, _, port_b = b.rpartition(":")
    if port_a != port_b or port_a in ("", "0"):
        return False
    return host_a == host_b or host_a in _WILDCARDS or host_b in _WILDCARDS


def _check_address(address: str, env: str, unix: bool = True) -> None:
    """HOST:PORT (a bracketed IPv6 host too), or with `unix` a gRPC unix socket address."""
    if address.startswith(("unix:", "unix-abstract:")):
        if unix:
            return
        raise ConfigError(f"{env}={address!r}: expected HOST:PORT (an HTTP endpoint; no unix socket)")
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{env}={address!r}: expected HOST:PORT with a port in 0..65535")


def _check_tls(cert: str, key: str) -> None:
    """KVHINT_TLS_CERT_FILE and KVHINT_TLS_KEY_FILE: both or neither; each a readable PEM file;
    together credentials gRPC can listen with, checked now with the stdlib `ssl` module rather
    than when gRPC binds the port after the model has loaded. As gRPC reads them: the first
    certificate of the file must parse (further chain certificates gRPC stops reading at the first
    that does not, so they are not checked), the key must parse with no passphrase (gRPC gives an
    empty one) and be that certificate's. Messages name the variables and paths, never key material."""
    cert_env, key_env = env_name("tls_cert_file"), env_name("tls_key_file")
    if bool(cert) != bool(key):
        given, missing = (cert_env, key_env) if cert else (key_env, cert_env)
        raise ConfigError(f"{given} is set but {missing} is not: TLS needs both (refusing to serve plaintext)")
    if not cert:
        return
    leaf = _first_certificate(_read_pem(cert_env, cert))
    _read_pem(key_env, key)
    if leaf is None or not _certificate_parses(leaf):
        raise ConfigError(f"{cert_env}={cert!r}: not a readable certificate (its first PEM CERTIFICATE block does not parse)")
    # The first certificate alone, as gRPC uses it: OpenSSL, unlike gRPC, refuses a chain whose
    # later certificate does not parse.
    try:
        with tempfile.NamedTemporaryFile("w", suffix=".pem") as tmp:
            tmp.write(leaf)
            tmp.flush()
            problem = _key_problem(tmp.name, key)
    except OSError:  # no temporary file here: what cannot be checked is not refused
        problem = None
    if problem == "mismatch":
        raise ConfigError(f"{key_env}={key!r} is not the private key of the certificate in {cert_env}={cert!r} "
                          "(the key does not match the certificate)")
    if problem == "encrypted":
        raise ConfigError(f"{key_env}={key!r}: the private key is encrypted (passphrase-protected) and gRPC reads "
                          "it with no passphrase: give an unencrypted PEM key")
    if problem is not None:
        raise ConfigError(f"{key_env}={key!r}: not a readable private key (a PEM private key that parses)")


def _key_problem(cert: str, key: str) -> str | None:
    """None when `ssl` loads the pair (the key with an empty passphrase, as gRPC does); else
    "mismatch", "encrypted" or "key"."""
    asked: list[bool] = []

    def passphrase() -> bytes:  # without a callback OpenSSL prompts for it on the terminal
        asked.append(True)
        return b""

    try:
        _tls_context(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=passphrase)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            return "mismatch"
        return "encrypted" if asked else "key"
    except OSError:  # the key file went away since it was read: the sidecar reports it when it starts
        return None
    return None


def _check_client_ca(path: str) -> None:
    """KVHINT_TLS_CLIENT_CA_FILE: a readable PEM file whose first certificate parses (gRPC loads
    the CA certificates up to the first that does not, and needs at least one)."""
    env = env_name("tls_client_ca_file")
    first = _first_certificate(_read_pem(env, path))
    if first is None or not _certificate_parses(first):
        raise ConfigError(f"{env}={path!r}: not a readable CA bundle (its first PEM CERTIFICATE block does not parse)")


_CERTIFICATE_BLOCK = re.compile(
    rb"-----BEGIN (TRUSTED |X509 )?CERTIFICATE-----\r?\n.*?-----END \1?CERTIFICATE-----", re.DOTALL
)


def _first_certificate(text: bytes) -> str | None:
    """The first PEM certificate block of `text` (the one gRPC's PEM_read_bio_X509_AUX reads)."""
    match = _CERTIFICATE_BLOCK.search(text)
    return match.group(0).decode("ascii", "replace") + "\n" if match else None


def _certificate_parses(block: str) -> bool:
    """Whether `ssl` parses a PEM certificate block (a TRUSTED CERTIFICATE's trust data it does not
    read: such a block is taken as parsing)."""
    if block.startswith("-----BEGIN TRUSTED"):
        return True
    try:
        _tls_context(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=block)
    except (ssl.SSLError, ValueError):
        return False
    return True


def _tls_context(protocol: int) -> ssl.SSLContext:
    """An `ssl` context that refuses no key or signature for being weak: OpenSSL's default security
    level refuses, say, a 1024-bit RSA certificate that gRPC (BoringSSL) serves, and this check must
    not refuse what gRPC would serve."""
    context = ssl.SSLContext(protocol)
    try:
        context.set_ciphers("ALL:@SECLEVEL=0")
    except ssl.SSLError:  # an OpenSSL without security levels refuses none anyway
        pass
    return context


_PEM_LIMIT = 1 << 20


def _read_pem(env: str, path: str) -> bytes:
    """The file's first MiB; ConfigError naming `env` when it cannot be read or that holds no PEM
    block (so `ssl` is never handed something like /dev/zero)."""
    try:
        with open(path, "rb") as f:
            text = f.read(_PEM_LIMIT)
    except OSError as exc:
        raise ConfigError(f"{env}={path!r}: cannot read: {exc.strerror or exc}") from None
    if b"-----BEGIN" not in text:
        raise ConfigError(f"{env}={path!r}: not a PEM file")
    return text


def _check_tenancy(config: ServerConfig) -> None:
    """Client CA needs TLS; the tenants file is loaded and validated now."""
    if config.tls_client_ca_file:
        if not config.tls:
            raise ConfigError(f"{env_name('tls_client_ca_file')} is set but TLS is not ({env_name('tls_cert_file')})")
        _check_client_ca(config.tls_client_ca_file)
    tenants = None
    if config.tenants_file:
        from .tenancy import load_tenants

        tenants = load_tenants(config.tenants_file, extra_admin_token=config.auth_token)
        if tenants.uses_client_identities and not config.tls_client_ca_file:
            raise ConfigError(
                f"{env_name('tenants_file')}={config.tenants_file!r}: client_identities need "
                f"{env_name('tls_client_ca_file')} (mTLS)"
            )
    object.__setattr__(config, "_tenants", tenants)


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """KVHINT_* variables set in `environ` that nothing reads (likely typos)."""
    env = os.environ if environ is None else environ
    known = {env_name(f.name) for f in dataclasses.fields(ServerConfig)} | OTHER_VARIABLES
    return sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known)


def check_environment(environ: Mapping[str, str] | None = None) -> ServerConfig:
    """Validate every KVHINT_* server setting now (before an engine loads a
    model): returns the config, raises ConfigError naming the variable, and
    warns about KVHINT_* variables nothing reads."""
    config = ServerConfig.from_env(environ)
    for name in unknown_variables(environ):
        log.warning("kvhint: %s is set but no KvHint setting has that name (a typo?)", name)
    return config
