"""Cases that a broken servicer used to pass (no engine): each test runs the real servicer over
the fake engine (tests/unit) behind a proxy that breaks the case's MUST, or configured so that
the case had nothing to check, and asserts the case FAILS where the servicer is broken (and
passes where it is not). Cases that need traffic get the fake OpenAI endpoint (fake_openai.py).

* events/heartbeat-carries-latest-sequence: heartbeats one sequence ahead of the latest event
  (a client resuming after one would miss an event) passed the check `sequence >= latest`.
* tenancy/cross-tenant-hints-have-no-effect and tenancy/list-sessions-own-namespace: on a
  target where tenant A held no session (any fresh target), B's hints on A's namespace could only
  be MISSING and no listing had a foreign session to show, so a servicer without isolation passed.
* clipping/{pin,retain}-ttl-capped: a protection QueryResidency reports without expires_at (no
  end) passed "expires no later than max_ttl from now".
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS / "unit"), str(TESTS / "client")]

from fake_openai import openai_over  # noqa: E402
from kvhint_unit_support import Harness, local_engine_info  # noqa: E402
from test_conformance_servicers import lines, run  # noqa: E402
from test_conformance_tenancy import TENANT_OPTIONS, TENANTS  # noqa: E402

from conformance.testing.fault_proxy import QUERY, FaultProxy  # noqa: E402
from kvhint.v1 import kvhint_pb2 as pb  # noqa: E402

S = "kvhint.v1/"


class HeartbeatAhead(FaultProxy):
    """Heartbeats carry the sequence after the latest (the next event's)."""

    def rewrite_event(self, raw: bytes, state: dict[str, Any]) -> bytes | None:
        message = pb.WatchEventsResponse.FromString(raw)
        if message.HasField("heartbeat"):
            message.sequence += 1
        return message.SerializeToString()


class EndlessProtection(FaultProxy):
    """QueryResidency reports retained and pinned blocks without expires_at."""

    def _unary(self, method: str, request: bytes, timeout: float | None) -> bytes:
        raw = super()._unary(method, request, timeout)
        if method != QUERY:
            return raw
        response = pb.QueryResidencyResponse.FromString(raw)
        for block in response.blocks:
            block.retention.ClearField("expires_at")
        return response.SerializeToString()


@pytest.fixture
def server() -> Iterator[Harness]:
    harness = Harness(local_engine_info(num_device_blocks=64))
    try:
        yield harness
    finally:
        harness.close()


def test_heartbeats_ahead_of_the_latest_sequence_fail(server: Harness) -> None:
    case = S + "events/heartbeat-carries-latest-sequence"
    rc, text = run(f"127.0.0.1:{server.port}", "--run", "heartbeat-carries", "-v")
    assert rc == 0 and f"PASSED        {case}" in text, text
    with HeartbeatAhead(f"127.0.0.1:{server.port}") as proxy:
        rc, text = run(proxy.address, "--run", "heartbeat-carries")
    assert rc == 1, text
    assert "heartbeats carry sequences at or past" in lines(text, "FAILED")[case], text


@pytest.mark.parametrize("action", ["pin", "retain"])
def test_a_protection_without_an_end_fails_the_ttl_cap(server: Harness, action: str) -> None:
    case = S + f"clipping/{action}-ttl-capped"
    with openai_over(server.engine) as url:
        rc, text = run(f"127.0.0.1:{server.port}", "--openai-url", url, "--run", f"{action}-ttl-capped", "-v")
        assert rc == 0 and f"PASSED        {case}" in text, text
        with EndlessProtection(f"127.0.0.1:{server.port}") as proxy:
            rc, text = run(proxy.address, "--openai-url", url, "--run", f"{action}-ttl-capped")
    assert rc == 1, text
    assert "reports no expires_at" in lines(text, "FAILED")[case], text


ISOLATION = (S + "tenancy/cross-tenant-hints-have-no-effect", S + "tenancy/list-sessions-own-namespace")


@pytest.fixture
def fresh_tenants(tmp_path: Path) -> Iterator[Harness]:
    """The servicer with the tenants file and no session of either tenant (a fresh target)."""
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(TENANTS))
    harness = Harness(local_engine_info(num_device_blocks=64), tenants_file=str(path))
    try:
        yield harness
    finally:
        harness.close()


def without_isolation() -> list[str]:
    """TENANT_OPTIONS with tenant B given the admin token (it sees and changes every session)."""
    options = list(TENANT_OPTIONS)
    options[options.index("tok-b")] = "tok-ops"
    options[options.index("tb/")] = "zz/"
    return options


def test_isolation_cases_store_sessions_to_check_on_a_fresh_target(fresh_tenants: Harness) -> None:
    address = f"127.0.0.1:{fresh_tenants.port}"
    with openai_over(fresh_tenants.engine) as url:
        rc, text = run(address, *TENANT_OPTIONS, "--openai-url", url, "-v")
        assert rc == 0 and all(f"PASSED        {case}" in text for case in ISOLATION), text
        rc, text = run(address, *without_isolation(), "--openai-url", url)
    assert rc == 1, text
    failed = lines(text, "FAILED")
    assert set(ISOLATION) <= set(failed), text


def test_isolation_cases_do_not_pass_having_checked_nothing(fresh_tenants: Harness) -> None:
    """Without an OpenAI endpoint no session can be stored: the cases skip, saying why, instead of passing."""
    rc, text = run(f"127.0.0.1:{fresh_tenants.port}", *without_isolation(), "-v")
    skipped = lines(text, "SKIPPED")
    for case in ISOLATION:
        assert "no --openai-url is given to store one" in skipped[case], text


def test_a_session_release_that_leaves_continuation_grants_fails(server: Harness) -> None:
    """release/session-release-ends-its-continuations-grants passes on the real servicer (the fake
    engine behind the fake OpenAI endpoint). The servicer before it kept a continuation's Retain
    after its session's Release, with nothing left that resolves the continuation; the same check
    on the executor of that time is tests/unit/test_release_continuations.py's."""
    case = S + "release/session-release-ends-its-continuations-grants"
    with openai_over(server.engine) as url:
        rc, text = run(f"127.0.0.1:{server.port}", "--openai-url", url, "--run", "session-release-ends", "-v")
    assert rc == 0 and f"PASSED        {case}" in text, text
