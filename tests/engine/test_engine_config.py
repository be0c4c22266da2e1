"""Bad configuration fails fast and loud on the real command (issue 14, item 4):
`kvhint-vllm serve MODEL --scheduler-cls ...KvHintScheduler ...` (the command
the engine tests serve with) with an invalid KVHINT_* value exits non-zero
within seconds, before vLLM loads the model, and says which variable is wrong."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from engine_integration.served import EngineSpec, ServedEngine

pytestmark = pytest.mark.engine

# Loading the model alone takes 40+ s on this machine; the refusal comes long before.
FAST_S = 10.0


@pytest.mark.parametrize(
    "bad",
    [
        {"KVHINT_MAX_TTL_S": "nan"},
        {"KVHINT_PIN_BUDGET_FRACTION": "1.5"},
        {"KVHINT_TLS_CERT_FILE": "/etc/hostname"},  # no key
        {"KVHINT_GRPC_ADDRESS": "0.0.0.0:50999"},  # no token, no TLS, no opt-in
    ],
    ids=lambda bad: next(iter(bad)),
)
def test_serve_with_a_bad_kvhint_value_exits_at_once_naming_it(tiny_model: str, bad: dict[str, str]) -> None:
    command = ServedEngine(EngineSpec(model=tiny_model)).command()
    env = {**os.environ, "KVHINT_GRPC_ADDRESS": "127.0.0.1:50998", **bad}
    started = time.monotonic()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-2000:]
    assert next(iter(bad)) in output, output[-2000:]
    assert elapsed < FAST_S, f"refused after {elapsed:.1f}s"
