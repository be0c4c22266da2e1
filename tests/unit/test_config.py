"""Configuration fails fast and loud (issue 14, item 4): every KVHINT_* value is
checked when the config is built, every error names the variable, a
non-loopback address needs TLS or a token (or an explicit opt-in, which
warns), and the bearer token is compared in constant time."""

from __future__ import annotations

import dataclasses
import logging
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from kvhint_unit_support import FakeEngine, local_engine_info
from tls_pki import openssl

from kvhint.v1 import kvhint_pb2 as pb
from kvhint.v1 import kvhint_pb2_grpc
from kvhint_server import KvHintCore, KvHintServer
from kvhint_server import server as server_module
from kvhint_server.config import ConfigError, ServerConfig, check_environment, env_name, is_loopback, unknown_variables

REPO = Path(__file__).resolve().parents[2]
NUMERIC = [f.name for f in dataclasses.fields(ServerConfig) if type(f.default) in (int, float)]
FLOATS = [f.name for f in dataclasses.fields(ServerConfig) if type(f.default) is float]


def _error(environ: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as exc:
        check_environment(environ)
    return str(exc.value)


def test_defaults_are_valid_and_the_environment_is_read():
    assert check_environment({}) == ServerConfig()
    config = check_environment({"KVHINT_MAX_TTL_S": "600", "KVHINT_MAX_PAGE_SIZE": "10", "KVHINT_ALLOW_INSECURE_REMOTE": "yes"})
    assert (config.max_ttl_s, config.max_page_size, config.allow_insecure_remote) == (600.0, 10, True)
    assert config.default_page_size == 10  # a default above its maximum means the maximum


@pytest.mark.parametrize("name", FLOATS)
@pytest.mark.parametrize("raw", ["nan", "inf", "-inf"])
def test_non_finite_numbers_are_refused_naming_the_variable(name, raw):
    assert env_name(name) in _error({env_name(name): raw})


@pytest.mark.parametrize("name", NUMERIC)
def test_out_of_range_and_unparseable_numbers_name_the_variable(name):
    var = env_name(name)
    assert var in _error({var: "-1"})
    assert var in _error({var: "twelve"})
    assert var in _error({var: "1e300" if name in FLOATS else str(2**31)})  # past what the wire can carry


def test_the_default_heartbeat_keeps_to_the_period_a_subscriber_may_ask_for():
    """1e-6 passed (> 0) and sent a plain `kvhint watch` thousands of heartbeats a second, the sidecar's
    loop busy in the engine's process; a subscriber's own request is clamped to 0.1 .. 60 s."""
    var = env_name("heartbeat_interval_s")
    for raw in ("1e-6", "0.05", "60.5"):
        assert f"{var}={float(raw)!r} must be >= 0.1 and <= 60" in _error({var: raw})
    assert check_environment({var: "0.1"}).heartbeat_interval_s == 0.1
    assert check_environment({var: "60"}).heartbeat_interval_s == 60.0


def test_the_largest_accepted_values_still_serve_get_capabilities():
    from kvhint_server import wire
    from kvhint_server.config import MAX_COUNT, MAX_SECONDS

    config = ServerConfig(max_ttl_s=MAX_SECONDS, rate_limit_hints_per_s=1.0, **{n: MAX_COUNT for n in NUMERIC if n not in FLOATS})
    caps = wire.capabilities(local_engine_info(), config, "e", MAX_COUNT)
    assert caps.limits.max_ttl.seconds == int(MAX_SECONDS) and caps.limits.max_page_size == MAX_COUNT


def test_the_reported_cases():
    assert "KVHINT_PIN_BUDGET_FRACTION" in _error({"KVHINT_PIN_BUDGET_FRACTION": "1.5"})
    assert "KVHINT_MAX_TTL_S" in _error({"KVHINT_MAX_TTL_S": "nan"})
    assert "KVHINT_MAX_HINTS_PER_BATCH" in _error({"KVHINT_MAX_HINTS_PER_BATCH": "1.5"})
    assert "KVHINT_ALLOW_INSECURE_REMOTE" in _error({"KVHINT_ALLOW_INSECURE_REMOTE": "maybe"})
    assert "KVHINT_GRPC_ADDRESS" in _error({"KVHINT_GRPC_ADDRESS": "127.0.0.1:99999"})
    assert "KVHINT_AUTH_TOKEN" in _error({"KVHINT_AUTH_TOKEN": "two words"})
    # Built in code, the message still names the variable.
    with pytest.raises(ConfigError, match="KVHINT_PIN_BUDGET_FRACTION"):
        ServerConfig(pin_budget_fraction=2.0)


@pytest.fixture
def pem(tmp_path: Path) -> Path:
    """A certificate and its private key in one PEM file: usable as both KVHINT_TLS_CERT_FILE and
    KVHINT_TLS_KEY_FILE (the configuration loads them as a TLS server would, so a PEM-shaped
    stand-in no longer passes; tests/unit/test_tls_material.py)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI to make a certificate")
    openssl(tmp_path, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", "x.key", "-out", "x.crt", "-days", "2", "-subj", "/CN=localhost")
    path = tmp_path / "x.pem"
    path.write_bytes((tmp_path / "x.crt").read_bytes() + (tmp_path / "x.key").read_bytes())
    return path


def test_tls_needs_cert_and_key_together_and_readable_pem_files(tmp_path, pem):
    message = _error({"KVHINT_TLS_CERT_FILE": str(pem)})
    assert "KVHINT_TLS_KEY_FILE" in message and "plaintext" in message
    assert "KVHINT_TLS_CERT_FILE" in _error({"KVHINT_TLS_KEY_FILE": str(pem)})
    assert "KVHINT_TLS_KEY_FILE" in _error({"KVHINT_TLS_CERT_FILE": str(pem), "KVHINT_TLS_KEY_FILE": str(tmp_path / "no")})
    (tmp_path / "junk").write_text("not pem")
    assert "not a PEM" in _error({"KVHINT_TLS_CERT_FILE": str(tmp_path / "junk"), "KVHINT_TLS_KEY_FILE": str(pem)})
    assert check_environment({"KVHINT_TLS_CERT_FILE": str(pem), "KVHINT_TLS_KEY_FILE": str(pem)}).tls


@pytest.mark.parametrize("address", ["0.0.0.0:50151", "[::]:50151", "10.1.2.3:1", "example.com:50151"])
def test_a_non_loopback_address_needs_tls_or_a_token_or_the_opt_in(address, pem):
    message = _error({"KVHINT_GRPC_ADDRESS": address})
    assert "KVHINT_ALLOW_INSECURE_REMOTE" in message and "KVHINT_AUTH_TOKEN" in message
    assert check_environment({"KVHINT_GRPC_ADDRESS": address, "KVHINT_AUTH_TOKEN": "t"}).auth_token == "t"
    assert check_environment({"KVHINT_GRPC_ADDRESS": address, "KVHINT_TLS_CERT_FILE": str(pem), "KVHINT_TLS_KEY_FILE": str(pem)})
    assert check_environment({"KVHINT_GRPC_ADDRESS": address, "KVHINT_ALLOW_INSECURE_REMOTE": "1"}).insecure_remote


@pytest.mark.parametrize("address", ["127.0.0.1:1", "127.8.0.1:0", "[::1]:5", "localhost:7", "unix:/tmp/kv.sock"])
def test_loopback_addresses_need_nothing(address):
    assert is_loopback(address) and not check_environment({"KVHINT_GRPC_ADDRESS": address}).insecure_remote


def test_unknown_kvhint_variables_are_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="kvhint.config"):
        check_environment({"KVHINT_MAX_TTL": "600", "KVHINT_TOKEN": "client side"})
    assert "KVHINT_MAX_TTL " in caplog.text and "KVHINT_TOKEN" not in caplog.text


def test_every_kvhint_variable_the_code_reads_is_known_to_the_typo_warning():
    """A variable the repository reads (a string literal KVHINT_NAME in the shipped code, the
    benchmarks or the scripts, or a variable a shell script reads or exports) never draws the
    "a typo?" warning: the launcher printed it for KVHINT_ENFORCE_EAGER until it was listed, and
    the GPU bundle's engines for KVHINT_BENCH_ENFORCE_EAGER."""
    root = Path(__file__).resolve().parents[2]
    read: set[str] = set()
    for folder in ("engine_integration", "kvhint_client", "kvhint_server", "bench", "scripts", "conformance"):
        for path in (root / folder).rglob("*.py"):
            read.update(re.findall(r"[\"'](KVHINT_[A-Z0-9_]+)[\"']", path.read_text()))
        for path in (root / folder).rglob("*.sh"):
            read.update(re.findall(r"(?:\$\{?|export |\b)(KVHINT_[A-Z0-9_]+)(?=[}:=\s-])", path.read_text()))
    assert "KVHINT_ENFORCE_EAGER" in read and "KVHINT_GRPC_ADDRESS" in read and "KVHINT_GPU_BUNDLE_STORE" in read
    assert unknown_variables({name: "1" for name in read}) == []
    assert unknown_variables({"KVHINT_ENFORCE_EAGR": "1"}) == ["KVHINT_ENFORCE_EAGR"]


def _server(**config: object) -> tuple[KvHintServer, FakeEngine]:
    core = KvHintCore(ServerConfig(**config))  # type: ignore[arg-type]
    engine = FakeEngine(core, local_engine_info())
    core.attach(engine)
    engine.start()
    server = KvHintServer(core)
    server.start()
    return server, engine


def test_opting_in_to_an_insecure_remote_address_warns_at_start(caplog):
    with caplog.at_level(logging.WARNING, logger="kvhint.server"):
        server, engine = _server(address="0.0.0.0:0", allow_insecure_remote=True)
    try:
        assert "neither TLS nor a token" in caplog.text
    finally:
        server.stop(grace=0.1)
        engine.stop()


def test_the_bearer_token_is_checked_in_constant_time(monkeypatch):
    compared: list[tuple[bytes, bytes]] = []
    real = server_module.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(server_module.hmac, "compare_digest", spy)
    server, engine = _server(address="127.0.0.1:0", auth_token="s3cret")
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = kvhint_pb2_grpc.KvHintServiceStub(channel)
            with pytest.raises(grpc.RpcError) as exc:
                stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=5, metadata=[("authorization", "Bearer s3cres")])
            assert exc.value.code() is grpc.StatusCode.UNAUTHENTICATED
            stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=5, metadata=[("authorization", "Bearer s3cret")])
    finally:
        server.stop(grace=0.1)
        engine.stop()
    assert (b"Bearer s3cres", b"Bearer s3cret") in compared and (b"Bearer s3cret", b"Bearer s3cret") in compared


