"""The CLI's word for a TLS connection that fails. gRPC's UNAVAILABLE detail is the error of the
last address it tried: `localhost` is ::1 and 127.0.0.1, and against a server on 127.0.0.1 a wrong
--ca-cert or a missing client certificate read "connection refused" (::1's) while the server was
listening. With TLS the message now says a failed handshake shows that way and what to check, and
a detail that names the handshake's failure is reported as one; the exit code stays 3. And
`--cert` without `--key` names the flags, not TlsConfig's Python arguments."""

from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from kvhint_unit_support import Harness, local_engine_info  # noqa: E402
from tls_pki import Pki, make_pki  # noqa: E402

from kvhint_client import cli  # noqa: E402
from kvhint_client.cli.context import EXIT_UNAVAILABLE, CliContext, describe_error  # noqa: E402
from kvhint_client.errors import KvHintError  # noqa: E402


def kvhint(*argv: str) -> subprocess.CompletedProcess[str]:
    """The CLI in this process, stdout and stderr captured."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return subprocess.CompletedProcess(["kvhint", *argv], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if __import__("shutil").which("openssl") is None:
        pytest.skip("needs the openssl CLI to make certificates")
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def mtls_server(pki: Pki) -> Iterator[int]:
    """A KvHint server on 127.0.0.1 (not ::1) that requires a client certificate from the PKI's CA."""
    hx = Harness(local_engine_info(), tls_cert_file=str(pki.server_cert), tls_key_file=str(pki.server_key),
                 tls_client_ca_file=str(pki.ca))
    try:
        yield hx.port
    finally:
        hx.close()


def test_the_right_credentials_work(pki: Pki, mtls_server: int) -> None:
    run = kvhint("--address", f"localhost:{mtls_server}", "--ca-cert", str(pki.ca), "--cert", str(pki.client_cert),
                 "--key", str(pki.client_key), "--timeout", "5", "capabilities")
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1"])
def test_a_wrong_ca_cert_is_not_reported_as_a_plain_connection_refused(pki: Pki, mtls_server: int, host: str) -> None:
    run = kvhint("--address", f"{host}:{mtls_server}", "--ca-cert", str(pki.other_cert), "--cert", str(pki.client_cert),
                 "--key", str(pki.client_key), "--timeout", "5", "--retries", "0", "capabilities")
    assert run.returncode == EXIT_UNAVAILABLE
    line = run.stderr.strip()
    assert line.startswith(f"kvhint: cannot reach the KvHint server at {host}:{mtls_server}:"), line
    assert "--ca-cert" in line and "--server-name" in line and "--cert/--key" in line, line
    if host == "127.0.0.1":  # one address: its error is the handshake's, and says so
        assert "the TLS handshake failed: the server's certificate is not signed by a CA in --ca-cert" in line, line
    else:  # ::1's refusal or 127.0.0.1's handshake, whichever gRPC tried last
        assert "TLS handshake failed" in line or "a failed handshake" in line, line


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1"])
def test_no_client_certificate_against_mtls_names_the_client_certificate(pki: Pki, mtls_server: int, host: str) -> None:
    run = kvhint("--address", f"{host}:{mtls_server}", "--ca-cert", str(pki.ca), "--timeout", "5", "--retries", "0",
                 "capabilities")
    assert run.returncode == EXIT_UNAVAILABLE
    line = run.stderr.strip()
    assert "a missing or untrusted client certificate" in line or "TLS handshake failed" in line, line
    assert "--cert/--key" in line, line


def test_a_certificate_for_another_name_says_so(pki: Pki, mtls_server: int) -> None:
    run = kvhint("--address", f"127.0.0.1:{mtls_server}", "--ca-cert", str(pki.ca), "--cert", str(pki.client_cert),
                 "--key", str(pki.client_key), "--server-name", "kvhint.example", "--timeout", "5", "--retries", "0",
                 "capabilities")
    assert run.returncode == EXIT_UNAVAILABLE
    assert "the server's certificate is not for the name dialled (--server-name" in run.stderr, run.stderr


def describe(details: str, *argv: str) -> tuple[str, int]:
    parser = argparse.ArgumentParser()
    for flag in ("--ca-cert", "--cert", "--key", "--server-name"):
        parser.add_argument(flag)
    parser.add_argument("--tls", action="store_true")
    parser.add_argument("--address", default="localhost:18210")
    ctx = CliContext(parser.parse_args(list(argv)))
    return describe_error(KvHintError(grpc.StatusCode.UNAVAILABLE, details, method="GetCapabilities"), ctx)


REFUSED = "failed to connect to all addresses; last error: UNKNOWN: ipv6:%5B::1%5D:18210: Failed to connect to remote host: Connection refused"
CLOSED = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:18210: Socket closed"
WRONG_VERSION = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:18210: Tls handshake failed "
                 "(TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:100000f7:SSL routines:OPENSSL_internal:WRONG_VERSION_NUMBER")


def test_the_trials_details_read_as_tls_problems_only_with_tls() -> None:
    """gRPC's details as the trial saw them."""
    message, code = describe(REFUSED)
    assert (message, code) == ("cannot reach the KvHint server at localhost:18210: connection refused", EXIT_UNAVAILABLE)
    message, code = describe(REFUSED, "--ca-cert", "ca.pem")
    assert code == EXIT_UNAVAILABLE and message.startswith("cannot reach the KvHint server at localhost:18210: connection refused. ")
    assert "With TLS a failed handshake (a wrong --ca-cert" in message
    message, _ = describe(CLOSED, "--tls")
    assert "With TLS a failed handshake" in message and "missing or untrusted client certificate" in message
    message, _ = describe(WRONG_VERSION, "--tls")
    assert "the TLS handshake failed: the server may not serve TLS" in message
    # Without TLS a closed socket may be a TLS server refusing plaintext.
    message, _ = describe(CLOSED)
    assert "a server that serves TLS closes a plaintext connection like this: try --tls or --ca-cert" in message


@pytest.mark.parametrize(("given", "missing"), [("--cert", "--key"), ("--key", "--cert")])
def test_half_a_client_certificate_names_the_flags(pki: Pki, given: str, missing: str) -> None:
    path = pki.client_cert if given == "--cert" else pki.client_key
    run = kvhint("--address", "127.0.0.1:1", given, str(path), "capabilities")
    assert run.returncode == 2
    assert f"{given} needs {missing}" in run.stderr and "certificate_chain" not in run.stderr, run.stderr
