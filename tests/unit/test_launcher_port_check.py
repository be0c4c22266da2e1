"""`kvhint-vllm serve` refuses, before vLLM loads the model, a KVHINT_GRPC_ADDRESS (and
KVHINT_METRICS_ADDRESS) this machine cannot listen on now: before, a port taken by a running
engine failed only at the sidecar's start, after the model load (a minute on CPU, minutes on a
GPU). The probe must refuse exactly what gRPC refuses (each case is also bound by a real gRPC
server with KvHint's listener options), for every data-parallel rank that runs here."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import grpc
import pytest

from engine_integration import launcher, listen_check
from engine_integration.listen_check import check_listen_addresses, local_dp_ranks
from kvhint_server.config import ConfigError, ServerConfig
from kvhint_server.server import GRPC_SERVER_OPTIONS

REPO = Path(__file__).resolve().parents[2]


def _ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


IPV6 = _ipv6()


def free_port() -> int:
    """A port free on every loopback and wildcard address (bound dual-stack on [::], else 0.0.0.0)."""
    family, host = (socket.AF_INET6, "::") if IPV6 else (socket.AF_INET, "0.0.0.0")
    with socket.socket(family) as s:
        if IPV6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind((host, 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- which ranks run here


@pytest.mark.parametrize(
    ("args", "ranks"),
    [
        (["m"], range(0, 1)),
        (["m", "--data-parallel-size", "4"], range(0, 4)),
        (["m", "-dp", "3"], range(0, 3)),
        (["m", "--data_parallel_size=2"], range(0, 2)),  # vLLM takes underscores and =VALUE
        (["m", "-dp", "4", "--data-parallel-rank", "2"], range(2, 3)),  # external LB: this rank alone
        (["m", "-dp", "4", "-dpl", "2", "-dpr", "2"], range(2, 4)),  # hybrid LB: ranks 2 and 3 here
        (["m", "-dp", "4", "--data-parallel-size-local", "2"], range(0, 2)),
        (["m", "-dp", "4", "-dpl", "0", "--headless"], range(0, 0)),
        (["m", "-dp", "4", "--nnodes", "2", "--node-rank", "1"], None),  # ranks from the node's rank
        (["m", "-dp", "2", "--data-parallel-backend", "ray"], None),  # ray places them
        (["m", "-dp", "2", "--data-parallel-multi-port-external-lb"], None),
        (["m", "-dp"], None),  # vLLM refuses these
        (["m", "-dp", "two"], None),
    ],
)
def test_the_launcher_knows_which_data_parallel_ranks_run_here(args: list[str], ranks: range | None) -> None:
    assert local_dp_ranks(args, environ={}) == ranks


def test_ranks_a_config_file_or_vllms_dp_variables_may_set_are_unknown(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("data_parallel_size: 2\n")
    assert local_dp_ranks(["m", "--config", str(config)], environ={}) is None
    config.write_text("max_model_len: 2048\n")
    assert local_dp_ranks(["m", "--config", str(config)], environ={}) == range(0, 1)
    assert local_dp_ranks(["m"], environ={"VLLM_DP_RANK": "1", "VLLM_DP_SIZE": "2"}) is None


# ---------------------------------------------------------------- the probe is gRPC's bind


@contextmanager
def occupant(kind: str, port: int) -> Iterator[None]:
    """Something on `port` that is not KvHint's sidecar."""
    with ExitStack() as stack:
        if kind == "grpc server, default options (SO_REUSEPORT)":
            server = grpc.server(ThreadPoolExecutor(1))
            assert server.add_insecure_port(f"127.0.0.1:{port}")
            stack.callback(server.stop, None)
        elif kind == "time-wait connection":
            listener = stack.enter_context(socket.create_server(("127.0.0.1", port)))
            client = socket.create_connection(("127.0.0.1", port))
            accepted, _ = listener.accept()
            accepted.close()  # the server side closes first: its end waits in TIME_WAIT
            client.close()
            listener.close()
        elif kind != "nothing":
            family, host, v6only, listen = {
                "listener on 127.0.0.1": (socket.AF_INET, "127.0.0.1", None, True),
                "listener on 0.0.0.0": (socket.AF_INET, "0.0.0.0", None, True),
                "listener on ::1": (socket.AF_INET6, "::1", None, True),
                "listener on :: (dual-stack)": (socket.AF_INET6, "::", 0, True),
                "listener on :: (IPv6 only)": (socket.AF_INET6, "::", 1, True),
                "bound, not listening, on 127.0.0.1": (socket.AF_INET, "127.0.0.1", None, False),
            }[kind]
            sock = stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
            if v6only is not None:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, v6only)
            sock.bind((host, port))
            if listen:
                sock.listen()
        yield


OCCUPANTS = ["nothing", "listener on 127.0.0.1", "listener on 0.0.0.0", "bound, not listening, on 127.0.0.1",
             "grpc server, default options (SO_REUSEPORT)", "time-wait connection"]
HOSTS = ["127.0.0.1", "localhost", "0.0.0.0"]
if IPV6:
    OCCUPANTS += ["listener on ::1", "listener on :: (dual-stack)", "listener on :: (IPv6 only)"]
    HOSTS += ["[::1]", "[::]"]