@pytest.mark.parametrize("environ", [{"KVHINT_MAX_TTL_S": "nan"}, {"KVHINT_TIER_OP_TIMEOUT_S": "inf"},
                                     {"KVHINT_ENGINE_CORE_START": "forkserver"}])
def test_launcher_serve_exits_at_once_naming_the_variable(environ):
    """`kvhint-vllm serve` refuses before importing vLLM (the engine test checks
    the installed script with a real model end to end)."""
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "engine_integration.launcher", "serve", "/no/model"],
        cwd=REPO, env={"PATH": "/usr/bin:/bin", **environ}, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0 and next(iter(environ)) in proc.stderr, proc.stderr[-2000:]
    assert time.monotonic() - started < 10


def test_the_readme_lists_every_server_variable():
    readme = (REPO / "README.md").read_text()
    missing = [env_name(f.name) for f in dataclasses.fields(ServerConfig) if f"`{env_name(f.name)}`" not in readme]
    assert not missing, f"README configuration table lacks {missing}"


@pytest.mark.parametrize(
    ("metrics", "why"),
    [("unix:/tmp/m.sock", "no unix socket"), ("127.0.0.1:50151", "give /metrics a port of its own"),
     ("0.0.0.0:50151", "give /metrics a port of its own"), ("localhost", "expected HOST:PORT")],
)
def test_a_metrics_address_that_cannot_serve_is_refused_before_the_engine_starts(metrics, why):
    message = _error({"KVHINT_METRICS_ADDRESS": metrics})
    assert "KVHINT_METRICS_ADDRESS" in message and why in message
    assert check_environment({"KVHINT_METRICS_ADDRESS": "127.0.0.1:50152"}).metrics_address == "127.0.0.1:50152"
    assert check_environment({"KVHINT_METRICS_ADDRESS": "[::1]:9100"}).metrics_address == "[::1]:9100"


