"""Whether the sidecar of a `kvhint-vllm serve` could listen where it is configured to, checked
by the launcher before vLLM loads the model (engine_integration.launcher.check_kvhint_environment).

A KVHINT_GRPC_ADDRESS (KVHINT_METRICS_ADDRESS) port another process listens on now (a running
engine, say), or a host that is not one of this machine's addresses or does not resolve, would
otherwise fail the sidecar's start after the model load. Each probe binds a socket as the
sidecar's listener will, for every data-parallel rank whose EngineCore this `serve` starts here
(rank r listens on port + r, `engine_integration.dp.rank_address`), and closes it at once: a
snapshot (a port taken between the check and the sidecar's start still fails the start, with a
message naming the variable). Port 0, unix sockets and ranks the flags do not tell
(`local_dp_ranks`) are not checked.
"""

from __future__ import annotations

import errno
import os
import re
import socket
from collections.abc import Mapping
from typing import Any

from .dp import rank_address


# vLLM's data-parallel flags (vllm/engine/arg_utils.py) that decide which ranks run here.
_DP_OPTIONS = {
    "size": ("--data-parallel-size", "-dp"),
    "rank": ("--data-parallel-rank", "-dpn"),
    "start_rank": ("--data-parallel-start-rank", "-dpr"),
    "size_local": ("--data-parallel-size-local", "-dpl"),
    "nnodes": ("--nnodes", "-n"),
    "backend": ("--data-parallel-backend", "-dpb"),
    "config": ("--config",),
}
_DP_ENVIRON = ("VLLM_DP_RANK", "VLLM_DP_SIZE", "VLLM_DP_RANK_LOCAL")


def local_dp_ranks(args: list[str], environ: Mapping[str, str] | None = None) -> range | None:
    """The data-parallel ranks whose EngineCores `serve ARGS` (ARGS after `serve`) starts on this
    machine, as vLLM derives them from its flags: without them, rank 0; `--data-parallel-size N`,
    0 .. N-1; `--data-parallel-rank R`, R; `--data-parallel-start-rank S` and/or
    `--data-parallel-size-local L`, S .. S+L-1 (S 0, L N when not given). None where something the
    launcher does not read decides: --nnodes > 1 (ranks from --node-rank), a backend other than
    mp (ray places them), the multi-port supervisor, a --config file that mentions data-parallel
    or node options, VLLM_DP_* variables, or a value that is not an integer (vLLM refuses it)."""
    import argparse

    env = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    for dest, flags in _DP_OPTIONS.items():
        parser.add_argument(*flags, dest=dest)
    parser.add_argument("--data-parallel-multi-port-external-lb", "-dpm", dest="multi_port", action="store_true")
    # vLLM's parser takes --a_b for --a-b (the name up to the first "." or "=").
    normal = [("--" + a[2:].split("=", 1)[0].replace("_", "-") + ("=" + a.split("=", 1)[1] if "=" in a else ""))
              if a.startswith("--") and "." not in a.split("=", 1)[0] else a for a in args]
    try:
        given, _ = parser.parse_known_args(normal)
    except argparse.ArgumentError:  # a flag without its value: vLLM refuses it
        return None
    if given.multi_port or (given.backend or "mp") != "mp":
        return None
    if given.config is not None:
        try:
            with open(given.config, encoding="utf-8", errors="replace") as f:
                text = f.read(1 << 20)
        except OSError:
            return None
        if re.search(r"data[-_]parallel|nnodes|node[-_]rank", text):
            return None
    try:
        size, nnodes = int(given.size or 1), int(given.nnodes or 1)
        rank = None if given.rank is None else int(given.rank)
        start = int(given.start_rank or 0)
        local = size if given.size_local is None else int(given.size_local)
    except ValueError:
        return None
    if nnodes > 1 or (size == 1 and any(env.get(name) for name in _DP_ENVIRON)):
        return None
    if rank is not None:
        return range(rank, rank + 1)
    return range(start, start + max(local, 0))


