"""KvHintServer: the gRPC sidecar, on its own thread and asyncio loop.

Serves kvhint.v1.KvHintService, grpc.health.v1.Health and server reflection.
`start()` returns once the port is bound (or raises); `stop()` shuts down
gracefully: health turns NOT_SERVING (before the engine refuses work), watch
streams end with a SHUTTING_DOWN resync, in-flight RPCs get `shutdown_grace_s`
to finish, queued engine tasks fail UNAVAILABLE, the /metrics endpoint closes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvhint.v1 import kvhint_pb2

from .config import ConfigError, ServerConfig, env_name
from .core import KvHintCore, TaskFuture
from .credentials import RepeatedAuthorization, authorization
from .metrics import KvHintMetrics, MetricsExporter, serve_metrics, stop_metrics
from .servicer import SERVICE, KvHintServicer, generic_handler
from .tenancy import TenantAuth

log = logging.getLogger("kvhint.server")
_HEALTH_PREFIX = "/grpc.health.v1.Health/"
_REFLECTION_PREFIX = "/grpc.reflection."
#: The gRPC server's listener options. No SO_REUSEPORT: a second process on the same port fails to
#: bind instead of sharing (and stealing) its connections. gRPC sets SO_REUSEADDR on TCP listeners
#: itself. engine_integration.launcher's port check binds its probe sockets the same way.
GRPC_SERVER_OPTIONS: tuple[tuple[str, int], ...] = (("grpc.so_reuseport", 0),)


def _bind_failure(config: ServerConfig, detail: str) -> str:
    """What a failed add_*_port means and what to check. grpcio says only "Failed to bind to
    address" whatever went wrong, and with TLS that includes credentials it cannot use."""
    address, env = config.address, env_name("address")
    if address.startswith(("unix:", "unix-abstract:")):
        where = "that the socket's directory exists and is writable and that no other process serves that socket"
    else:
        where = ("that no other process listens on that port (a running engine, say; with data parallelism "
                 "rank r listens on the port + r) and that the host is an address of this machine")
    message = f"cannot listen on {address!r} ({env}): {detail.rstrip('.')}. Check {where}"
    if config.tls:
        files = f"{env_name('tls_cert_file')}, {env_name('tls_key_file')}"
        if config.tls_client_ca_file:
            files += f" and {env_name('tls_client_ca_file')}"
        message += (f". TLS is configured, and gRPC reports TLS credentials it cannot use as this same bind "
                    f"failure: check {files} too (a PEM certificate, its own unencrypted private key"
                    + (", a PEM CA bundle" if config.tls_client_ca_file else "") + ")")
    return message