def test_metrics_on_a_port_in_use_fail_the_start_naming_the_variable():
    """Checked at the start (the port's owner is only known then): a clear ConfigError, and the
    sidecar stopped, not left serving with health SERVING."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        from prometheus_client import CollectorRegistry

        from kvhint_server.metrics import KvHintMetrics

        config = ServerConfig(address="127.0.0.1:0", metrics_address=f"127.0.0.1:{port}")
        core = KvHintCore(config)
        engine = FakeEngine(core, local_engine_info())
        core.attach(engine)
        engine.start()
        server = KvHintServer(core, config, metrics=KvHintMetrics(CollectorRegistry()))
        try:
            with pytest.raises(ConfigError, match="KVHINT_METRICS_ADDRESS"):
                server.start()
            assert not server._thread.is_alive(), "the gRPC server was stopped"
        finally:
            server.stop(grace=0.1)
            engine.stop()



@pytest.mark.parametrize("given", [["--scheduler_cls", "my.Scheduler"], ["--scheduler-cls=my.Scheduler"],
                                   ["--shutdown_timeout", "0"], ["--shutdown-timeout=0"]])
def test_kvhint_tiers_keeps_the_scheduler_and_shutdown_timeout_given_in_any_spelling_vllm_takes(given):
    """`--kvhint-tiers` adds --scheduler-cls and --shutdown-timeout only when missing. vLLM reads
    `--scheduler_cls` as `--scheduler-cls` (and the last of two wins), so the operator's value in
    that spelling must not be replaced by the launcher's."""
    from engine_integration.launcher import expand_tiers_flag

    args = expand_tiers_flag(["serve", "m", "--kvhint-tiers", "host=16", *given])
    name = given[0].split("=")[0].replace("_", "-")
    assert [a for a in args if a.split("=")[0].replace("_", "-") == name] == [given[0]], args