def check_listen_addresses(config: Any, args: list[str]) -> None:
    """Raise ConfigError, naming the variable, when a TCP address a sidecar of `serve ARGS` (ARGS
    after `serve`) will listen on cannot be listened on now: KVHINT_GRPC_ADDRESS at port + r for
    every data-parallel rank r that runs here (`local_dp_ranks`; none when it cannot tell), and
    KVHINT_METRICS_ADDRESS where one of those ranks serves it. Port 0 and unix sockets are
    skipped. Each probe binds and listens as the listener will, then closes at once: gRPC's
    (`_grpc_refusal`) or prometheus_client's HTTP server's (`_http_refusal`)."""
    from kvhint_server.config import ConfigError, env_name
    from kvhint_server.metrics import multiprocess_mode

    ranks = local_dp_ranks(args) or range(0)
    grpc_env = env_name("address")
    for rank in ranks:
        address = rank_address(config.address, rank)
        refusal = _grpc_refusal(address)
        if refusal:
            whose = f" (data-parallel rank {rank}'s port: {grpc_env}'s port + {rank})" if rank else ""
            raise ConfigError(f"{grpc_env}={config.address!r}: cannot listen on {address}{whose}: {refusal}")
    if not config.metrics_address:
        return
    # The scheduler's _config_for: in prometheus_client's multiprocess mode (kvhint-vllm's) rank 0
    # alone serves /metrics, on the address as given; otherwise rank r serves it on port + r.
    metrics_env = env_name("metrics_address")
    for rank in ([0] if 0 in ranks else []) if multiprocess_mode() else ranks:
        address = rank_address(config.metrics_address, rank)
        refusal = _http_refusal(address)
        if refusal:
            whose = f" (data-parallel rank {rank}'s port: {metrics_env}'s port + {rank})" if rank else ""
            raise ConfigError(f"{metrics_env}={config.metrics_address!r}: cannot serve /metrics on {address}{whose}: {refusal}")


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _why(errors: list[OSError]) -> str:
    """An operator's reading of the first bind error."""
    err = errors[0]
    if err.errno == errno.EADDRINUSE:
        return ("already in use: another process listens on that port (a running engine, say, or one "
                "still shutting down): stop it or choose another port")
    if err.errno == errno.EADDRNOTAVAIL:
        return "the host is not an address of this machine"
    if err.errno == errno.EACCES:
        return "permission denied (a port below 1024 needs privileges)"
    return err.strerror or str(err)


def _resolve(host: str, port: int) -> tuple[list[tuple[Any, ...]], str | None]:
    """getaddrinfo's passive TCP addresses, or a refusal for a name that does not resolve (other
    resolver failures, such as a temporary one, refuse nothing: the sidecar resolves again)."""
    try:
        return socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE), None
    except socket.gaierror as exc:
        if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return [], f"{host!r} does not resolve to an address of this machine ({exc.strerror})"
        return [], None


def _probe(family: int, sockaddr: tuple[Any, ...], *, reuseport: bool, dualstack: bool | None) -> OSError | None:
    """Bind and listen one socket with SO_REUSEADDR (as gRPC and http.server do), SO_REUSEPORT only
    with `reuseport`, IPV6_V6ONLY off with `dualstack` (None: the system's default), then close
    it; the error, or None when it bound."""
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuseport and hasattr(socket, "SO_REUSEPORT"):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6 and dualstack is not None:
                try:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if dualstack else 1)
                except OSError:
                    pass
            sock.bind(sockaddr)
            sock.listen()
    except OSError as exc:
        return exc
    return None


def _grpc_refusal(address: str) -> str | None:
    """Why KvHint's gRPC server could not listen on `address` now (None: it could, or port 0, or a
    unix socket). As gRPC core's TCP server does: the name resolves to its passive addresses and
    the port is added when any of them binds; a wildcard (0.0.0.0, ::) binds [::] dual-stack and,
    failing that, 0.0.0.0. Options as kvhint_server.server.GRPC_SERVER_OPTIONS (no SO_REUSEPORT)."""
    from kvhint_server.server import GRPC_SERVER_OPTIONS

    if address.startswith(("unix:", "unix-abstract:")):
        return None
    host, port = _split(address)
    if not port:
        return None
    infos, refusal = _resolve(host, port)
    if host.lower() == "localhost" or host.lower().endswith(".localhost"):
        # gRPC's default resolver (c-ares) answers localhost with both loopbacks, where the system's
        # may give 127.0.0.1 alone: gRPC listens on whichever binds.
        infos = [*infos, (socket.AF_INET6, socket.SOCK_STREAM, 0, "", ("::1", port, 0, 0)),
                 (socket.AF_INET, socket.SOCK_STREAM, 0, "", ("127.0.0.1", port))]
        refusal = None
    if refusal or not infos:
        return refusal
    reuseport = bool(dict(GRPC_SERVER_OPTIONS).get("grpc.so_reuseport", 1))
    errors: list[OSError] = []
    for family, _, _, _, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        if sockaddr[0] in ("0.0.0.0", "::"):
            attempts = [(socket.AF_INET6, ("::", port), True), (socket.AF_INET, ("0.0.0.0", port), None)]
        else:
            attempts = [(family, sockaddr, True)]
        for fam, addr, dualstack in attempts:
            error = _probe(fam, addr, reuseport=reuseport, dualstack=dualstack)
            if error is None:
                return None
            errors.append(error)
    return _why(errors) if errors else None


def _http_refusal(address: str) -> str | None:
    """Why kvhint_server.metrics.serve_metrics (prometheus_client's HTTP server) could not listen
    on `address` now: as it does, the first passive address getaddrinfo gives, SO_REUSEADDR."""
    import http.server

    host, port = _split(address)
    if not port:
        return None
    infos, refusal = _resolve(host or "127.0.0.1", port)
    if refusal or not infos:
        return refusal
    family, _, _, _, sockaddr = infos[0]
    error = _probe(family, sockaddr, reuseport=bool(getattr(http.server.HTTPServer, "allow_reuse_port", False)),
                   dualstack=None)
    return _why([error]) if error else None