class _BearerAuth(grpc.aio.ServerInterceptor):
    """Rejects RPCs without `authorization: Bearer <token>`, or with more than
    one `authorization` header (health and reflection stay open, so probes and
    `buf curl` discovery work). The header is compared in constant time
    (hmac.compare_digest)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = details.method or ""
        if method.startswith(_HEALTH_PREFIX) or method.startswith(_REFLECTION_PREFIX):
            return await continuation(details)
        try:
            presented = authorization(details.invocation_metadata)
        except RepeatedAuthorization:
            return self._deny
        if isinstance(presented, str) and hmac.compare_digest(presented.encode(), self._expected):
            return await continuation(details)
        return self._deny


class KvHintServer:
    """The sidecar: gRPC (kvhint.v1, health, reflection) on its own thread and
    asyncio loop. With `metrics`, it also exports Prometheus metrics
    (kvhint_server.metrics) while it serves, and serves them on
    `config.metrics_address` when that is set."""

    def __init__(self, core: KvHintCore, config: ServerConfig | None = None, metrics: KvHintMetrics | None = None) -> None:
        self.core = core
        self.config = config or core.config
        self.servicer = KvHintServicer(core, self.config)
        self.servicer.metrics = metrics
        self._metrics = metrics
        self._exporter: MetricsExporter | None = None
        # serve_metrics's (HTTP server, thread), shut down by stop().
        self._metrics_http: tuple[Any, threading.Thread] | None = None
        # The tenant-usage engine task in flight (metrics): at most one at a time.
        self._usage_task: TaskFuture[list[tuple[str, str, int, int | None]]] | None = None
        self._health: health.aio.HealthServicer | None = None
        self.port: int | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_requested: asyncio.Event | None = None
        self._started = threading.Event()
        self._startup_error: BaseException | None = None

    @property
    def address(self) -> str:
        """Where it listens: the configured address with the bound port (a unix socket as given)."""
        if self.config.address.startswith(("unix:", "unix-abstract:")):
            return self.config.address
        host = self.config.address.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> int:
        """Start serving; returns the bound port. Raises if binding fails."""
        self._thread = threading.Thread(target=self._run, name="kvhint-grpc", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise RuntimeError("kvhint sidecar did not start in time")
        if self._startup_error is not None:
            raise RuntimeError(f"kvhint sidecar failed to start on {self.config.address}: {self._startup_error}")
        assert self.port is not None
        log.info("kvhint sidecar serving %s on %s", SERVICE, self.address)
        if self._metrics is not None:
            self._start_metrics(self._metrics)
        return self.port

    def _start_metrics(self, metrics: KvHintMetrics) -> None:
        hub = self.servicer.hub
        self._exporter = MetricsExporter(self.core, metrics, subscribers=hub.lag if hub is not None else None,
                                         tenant_usage=self._tenant_usage if self.config.tenants is not None else None)
        self._exporter.start()
        if self.config.metrics_address:
            try:
                self._metrics_http = serve_metrics(self.config.metrics_address)
            except OSError as exc:  # in use, or a host that does not resolve here
                self.stop()
                raise ConfigError(f"{env_name('metrics_address')}={self.config.metrics_address!r}: cannot serve /metrics there: {exc}") from exc
            log.info("kvhint sidecar serving /metrics on %s", self.config.metrics_address)

    def _tenant_usage(self) -> list[tuple[str, str, int, int | None]]:
        """Tenants' budget use, computed on the engine thread (metrics)."""
        from .tenant_guard import usage_rows

        tenants = self.config.tenants
        task = self._usage_task
        if task is not None and not task.done():
            return []  # the last sample's task still waits for the engine: skip this one, queue no other
        task = self._usage_task = self.core.submit(lambda: usage_rows(self.core, tenants))
        try:
            return task.result(timeout=2.0)
        except Exception:  # noqa: BLE001 - stopped or busy engine: skip this sample
            return []

    def stop(self, grace: float | None = None) -> None:
        """Graceful shutdown; idempotent; safe from any thread but the server's."""
        self._not_serving()  # probes see NOT_SERVING before the engine refuses work
        self.core.stop()
        exporter, self._exporter = self._exporter, None
        if exporter is not None:
            exporter.stop()
        http, self._metrics_http = self._metrics_http, None
        stop_metrics(http)
        loop, stop, thread = self._loop, self._stop_requested, self._thread
        if loop is None or stop is None or thread is None or not thread.is_alive():
            return
        if grace is not None:
            self.config = dataclasses.replace(self.config, shutdown_grace_s=grace)
        try:
            loop.call_soon_threadsafe(stop.set)
        except RuntimeError:
            return
        thread.join(timeout=(grace if grace is not None else self.config.shutdown_grace_s) + 10.0)
        log.info("kvhint sidecar on %s stopped", self.address)

    def _not_serving(self) -> None:
        """Health turns NOT_SERVING (every service), on the server's loop; waits for it."""
        loop, health_servicer, thread = self._loop, self._health, self._thread
        if loop is None or health_servicer is None or thread is None or not thread.is_alive():
            return
        if threading.current_thread() is thread:
            return
        try:
            done = asyncio.run_coroutine_threadsafe(health_servicer.enter_graceful_shutdown(), loop)
        except RuntimeError:  # the loop is closed: nothing serves health any more
            return
        try:
            done.result(timeout=5.0)
        except Exception:  # noqa: BLE001 - the loop is ending; _serve sets it too
            done.cancel()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # noqa: BLE001
            if not self._started.is_set():
                self._startup_error = exc
                self._started.set()
            else:
                log.exception("kvhint sidecar crashed")
        finally:
            loop.close()

    async def _serve(self) -> None:
        self._stop_requested = asyncio.Event()
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if self.config.tenants is not None:  # tokens and client identities -> tenants
            interceptors.append(TenantAuth(self.config.tenants))
        elif self.config.auth_token:
            interceptors.append(_BearerAuth(self.config.auth_token))
        server = grpc.aio.server(interceptors=interceptors, options=list(GRPC_SERVER_OPTIONS))
        self.servicer.bind_loop(asyncio.get_running_loop())
        server.add_generic_rpc_handlers((generic_handler(self.servicer),))
        health_servicer = health.aio.HealthServicer()
        self._health = health_servicer
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME),
            server,
            pool=kvhint_pb2.DESCRIPTOR.pool,
        )
        if self.config.insecure_remote:
            log.warning(
                "kvhint sidecar serving %s with neither TLS nor a token (KVHINT_ALLOW_INSECURE_REMOTE is set): "
                "anyone who can reach it can change the KV cache", self.config.address,
            )
        if self.config.tls:
            with open(self.config.tls_key_file, "rb") as key, open(self.config.tls_cert_file, "rb") as cert:
                pair = (key.read(), cert.read())
            if self.config.tls_client_ca_file:  # mTLS: a verified client certificate is required
                with open(self.config.tls_client_ca_file, "rb") as ca:
                    creds = grpc.ssl_server_credentials([pair], root_certificates=ca.read(), require_client_auth=True)
            else:
                creds = grpc.ssl_server_credentials([pair])
        try:
            if self.config.tls:
                port = server.add_secure_port(self.config.address, creds)
            else:
                port = server.add_insecure_port(self.config.address)
        except RuntimeError as exc:  # grpcio: "Failed to bind to address ..."
            raise OSError(_bind_failure(self.config, str(exc))) from exc
        if not port:
            raise OSError(_bind_failure(self.config, "gRPC bound no port"))
        await server.start()
        for name in ("", SERVICE):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.port = port
        self._started.set()

        await self._stop_requested.wait()
        await health_servicer.enter_graceful_shutdown()
        if self.servicer.hub is not None:
            self.servicer.hub.close()
        await server.stop(self.config.shutdown_grace_s)
