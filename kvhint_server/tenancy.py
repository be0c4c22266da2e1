"""Tenants: who may call the sidecar, which sessions are theirs, their budgets.

Contract
--------
* The tenants file (KVHINT_TENANTS_FILE, JSON) is read and validated once, at
  configuration time (ServerConfig construction, so before an engine loads a
  model). Every problem raises ConfigError naming the variable and the field
  path, e.g. ``KVHINT_TENANTS_FILE=/etc/t.json: tenants[1].session_prefix: ...``.
* Format::

    {"tenants": [
      {"name": "team-a", "role": "tenant", "session_prefix": "team-a/",
       "tokens": ["<secret>"], "client_identities": ["team-a.clients.example"],
       "pin_budget_blocks": 200, "retention_budget_blocks": 2000,
       "rate_limit_hints_per_s": 500, "rate_limit_burst": 1000},
      {"name": "ops", "role": "admin", "tokens": ["<secret>"]}
    ]}

  name: unique, non-empty. role: "tenant" (default) or "admin". session_prefix:
  required for tenants, none for admins; no tenant's prefix is a prefix of
  another's (a session id then belongs to at most one tenant). tokens: bearer
  tokens (printable ASCII, no spaces, unique across tenants). client_identities:
  mTLS client certificate names (subject CN or a DNS/URI SAN), unique across
  tenants; they need KVHINT_TLS_CLIENT_CA_FILE. A tenant needs at least one
  token or identity. *_budget_blocks: non-negative integers, absent or null =
  unlimited. rate_limit_hints_per_s (a number > 0) and rate_limit_burst (an
  integer >= 1, needs the rate; default one second's worth): the tenant's own
  token bucket, replacing KVHINT_RATE_LIMIT_HINTS_PER_S / _BURST for it (and
  applying even when those are unlimited); absent or null = the default.
  Unknown keys are errors (typos must not silently disable a limit).
* Ownership: a session id or continuation id belongs to tenant T iff it starts
  with T's session_prefix. An admin owns everything. Retention owner keys
  ("s:<session>", "c:<continuation>", "b:<scope>", see model.Selector.owner)
  belong to the tenant owning the id, or, for "b:", named by the scope.
* Principals: `Tenants.authenticate(header, auth_context)` maps the presented
  `authorization: Bearer <token>` (compared in constant time against every
  configured token, hmac.compare_digest) or else the verified mTLS client
  certificate's names to a Tenant; None means UNAUTHENTICATED. The server's
  `TenantAuth` interceptor does this for every kvhint.v1 RPC and publishes
  the principal in the `current_principal()` context variable for the
  handler. Health and reflection stay open.

Enforcement lives in tenant_guard.py; the trust model is docs/tenancy.md.
"""

from __future__ import annotations

import contextvars
import enum
import hmac
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from .credentials import RepeatedAuthorization, authorization
from .overload import Limit

ENV = "KVHINT_TENANTS_FILE"
_HEALTH_PREFIX = "/grpc.health.v1.Health/"
_REFLECTION_PREFIX = "/grpc.reflection."
_KEYS = frozenset(
    {"name", "role", "session_prefix", "tokens", "client_identities", "pin_budget_blocks", "retention_budget_blocks",
     "rate_limit_hints_per_s", "rate_limit_burst"}
)
MAX_BUDGET = 2**31 - 1
MAX_RATE = 1e9  # hints per second, as KVHINT_RATE_LIMIT_HINTS_PER_S


class Role(str, enum.Enum):
    TENANT = "tenant"
    ADMIN = "admin"


@dataclass(frozen=True)
class Tenant:
    name: str
    role: Role = Role.TENANT
    session_prefix: str = ""
    tokens: tuple[str, ...] = ()
    client_identities: tuple[str, ...] = ()
    # Distinct blocks the tenant's pins / retention grants (pins included) may
    # cover at once; None: unlimited.
    pin_budget_blocks: int | None = None
    retention_budget_blocks: int | None = None
    # The tenant's own rate limit (overload.py); None: the default.
    rate_limit: Limit | None = None

    @property
    def admin(self) -> bool:
        return self.role is Role.ADMIN

    def owns(self, ident: str) -> bool:
        """Whether a session or continuation id is this tenant's."""
        return self.admin or ident.startswith(self.session_prefix)

    def __repr__(self) -> str:  # never print tokens
        return f"Tenant({self.name!r}, {self.role.value}, prefix={self.session_prefix!r})"


#: The principal of a call authenticated by KVHINT_AUTH_TOKEN when a tenants
#: file is also configured: an administrator.
TOKEN_ADMIN = Tenant(name="auth-token", role=Role.ADMIN)

_current: contextvars.ContextVar[Tenant | None] = contextvars.ContextVar("kvhint_principal", default=None)


def current_principal() -> Tenant | None:
    """The tenant the running RPC authenticated as (None without tenancy)."""
    return _current.get()