def grpc_can_listen(address: str) -> bool:
    """Whether a gRPC server with KvHint's listener options binds `address`; its port is closed
    again on return (a server never started keeps its listener until it is collected)."""
    server = grpc.server(ThreadPoolExecutor(1), options=list(GRPC_SERVER_OPTIONS))
    try:
        bound = bool(server.add_insecure_port(address))
    except RuntimeError:
        bound = False
    server.start()
    server.stop(None).wait()
    return bound


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("kind", OCCUPANTS)
def test_the_probe_refuses_exactly_what_grpc_refuses(kind: str, host: str) -> None:
    port = free_port()
    address = f"{host}:{port}"
    with occupant(kind, port):
        refusal = listen_check._grpc_refusal(address)
        assert listen_check._grpc_refusal(address) == refusal, "the probe leaves the port as it found it"
        assert (refusal is None) == grpc_can_listen(address), f"{kind}, {address}: the probe says {refusal!r}"


def test_an_address_gRPC_cannot_bind_is_named_plainly() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert "already in use" in listen_check._grpc_refusal(f"127.0.0.1:{port}")
        assert "already in use" in listen_check._http_refusal(f"127.0.0.1:{port}")
    assert "not an address of this machine" in listen_check._grpc_refusal("192.0.2.1:5000")  # TEST-NET-1
    try:
        socket.getaddrinfo("no-such-host.invalid", 5000)
    except socket.gaierror as exc:
        if exc.errno == socket.EAI_NONAME:  # not a resolver that cannot be reached (EAI_AGAIN: not refused)
            assert "does not resolve" in listen_check._grpc_refusal("no-such-host.invalid:5000")
    assert listen_check._grpc_refusal("127.0.0.1:0") is None and listen_check._grpc_refusal("unix:/nonexistent/x.sock") is None


# ---------------------------------------------------------------- every rank's port, and /metrics


def config(**overrides: object) -> ServerConfig:
    return ServerConfig(**overrides)  # type: ignore[arg-type]


def test_each_local_ranks_port_is_checked_and_the_refusal_names_the_rank() -> None:
    base = free_port()
    with socket.create_server(("127.0.0.1", base + 1)):
        with pytest.raises(ConfigError) as refused:
            check_listen_addresses(config(address=f"127.0.0.1:{base}"), ["m", "-dp", "2"])
        message = str(refused.value)
        assert message.startswith(f"KVHINT_GRPC_ADDRESS='127.0.0.1:{base}': cannot listen on 127.0.0.1:{base + 1}")
        assert "data-parallel rank 1" in message and "already in use" in message
        check_listen_addresses(config(address=f"127.0.0.1:{base}"), ["m"])  # rank 0 alone: its port is free
        # Ranks this launcher cannot place are not checked (rank 1 may be another machine's).
        check_listen_addresses(config(address=f"127.0.0.1:{base}"), ["m", "-dp", "2", "--nnodes", "2"])
    with socket.create_server(("127.0.0.1", base)):
        # --data-parallel-rank 1: rank 0's port belongs to another process (rank 0's own launch).
        check_listen_addresses(config(address=f"127.0.0.1:{base - 1}"), ["m", "-dp", "2", "--data-parallel-rank", "2"])
        with pytest.raises(ConfigError, match="KVHINT_GRPC_ADDRESS"):
            check_listen_addresses(config(address=f"127.0.0.1:{base - 1}"), ["m", "-dp", "2", "--data-parallel-rank", "1"])


@pytest.mark.parametrize("multiprocess", [True, False])
def test_the_metrics_port_is_checked_where_a_local_rank_serves_it(monkeypatch, multiprocess: bool) -> None:
    """The scheduler's rule: in prometheus_client's multiprocess mode (kvhint-vllm's) rank 0 alone
    serves KVHINT_METRICS_ADDRESS as given; otherwise rank r serves it on port + r."""
    import kvhint_server.metrics

    monkeypatch.setattr(kvhint_server.metrics, "multiprocess_mode", lambda: multiprocess)
    grpc_port, metrics = free_port(), free_port()
    cfg = config(address=f"127.0.0.1:{grpc_port}", metrics_address=f"127.0.0.1:{metrics}")
    with socket.create_server(("127.0.0.1", metrics)):
        with pytest.raises(ConfigError, match=f"KVHINT_METRICS_ADDRESS='127.0.0.1:{metrics}': cannot serve /metrics"):
            check_listen_addresses(cfg, ["m"])
        check_listen_addresses(cfg, ["m", "-dp", "2", "--data-parallel-rank", "1"])  # rank 1 here: not rank 0's
    with socket.create_server(("127.0.0.1", metrics + 1)):
        if multiprocess:
            check_listen_addresses(cfg, ["m", "-dp", "2"])  # rank 1 serves no /metrics
        else:
            with pytest.raises(ConfigError, match="data-parallel rank 1"):
                check_listen_addresses(cfg, ["m", "-dp", "2"])


def test_serve_on_a_port_in_use_exits_before_vllm_loads_anything() -> None:
    """The operator trial's case: a second engine on a running engine's gRPC port."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "engine_integration.launcher", "serve", "/no/model"],
            cwd=REPO, env={"PATH": "/usr/bin:/bin", "KVHINT_GRPC_ADDRESS": f"127.0.0.1:{port}"},
            capture_output=True, text=True, timeout=120,
        )
    assert proc.returncode != 0
    assert f"configuration error: KVHINT_GRPC_ADDRESS='127.0.0.1:{port}'" in proc.stderr, proc.stderr[-2000:]
    assert "already in use" in proc.stderr
    assert time.monotonic() - started < 10


def test_serve_help_is_not_refused_for_a_port_in_use(monkeypatch) -> None:
    """`serve --help` starts no engine: a running engine on the port does not stop it."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        monkeypatch.setenv("KVHINT_GRPC_ADDRESS", f"127.0.0.1:{taken.getsockname()[1]}")
        launcher.check_kvhint_environment(["serve", "m", "--help"])
        with pytest.raises(SystemExit, match="already in use"):
            launcher.check_kvhint_environment(["serve", "m"])
