"""TLS material is checked when the configuration is (check_environment, before vLLM loads the
model), not when gRPC binds the port after the load: a key that is not the certificate's, a
certificate or key or client CA file that is PEM-shaped garbage, an encrypted key. The rule is
gRPC's own: the configuration refuses exactly the credentials gRPC cannot listen with (each case
below is also handed to a real gRPC server), naming the variable and never quoting the key. And
when gRPC does fail to bind (a port in use, credentials that changed since the check), the
sidecar's error names KVHINT_GRPC_ADDRESS and what to check, TLS included."""

from __future__ import annotations

import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from kvhint_unit_support import FakeEngine, local_engine_info
from tls_pki import Pki, make_pki, needs_openssl, openssl

from kvhint_server import KvHintCore, KvHintServer
from kvhint_server.config import ConfigError, ServerConfig, check_environment
from kvhint_server.server import GRPC_SERVER_OPTIONS

pytestmark = needs_openssl

CERT, KEY, CA = "KVHINT_TLS_CERT_FILE", "KVHINT_TLS_KEY_FILE", "KVHINT_TLS_CLIENT_CA_FILE"
GARBAGE_CERT = "-----BEGIN CERTIFICATE-----\nZ2FyYmFnZQ==\n-----END CERTIFICATE-----\n"  # the trial's garbage.pem
GARBAGE_KEY = "-----BEGIN PRIVATE KEY-----\nZ2FyYmFnZQ==\n-----END PRIVATE KEY-----\n"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    d = pki.dir
    pki.write("garbage_cert.pem", GARBAGE_CERT)
    pki.write("garbage_key.pem", GARBAGE_KEY)
    pki.write("combined.pem", pki.server_cert.read_bytes() + pki.server_key.read_bytes())
    pki.write("chain_with_garbage.pem", pki.server_cert.read_text() + GARBAGE_CERT)
    pki.write("ca_then_garbage.pem", pki.ca.read_text() + GARBAGE_CERT)
    pki.write("garbage_then_ca.pem", GARBAGE_CERT + pki.ca.read_text())
    pki.write("key_then_ca.pem", pki.server_key.read_text() + pki.ca.read_text())
    openssl(d, "pkey", "-in", "server.key", "-aes256", "-passout", "pass:secret", "-out", "encrypted.key")
    openssl(d, "pkey", "-in", "server.key", "-aes256", "-passout", "pass:", "-out", "empty_passphrase.key")
    # Weak by OpenSSL's default security level (which refuses it), served by gRPC's BoringSSL.
    openssl(d, "req", "-x509", "-newkey", "rsa:1024", "-sha1", "-nodes", "-keyout", "weak.key", "-out", "weak.pem",
            "-days", "2", "-subj", "/CN=localhost")
    return pki


# name -> (cert, key, client CA) file names in the PKI directory; "" for none.
CASES: dict[str, tuple[str, str, str]] = {
    "a certificate and its key": ("server.pem", "server.key", ""),
    "mTLS with the CA": ("server.pem", "server.key", "ca.pem"),
    "certificate and key in one file": ("combined.pem", "combined.pem", ""),
    "a 1024-bit RSA certificate signed with SHA-1": ("weak.pem", "weak.key", ""),
    # gRPC stops reading chain (and CA) certificates at the first that does not parse.
    "a chain whose second certificate is garbage": ("chain_with_garbage.pem", "server.key", ""),
    "a CA bundle whose second certificate is garbage": ("server.pem", "server.key", "ca_then_garbage.pem"),
    "a CA bundle after a key": ("server.pem", "server.key", "key_then_ca.pem"),
    # gRPC reads the key with an empty passphrase.
    "a key encrypted with an empty passphrase": ("server.pem", "empty_passphrase.key", ""),
    "another certificate's key": ("server.pem", "other.key", ""),
    "a garbage certificate": ("garbage_cert.pem", "server.key", ""),
    "a garbage key": ("server.pem", "garbage_key.pem", ""),
    "certificate and key swapped": ("server.key", "server.pem", ""),
    "an encrypted key": ("server.pem", "encrypted.key", ""),
    "a chain with garbage and another certificate's key": ("chain_with_garbage.pem", "other.key", ""),
    "a garbage client CA": ("server.pem", "server.key", "garbage_cert.pem"),
    "a CA bundle whose first certificate is garbage": ("server.pem", "server.key", "garbage_then_ca.pem"),
    "a key as the client CA": ("server.pem", "server.key", "server.key"),
}
# The variable a refusal names (the key's first: a mismatch names both).
BLAMED = {
    "another certificate's key": (KEY, CERT),
    "a garbage certificate": (CERT,),
    "a garbage key": (KEY,),
    "certificate and key swapped": (CERT,),
    "an encrypted key": (KEY,),
    "a chain with garbage and another certificate's key": (KEY, CERT),
    "a garbage client CA": (CA,),
    "a CA bundle whose first certificate is garbage": (CA,),
    "a key as the client CA": (CA,),
}


def grpc_can_listen(cert: Path, key: Path, ca: Path | None) -> bool:
    """Whether a gRPC server (KvHint's listener options) binds a port with these credentials."""
    pair = (key.read_bytes(), cert.read_bytes())
    server = grpc.server(ThreadPoolExecutor(1), options=list(GRPC_SERVER_OPTIONS))
    try:
        if ca is None:
            creds = grpc.ssl_server_credentials([pair])
        else:
            creds = grpc.ssl_server_credentials([pair], root_certificates=ca.read_bytes(), require_client_auth=True)
        return bool(server.add_secure_port("127.0.0.1:0", creds))
    except RuntimeError:  # "Failed to bind to address": how grpcio reports credentials it cannot use
        return False
    finally:
        server.stop(None)