class Tenants:
    """The validated tenants file."""

    def __init__(self, tenants: Sequence[Tenant], extra_admin_token: str = "") -> None:
        self.tenants = tuple(tenants)
        self._by_token = [(f"Bearer {tok}".encode(), t) for t in tenants for tok in t.tokens]
        if extra_admin_token:
            self._by_token.append((f"Bearer {extra_admin_token}".encode(), TOKEN_ADMIN))
        self._by_identity = {ident: t for t in tenants for ident in t.client_identities}
        self.by_name = {t.name: t for t in tenants}
        self._scoped = [t for t in tenants if not t.admin]

    @property
    def uses_client_identities(self) -> bool:
        return bool(self._by_identity)

    def authenticate(self, header: str | bytes | None, auth_context: Mapping[str, Sequence[bytes]] | None = None) -> Tenant | None:
        """The tenant of a bearer header or, failing that, of a verified mTLS
        client certificate. Every configured token is compared (constant
        time each), so timing does not reveal which one matched."""
        found: Tenant | None = None
        if header:
            presented = header.encode() if isinstance(header, str) else bytes(header)
            for expected, tenant in self._by_token:
                if hmac.compare_digest(presented, expected):
                    found = tenant
        if found is None and auth_context and self._by_identity:
            names = [*auth_context.get("x509_common_name", ()), *auth_context.get("x509_subject_alternative_name", ())]
            for raw in names:
                tenant = self._by_identity.get(raw.decode(errors="replace"))
                if tenant is not None:
                    return tenant
        return found

    def tenant_of_id(self, ident: str) -> Tenant | None:
        """The (non-admin) tenant whose namespace holds a session/continuation id."""
        for t in self._scoped:
            if ident.startswith(t.session_prefix):
                return t
        return None

    def tenant_of_owner(self, owner: str) -> Tenant | None:
        """The tenant a retention owner key belongs to (None: nobody's / an admin's)."""
        kind, _, rest = owner.partition(":")
        if kind == "b":
            t = self.by_name.get(rest)
            return t if t is not None and not t.admin else None
        return self.tenant_of_id(rest)


# ---------------------------------------------------------------- loading


def _claim(path: str, at: str, what: str, values: list[str], seen: dict[str, str], tenant: str) -> None:
    """Give `values` to `tenant`; one already given to another tenant is an error."""
    for j, value in enumerate(values):
        if value in seen:
            raise _fail(path, f"{at}[{j}]", f"{what} already given to tenant {seen[value]!r}")
        seen[value] = tenant


def _fail(path: str, where: str, problem: str) -> ValueError:
    from .config import ConfigError

    return ConfigError(f"{ENV}={path!r}: {where}: {problem}")


def _header_safe(value: object) -> bool:
    return isinstance(value, str) and bool(value) and value.isascii() and value.isprintable() and " " not in value


