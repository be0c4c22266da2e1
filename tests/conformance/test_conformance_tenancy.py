"""The tenancy conformance cases (conformance/cases/tenancy.py) against the real servicer over the
fake engine, with a tenants file: they pass with two tenants' credentials, and skip with a reason
naming the options without them. The case that needs traffic skips (no OpenAI endpoint here), and
the requirement case that checks traffic runs with it and fails, so such a run is not a pass."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS / "unit")]

from kvhint_unit_support import Harness, h, local_engine_info  # noqa: E402

from test_conformance_servicers import lines, run  # noqa: E402

S = "kvhint.v1/tenancy/"
TENANTS = {"tenants": [
    {"name": "a", "session_prefix": "ta/", "tokens": ["tok-a"]},
    {"name": "b", "session_prefix": "tb/", "tokens": ["tok-b"]},
    {"name": "ops", "role": "admin", "tokens": ["tok-ops"]},
]}
TENANT_OPTIONS = ("--token", "tok-ops", "--tenant-a-token", "tok-a", "--tenant-a-prefix", "ta/",
                  "--tenant-b-token", "tok-b", "--tenant-b-prefix", "tb/", "--run", "tenancy/")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Harness]:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(TENANTS))
    harness = Harness(local_engine_info(), tenants_file=str(path))
    try:
        harness.engine.store([h(1), h(2)], session="ta/existing")
        harness.engine.store([h(1), h(3)], session="tb/existing", prefix_hit=True)
        yield harness
    finally:
        harness.close()


REQUIREMENT = "kvhint.v1/requirements/token-id-prompts"


def test_tenancy_cases_pass_against_the_servicer_with_tenants(server: Harness) -> None:
    rc, text = run(f"127.0.0.1:{server.port}", *TENANT_OPTIONS)
    skipped = lines(text, "SKIPPED")
    assert set(skipped) == {S + "shared-prefix-not-evicted-by-other-tenant"}, text
    assert "openai" in skipped[S + "shared-prefix-not-evicted-by-other-tenant"].lower(), text
    # The skipped case's need is checked by its requirement case, which fails: not a pass.
    assert rc == 1 and set(lines(text, "FAILED")) == {REQUIREMENT}, text
    # Leaving out the case that needs an OpenAI endpoint leaves out its requirement too.
    rc, text = run(f"127.0.0.1:{server.port}", *TENANT_OPTIONS, "--skip", "shared-prefix")
    assert rc == 0 and not lines(text, "FAILED") and not lines(text, "SKIPPED"), text


def test_tenancy_cases_fail_against_a_servicer_without_isolation(server: Harness) -> None:
    """The same run with tenant B given the admin token (no isolation) fails the isolation cases."""
    options = list(TENANT_OPTIONS)
    options[options.index("tok-b")] = "tok-ops"
    options[options.index("tb/")] = "zz/"
    rc, text = run(f"127.0.0.1:{server.port}", *options)
    assert rc == 1, text
    failed = set(lines(text, "FAILED"))
    assert {S + "cross-tenant-hints-have-no-effect", S + "list-sessions-own-namespace",
            S + "foreign-query-and-watch-denied"} <= failed, text


def test_tenancy_cases_skip_without_tenant_options(server: Harness) -> None:
    rc, text = run(f"127.0.0.1:{server.port}", "--token", "tok-ops", "--run", "tenancy/")
    assert rc == 1 and set(lines(text, "FAILED")) == {REQUIREMENT}, text
    skipped = lines(text, "SKIPPED")
    assert set(skipped) == {S + n for n in ("unknown-token-unauthenticated", "cross-tenant-hints-have-no-effect",
                                            "list-sessions-own-namespace", "foreign-query-and-watch-denied",
                                            "shared-prefix-not-evicted-by-other-tenant")}, text
    assert all("--tenant-a-token" in reason for name, reason in skipped.items()
               if not name.endswith("shared-prefix-not-evicted-by-other-tenant")), skipped
