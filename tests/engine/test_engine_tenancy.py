"""Tenancy on a served engine: `vllm serve` with KVHINT_TENANTS_FILE (an admin and two tenants,
bearer tokens), and the whole conformance suite run against it, with the admin's token and both
tenants' credentials. The suite must pass, and every tenancy case must run and pass (none may
skip), so cross-tenant isolation holds on the real sidecar and engine, not only on the
fake-engine servicer (tests/unit/test_tenancy.py), and an admin keeps the whole protocol."""

from __future__ import annotations

import io
import json
import re
import secrets
from pathlib import Path

import pytest

from conformance.runner import main as conformance
from conformance.testing.vllm_ci import KNOWN_FAILING
from engine_integration.served import EngineSpec, ServedEngine

pytestmark = pytest.mark.engine

TENANCY_CASES = 5  # conformance/cases/tenancy.py


def test_tenancy_cases_pass_against_a_served_engine(tiny_model: str, tmp_path: Path) -> None:
    admin, token_a, token_b = (secrets.token_hex(16) for _ in range(3))
    tenants = {"tenants": [
        {"name": "ops", "role": "admin", "tokens": [admin]},
        {"name": "team-a", "session_prefix": "team-a/", "tokens": [token_a], "pin_budget_blocks": 40},
        {"name": "team-b", "session_prefix": "team-b/", "tokens": [token_b], "retention_budget_blocks": 60},
    ]}  # fmt: skip
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(tenants))
    with ServedEngine(EngineSpec(model=tiny_model, env={"KVHINT_TENANTS_FILE": str(path)})) as engine:
        out = io.StringIO()
        rc = conformance([
            "--target", engine.grpc_address, "--openai-url", engine.http_url, "--token", admin,
            "--tenant-a-token", token_a, "--tenant-a-prefix", "team-a/",
            "--tenant-b-token", token_b, "--tenant-b-prefix", "team-b/",
            "--known-failing", str(KNOWN_FAILING), "-v",
        ], out=out)  # fmt: skip
    text = out.getvalue()
    assert rc == 0, text[-3000:]
    tenancy = [c for c in re.findall(r"^PASSED\s+(\S+)", text, re.M) if "/tenancy/" in c]
    assert len(tenancy) == TENANCY_CASES, text[-3000:]