def _budget(path: str, where: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_BUDGET:
        raise _fail(path, where, f"expected an integer in 0..{MAX_BUDGET} or null, got {value!r}")
    return value


def _rate_limit(path: str, at: str, rate: object, burst: object) -> Limit | None:
    if rate is None:
        if burst is not None:
            raise _fail(path, f"{at}.rate_limit_burst", "needs rate_limit_hints_per_s in the same entry")
        return None
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= MAX_RATE:
        raise _fail(path, f"{at}.rate_limit_hints_per_s", f"expected a number in (0, {MAX_RATE:g}] or null, got {rate!r}")
    if burst is not None and (isinstance(burst, bool) or not isinstance(burst, int) or not 1 <= burst <= MAX_BUDGET):
        raise _fail(path, f"{at}.rate_limit_burst", f"expected an integer in 1..{MAX_BUDGET} or null, got {burst!r}")
    return Limit.of(float(rate), burst or 0)


def _strings(path: str, where: str, value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _fail(path, where, "expected a list of strings")
    for i, v in enumerate(value):
        if not _header_safe(v):
            raise _fail(path, f"{where}[{i}]", "expected a non-empty printable ASCII string without spaces")
    return tuple(value)


def parse_tenants(data: object, path: str = "<inline>", extra_admin_token: str = "") -> Tenants:
    """Validate a decoded tenants document (ConfigError naming the field)."""
    if not isinstance(data, dict) or set(data) != {"tenants"}:
        raise _fail(path, "top level", 'expected an object with exactly one key, "tenants"')
    entries = data["tenants"]
    if not isinstance(entries, list) or not entries:
        raise _fail(path, "tenants", "expected a non-empty list")
    tenants: list[Tenant] = []
    seen_tokens: dict[str, str] = {}
    seen_ids: dict[str, str] = {}
    for i, entry in enumerate(entries):
        at = f"tenants[{i}]"
        if not isinstance(entry, dict):
            raise _fail(path, at, "expected an object")
        unknown = sorted(set(entry) - _KEYS)
        if unknown:
            raise _fail(path, f"{at}.{unknown[0]}", f"unknown key (known: {', '.join(sorted(_KEYS))})")
        name = entry.get("name")
        if not isinstance(name, str) or not name or not name.isprintable() or len(name) > 64:
            raise _fail(path, f"{at}.name", "expected a non-empty printable string of at most 64 characters")
        if any(t.name == name for t in tenants):
            raise _fail(path, f"{at}.name", f"duplicate tenant name {name!r}")
        if name == TOKEN_ADMIN.name:
            raise _fail(path, f"{at}.name", f"{name!r} is reserved: it names the administrator that KVHINT_AUTH_TOKEN authenticates")
        try:
            role = Role(entry.get("role", "tenant"))
        except ValueError:
            raise _fail(path, f"{at}.role", f"expected 'tenant' or 'admin', got {entry.get('role')!r}") from None
        prefix = entry.get("session_prefix", "")
        if role is Role.TENANT:
            if not isinstance(prefix, str) or not prefix:
                raise _fail(path, f"{at}.session_prefix", "required for a tenant: a non-empty string")
        elif prefix:
            raise _fail(path, f"{at}.session_prefix", "an admin sees every session; leave it out")
        tokens = _strings(path, f"{at}.tokens", entry.get("tokens"))
        identities = _strings(path, f"{at}.client_identities", entry.get("client_identities"))
        if not tokens and not identities:
            raise _fail(path, f"{at}.tokens", "a tenant needs at least one token or client identity")
        _claim(path, f"{at}.tokens", "token", tokens, seen_tokens, name)
        if extra_admin_token and extra_admin_token in tokens:
            raise _fail(path, f"{at}.tokens", "a token equals KVHINT_AUTH_TOKEN (which is the admin token)")
        _claim(path, f"{at}.client_identities", "identity", identities, seen_ids, name)
        pin = _budget(path, f"{at}.pin_budget_blocks", entry.get("pin_budget_blocks"))
        retention = _budget(path, f"{at}.retention_budget_blocks", entry.get("retention_budget_blocks"))
        if role is Role.ADMIN and (pin is not None or retention is not None):
            raise _fail(path, f"{at}.pin_budget_blocks" if pin is not None else f"{at}.retention_budget_blocks",
                        "budgets apply to tenants, not admins")
        rate_limit = _rate_limit(path, at, entry.get("rate_limit_hints_per_s"), entry.get("rate_limit_burst"))
        tenant = Tenant(name, role, prefix, tokens, identities, pin, retention, rate_limit)
        for other in tenants:
            if other.admin or tenant.admin:
                continue
            if other.session_prefix.startswith(prefix) or prefix.startswith(other.session_prefix):
                raise _fail(path, f"{at}.session_prefix",
                            f"{prefix!r} overlaps tenant {other.name!r}'s {other.session_prefix!r}: "
                            "a session id must belong to one tenant")
        tenants.append(tenant)
    return Tenants(tenants, extra_admin_token)


def load_tenants(path: str, extra_admin_token: str = "") -> Tenants:
    """Read and validate a tenants file (ConfigError naming KVHINT_TENANTS_FILE and the field)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise _fail(path, "file", f"cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise _fail(path, "file", f"not UTF-8 text: byte {exc.object[exc.start]:#04x} at offset {exc.start}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _fail(path, f"line {exc.lineno} column {exc.colno}", f"not JSON: {exc.msg}") from None
    return parse_tenants(data, path, extra_admin_token)


# ---------------------------------------------------------------- the interceptor


def _wrap(handler: grpc.RpcMethodHandler, tenants: Tenants) -> grpc.RpcMethodHandler:
    """The same handler, authenticating first and publishing the principal."""

    async def principal(request_metadata: Sequence[tuple[str, Any]] | None, context: grpc.aio.ServicerContext) -> Tenant:
        try:
            header = authorization(request_metadata)
        except RepeatedAuthorization as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        auth_context = context.auth_context() if tenants.uses_client_identities else None
        tenant = tenants.authenticate(header, auth_context)
        if tenant is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown bearer token or client identity")
        return tenant  # type: ignore[return-value]

    if handler.unary_unary is not None:
        inner_unary = handler.unary_unary

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            _current.set(await principal(context.invocation_metadata(), context))
            return await inner_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)
    if handler.unary_stream is not None:
        inner_stream = handler.unary_stream

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            _current.set(await principal(context.invocation_metadata(), context))
            async for item in inner_stream(request, context):
                yield item

        return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer, handler.response_serializer)
    return handler  # kvhint.v1 has no client-streaming RPCs


class TenantAuth(grpc.aio.ServerInterceptor):
    """Authenticates every kvhint.v1 RPC against the tenants file (bearer
    token, or mTLS client identity) and sets `current_principal()` for its
    handler; UNAUTHENTICATED otherwise. Health and reflection stay open."""

    def __init__(self, tenants: Tenants) -> None:
        self._tenants = tenants

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method or ""
        if handler is None or method.startswith(_HEALTH_PREFIX) or method.startswith(_REFLECTION_PREFIX):
            return handler
        return _wrap(handler, self._tenants)
