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
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from engine_pool import EnginePool, uses
from shared_engines import POOL

from conformance.runner import main as conformance
from conformance.testing.vllm_ci import KNOWN_FAILING
from engine_integration.served import EngineSpec, ServedEngine, default_model

pytestmark = pytest.mark.engine

TENANCY_CASES = 5  # conformance/cases/tenancy.py


@dataclass
class Tenanted:
    """The tiny model served with a tenants file: an admin ("ops") and tenants A and B."""

    served: ServedEngine
    admin: str
    token_a: str
    token_b: str
    directory: Path


def start_tenanted() -> Tenanted:
    admin, token_a, token_b = (secrets.token_hex(16) for _ in range(3))
    tenants = {"tenants": [
        {"name": "ops", "role": "admin", "tokens": [admin]},
        {"name": "team-a", "session_prefix": "team-a/", "tokens": [token_a], "pin_budget_blocks": 40},
        {"name": "team-b", "session_prefix": "team-b/", "tokens": [token_b], "retention_budget_blocks": 60},
    ]}  # fmt: skip
    directory = Path(tempfile.mkdtemp(prefix="kvhint-tenants-"))
    path = directory / "tenants.json"
    path.write_text(json.dumps(tenants))
    try:
        served = ServedEngine(EngineSpec(model=default_model("tiny"), env={"KVHINT_TENANTS_FILE": str(path)})).start()
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return Tenanted(served, admin, token_a, token_b, directory)


def stop_tenanted(t: Tenanted) -> None:
    t.served.stop()
    shutil.rmtree(t.directory, ignore_errors=True)


POOL.register("tenancy", start_tenanted, stop_tenanted, uses("tenanted"))


@pytest.fixture(scope="module")
def tenanted(engine_pool: EnginePool) -> Iterator[Tenanted]:
    with engine_pool.engine("tenancy") as t:
        yield t


def test_tenancy_cases_pass_against_a_served_engine(tenanted: Tenanted) -> None:
    engine = tenanted.served
    out = io.StringIO()
    rc = conformance([
        "--target", engine.grpc_address, "--openai-url", engine.http_url, "--token", tenanted.admin,
        "--tenant-a-token", tenanted.token_a, "--tenant-a-prefix", "team-a/",
        "--tenant-b-token", tenanted.token_b, "--tenant-b-prefix", "team-b/",
        "--known-failing", str(KNOWN_FAILING), "-v",
    ], out=out)  # fmt: skip
    text = out.getvalue()
    assert rc == 0, text[-3000:]
    tenancy = [c for c in re.findall(r"^PASSED\s+(\S+)", text, re.M) if "/tenancy/" in c]
    assert len(tenancy) == TENANCY_CASES, text[-3000:]
