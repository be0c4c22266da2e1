"""The Go and Rust router stubs build offline from the committed proto and
pass their own tests (the Go example's in-process gRPC round trip; the Rust
crate's encode/decode tests). The Go binary is exercised against the real
engine in tests/engine/test_engine_client.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kvhint.v1 import kvhint_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]


def build(section: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(ROOT / "tools" / "build_stubs.sh"), section], capture_output=True, text=True, timeout=900, cwd=ROOT)


@pytest.mark.skipif(shutil.which("go") is None, reason="Go toolchain not installed (Debian golang-go)")
def test_go_stub_builds_vets_and_round_trips() -> None:
    out = build("go")
    assert out.returncode == 0, out.stdout + out.stderr
    assert (ROOT / "build" / "bin" / "kvhint-capabilities").exists()


@pytest.mark.skipif(shutil.which("cargo") is None or not Path("/usr/share/cargo/registry").is_dir(), reason="cargo or Debian's Rust crates missing")
def test_rust_messages_build_and_interoperate_with_python() -> None:
    out = build("rust")
    assert out.returncode == 0, out.stdout + out.stderr
    example = subprocess.run(
        ["cargo", "run", "--offline", "--quiet", "--example", "encode_hint"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT / "gen" / "rust",
    )
    assert example.returncode == 0, example.stderr
    encoded = bytes.fromhex(example.stdout.splitlines()[0].rsplit("bytes: ", 1)[1])
    request = pb.ApplyHintsRequest.FromString(encoded)  # Rust-encoded, Python-decoded
    assert request.hints[0].retain.ttl.seconds == 300
    assert request.hints[0].selector.session.session_id == "session-a"
    assert request.SerializeToString() == encoded
