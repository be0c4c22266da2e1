"""scripts/gpu_check.sh runs unchanged on CPU (`--cpu --quick`), end to end, on the hybrid model
(the dense model's serve, conformance, identity and step-overhead paths are the same code, and the
rest of the engine suite covers them on both models): it is served with the KvHint sidecar, passes
the conformance subset, the identity test passes and the step-overhead benchmark reports its
ratios, all in one results file. Both models took 5.5 minutes in the full suite on this 2-core
machine, so CI runs one; `scripts/gpu_check.sh --cpu --quick` runs both."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from engine_integration.served import DTYPE_ENV, EXECUTOR_ENV

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(1200)
def test_gpu_check_runs_on_cpu_and_writes_one_results_file(tmp_path: Path) -> None:
    # Without tests/conftest.py's KVHINT_ENGINE_DTYPE and KVHINT_ENGINE_EXECUTOR: --cpu itself serves
    # float32 with the model in EngineCore's process (scripts/gpu_check.sh).
    env = {k: v for k, v in os.environ.items() if k not in (DTYPE_ENV, EXECUTOR_ENV)}
    proc = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh"), "--cpu", "--quick", "--models", "hybrid", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=1100, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "gpu_check_results.json").read_text())
    text = (tmp_path / "gpu_check_results.md").read_text()
    assert data["ok"] and "Overall: **PASS**" in text
    assert data["platform"]["mode"] == "cpu" and data["platform"]["enforce_eager"] is True
    assert data["platform"]["engine_dtype"] == "float32" and "dtype float32 (KVHINT_ENGINE_DTYPE)" in text
    assert data["platform"]["engine_executor"] == "uni" and "executor uni (KVHINT_ENGINE_EXECUTOR)" in text
    # The model ran in EngineCore's process: vLLM's multiprocess executor logs as VllmWorker.
    assert "VllmWorker" not in (tmp_path / "serve_hybrid.log").read_text()
    # The GPU's bookkeeping (deferred: what `auto` picks on a GPU), so the conformance
    # suite and the identity test below ran against it.
    assert data["platform"]["residency_bookkeeping"] == "deferred" and "residency bookkeeping deferred" in text
    assert set(data["models"]) == {"hybrid"}
    # The 10-minute limit is the GPU run's: reported with --cpu (no budget), not part of the verdict.
    assert data["wall_limit_enforced"] is False and data["budget_s"] is None and not data["skipped_for_time"]
    assert "Total wall time" in text and "(limit 600 s)" in text and "reported only" in text
    for model, steps in data["models"].items():
        by_name = {s["name"].split(" (")[0]: s for s in steps}
        serve = by_name["serve"]
        assert serve["status"] == "pass", serve
        assert serve["details"]["async_scheduling"] is False, "vLLM forces async scheduling off on CPU"
        assert "forces async scheduling off" in serve["summary"]
        # The sidecar's own evidence: KvHint's scheduler logged deferred bookkeeping and booked
        # residency changes off the engine thread during the conformance suite's traffic.
        assert serve["details"]["bookkeeping_logged"] == "deferred", serve
        assert serve["details"]["residency_deferred_total"] > 0, serve
        assert by_name["conformance suite"]["status"] == "pass", by_name["conformance suite"]
        assert by_name["conformance suite"]["summary"].startswith("PASS")
        assert by_name["identity test"]["status"] == "pass", by_name["identity test"]
        assert any(f"[{model}]" in t for t in by_name["identity test"]["details"]["tests"]), by_name["identity test"]
        overhead = by_name["step overhead"]
        assert overhead["status"] == "pass" and overhead["details"]["rows"], overhead
        # --cpu runs the benchmark's engines eager too, as the GPU bundle does (scripts/gpu_check.sh).
        assert overhead["details"]["enforce_eager"] is True, overhead
        # The benchmark records the model it ran (not --preset's default) and the engines' settings.
        assert overhead["details"]["preset"] == model and overhead["details"]["architecture"] == "Gemma2ForCausalLM"
        assert overhead["details"]["max_num_seqs"] == 16
        assert "generated `hybrid` preset (Gemma2ForCausalLM)" in (tmp_path / overhead["details"]["result_file"]).read_text()
        assert (tmp_path / overhead["details"]["result_file"]).exists()
        # Its raw per-step timings stay with the results, not among the repository's committed ones.
        assert (tmp_path / "bench" / "results" / "step_overhead" / f"step_overhead_{model}.csv").exists()
        assert not (ROOT / "bench" / "results" / "step_overhead" / f"step_overhead_{model}.csv").exists()