@pytest.mark.parametrize("given", [["--kv_transfer_config", '{"kv_connector": "X", "kv_role": "kv_both"}'],
                                   ["--kv-transfer-config.kv_connector=X"], ["--kv-transfer-config.kv_role", "kv_both"]])
def test_kvhint_tiers_refuses_a_kv_transfer_config_in_any_spelling_vllm_takes(given):
    """--kvhint-tiers is vLLM's --kv-transfer-config: one given too, as `--kv_transfer_config` or
    as a key of it (`--kv-transfer-config.KEY`, which vLLM applies after, replacing the tiers'),
    is refused, not silently dropped or left to replace the tiers."""
    from engine_integration.launcher import expand_tiers_flag

    with pytest.raises(SystemExit, match="exclusive"):
        expand_tiers_flag(["serve", "m", "--kvhint-tiers", "host=16", *given])


def test_a_rate_limit_burst_without_a_rate_is_refused_not_ignored():
    """KVHINT_RATE_LIMIT_HINTS_PER_S 0 (its default) limits nobody, so a KVHINT_RATE_LIMIT_BURST
    set alone would change nothing: refused naming both, as the tenants file refuses a burst
    without a rate."""
    message = _error({"KVHINT_RATE_LIMIT_BURST": "100"})
    assert "KVHINT_RATE_LIMIT_BURST" in message and "KVHINT_RATE_LIMIT_HINTS_PER_S" in message
    config = check_environment({"KVHINT_RATE_LIMIT_BURST": "100", "KVHINT_RATE_LIMIT_HINTS_PER_S": "10"})
    assert (config.rate_limit_hints_per_s, config.rate_limit_burst) == (10.0, 100)
    assert check_environment({"KVHINT_RATE_LIMIT_BURST": "0"}).rate_limit_burst == 0


def test_a_shutdown_grace_no_thread_can_wait_is_refused_at_start():
    """KvHintServer.stop waits for its thread the grace + 10 s; past threading.TIMEOUT_MAX that
    wait raises OverflowError, so such a grace was accepted at start and failed the shutdown."""
    import threading

    assert "KVHINT_SHUTDOWN_GRACE_S" in _error({"KVHINT_SHUTDOWN_GRACE_S": "1e10"})
    assert threading.TIMEOUT_MAX < 1e10
    server, engine = _server(address="127.0.0.1:0", shutdown_grace_s=3600.0)
    try:
        server.stop(grace=None)  # the configured grace: nothing in flight, so it returns at once
    finally:
        engine.stop()
