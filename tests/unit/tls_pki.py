"""A throwaway PKI for TLS tests, made with the openssl CLI (as tests/unit/test_tenancy.py's mTLS
test makes its own): a CA, a server certificate it signed (localhost and 127.0.0.1), a client
certificate it signed (CN client-a), and a self-signed pair from no CA. EC P-256 keys: a few
milliseconds each. Tests that use it carry `needs_openssl`."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make certificates")

_EC = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


def openssl(cwd: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@dataclass(frozen=True)
class Pki:
    dir: Path
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_cert: Path  # self-signed: no CA of this PKI signed it
    other_key: Path

    def write(self, name: str, text: str | bytes) -> Path:
        path = self.dir / name
        path.write_bytes(text.encode() if isinstance(text, str) else text)
        return path


def make_pki(directory: Path) -> Pki:
    d = directory
    openssl(d, "req", "-x509", *_EC, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=kvhint-test-ca")
    for name, subj, ext in (("server", "/CN=localhost", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
                            ("client", "/CN=client-a", "extendedKeyUsage=clientAuth")):
        openssl(d, "req", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subj)
        (d / f"{name}.ext").write_text(ext + "\n")
        openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")
    openssl(d, "req", "-x509", *_EC, "-keyout", "other.key", "-out", "other.pem", "-days", "2", "-subj", "/CN=localhost")
    return Pki(d, d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key",
               d / "other.pem", d / "other.key")