def environ(pki: Pki, cert: str, key: str, ca: str = "") -> dict[str, str]:
    env = {CERT: str(pki.dir / cert), KEY: str(pki.dir / key)}
    if ca:
        env[CA] = str(pki.dir / ca)
    return env


@pytest.mark.parametrize("case", CASES)
def test_the_configuration_refuses_exactly_the_tls_material_grpc_cannot_listen_with(pki: Pki, case: str) -> None:
    cert, key, ca = CASES[case]
    grpc_ok = grpc_can_listen(pki.dir / cert, pki.dir / key, pki.dir / ca if ca else None)
    assert grpc_ok == (case not in BLAMED), f"{case}: gRPC {'listens' if grpc_ok else 'cannot listen'} (the table is wrong)"
    if grpc_ok:
        assert check_environment(environ(pki, cert, key, ca)).tls
        return
    with pytest.raises(ConfigError) as refused:
        check_environment(environ(pki, cert, key, ca))
    message = str(refused.value)
    for variable in BLAMED[case]:
        assert variable in message, message
    assert message.index(BLAMED[case][0]) == min(message.index(v) for v in (CERT, KEY, CA) if v in message), message
    key_body = [line for line in (pki.dir / key).read_text().splitlines() if line and not line.startswith("-----")]
    assert not any(line in message for line in key_body), "the message quotes key material"


def test_the_trials_refusals_say_what_is_wrong(pki: Pki) -> None:
    """The operator reads which file is wrong and how, not only its variable."""
    def refusal(cert: str, key: str, ca: str = "") -> str:
        with pytest.raises(ConfigError) as refused:
            check_environment(environ(pki, cert, key, ca))
        return str(refused.value)

    assert "does not match the certificate" in refusal("server.pem", "other.key")
    assert f"{CERT}=" in refusal("garbage_cert.pem", "server.key") and "not a readable certificate" in refusal("garbage_cert.pem", "server.key")
    assert "not a readable private key" in refusal("server.pem", "garbage_key.pem")
    assert "encrypted" in refusal("server.pem", "encrypted.key")
    assert "not a readable CA bundle" in refusal("server.pem", "server.key", "garbage_cert.pem")


def test_an_encrypted_key_is_refused_without_asking_for_its_passphrase(pki: Pki, monkeypatch) -> None:
    """OpenSSL's default for an encrypted key without a password callback is a prompt on the
    terminal: a launcher on a terminal would hang there. The check answers no passphrase."""
    import ssl

    loads: list[object] = []
    real = ssl.SSLContext.load_cert_chain

    def spy(self, certfile, keyfile=None, password=None):  # noqa: ANN001
        loads.append(password)
        return real(self, certfile, keyfile, password)

    monkeypatch.setattr(ssl.SSLContext, "load_cert_chain", spy)
    with pytest.raises(ConfigError, match=KEY):
        check_environment(environ(pki, "server.pem", "encrypted.key"))
    assert loads and all(callable(p) for p in loads), "a password callback keeps OpenSSL from prompting"


# ---------------------------------------------------------------- the bind failure's message


def start_server(config: ServerConfig) -> Callable[[], None]:
    """Start a KvHintServer over a FakeEngine; returns its stopper. Raises as `start` does."""
    core = KvHintCore(config)
    engine = FakeEngine(core, local_engine_info())
    core.attach(engine)
    engine.start()
    server = KvHintServer(core, config)
    try:
        server.start()
    except BaseException:
        engine.stop()
        raise

    def stop() -> None:
        server.stop(grace=0.1)
        engine.stop()
    return stop


def test_a_port_in_use_fails_the_start_naming_the_variable_and_what_to_check() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(RuntimeError) as failed:
            start_server(ServerConfig(address=address))
    message = str(failed.value)
    assert message.startswith(f"kvhint sidecar failed to start on {address}")
    assert "KVHINT_GRPC_ADDRESS" in message and "no other process listens on that port" in message
    assert "TLS" not in message  # without TLS there are no credentials to suspect


def test_with_tls_the_bind_failure_names_the_tls_files_too(pki: Pki, tmp_path: Path) -> None:
    """Credentials that were fine when the configuration was checked but changed before the
    sidecar started (a key rotated alone): gRPC says only "Failed to bind"."""
    key = tmp_path / "server.key"
    key.write_bytes(pki.server_key.read_bytes())
    config = ServerConfig(address="127.0.0.1:0", tls_cert_file=str(pki.server_cert), tls_key_file=str(key),
                          tls_client_ca_file=str(pki.ca))
    key.write_bytes(pki.other_key.read_bytes())
    with pytest.raises(RuntimeError) as failed:
        start_server(config)
    message = str(failed.value)
    assert "KVHINT_GRPC_ADDRESS" in message and "gRPC reports TLS credentials it cannot use as this same bind failure" in message
    assert all(v in message for v in (CERT, KEY, CA)), message
    # The same credentials restored: it serves.
    key.write_bytes(pki.server_key.read_bytes())
    start_server(config)()
