"""The hint policy in the two-phase model of an engine run: what `kvhint_client.policy` would
save if the engine did exactly what the model says, with the requests overlapping as they did.

`bench.agentic_engine` reports the policy's share of Belady's savings on the real engine (run
c2) next to the same policy in the sequential simulator, and the two can differ a lot (908a119's
run: 0.18 of Belady's savings, 0.30 of the overlapped Belady's, against 0.55 sequentially on
the default trace), partly because (c2) and run (a) do not share a timeline. This tool
separates the causes. For each recorded engine repeat it takes that repeat's own request
times (send, admission, completion) and runs, on the same timeline:

* LRU (`lru_timeline`), the model the LRU validation checks against the engine;
* Belady-MIN (`belady_timeline`, victims by next use in admission order);
* the policy (`policy_timeline`): `bench.policy.LibraryPolicy` fed the replay's signals at the
  times the replay sent them (a request's signals at its completion, as
  `bench.agentic_driver.HintDriver` does), its hints applied at once to `bench.simulate.HintedPool`'s
  free-block classes, whose order picks the victims;
* the same policy with every pause predicted by its true end (clairvoyant, not causal).

On a policy repeat (c2) the policy's model is compared request by request with the engine, as
the LRU validation compares run (a): if they agree, the engine did what the model did and the
gap to the sequential simulator comes from the overlap itself; if not, something of the
engine's (hint latency, the order of frees, decode-time allocation) is lost in the model.

``python -m bench.policy_timeline DIR [DIR ...] [--out FILE.md]`` (DIR: a `bench.agentic_engine`
results directory with policy runs; writes FILE.md and FILE.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.agentic_plan import ReplayPlan, build_plan
from bench.agentic_report import (
    admission_times,
    belady_timeline,
    completion_times,
    compare,
    load_report,
    lru_timeline,
    timeline_summary,
)
from bench.policy import Action, LibraryPolicy
from bench.simulate import BlockPoolModel, BlockTrace, HintedPool, compile_trace
from bench.trace import Trace

DEVICE_RUNS = ("lru", "policy")  # recorded engine runs this tool models (device tier only)


@dataclasses.dataclass(frozen=True)
class RunTimes:
    """One engine repeat's clock, in seconds since its replay started (the driver's clock)."""

    send: list[float]
    admit: list[float]
    finish: list[float]

    @classmethod
    def of(cls, run: Any) -> RunTimes:
        recs = sorted(run.records, key=lambda r: r.index)
        failed = [r.request_id for r in recs if r.error is not None]
        if failed:
            raise ValueError(f"run {run.spec.name}: {len(failed)} requests failed (first {failed[0]}); "
                             "a repeat without every request's times cannot be modelled")
        offset = statistics.median(r.wall_send - r.t_send for r in recs)  # wall clock -> replay clock
        return cls([r.t_send for r in recs], [t - offset for t in admission_times(run)],
                   [t - offset for t in completion_times(run)])


class _PolicyObserver:
    """Feeds a timeline's admissions and completions to the policy and its hints to the pool's
    classes, as the engine replay's driver does (`bench.agentic_driver.HintDriver`)."""

    def __init__(self, bt: BlockTrace, plan: ReplayPlan, hp: HintedPool, pol: Any) -> None:
        self.bt, self.plan, self.hp, self.pol = bt, plan, hp, pol

    def apply(self, actions: Sequence[Action], t: float) -> None:
        for a in actions:
            self.hp.apply(a, t)

    def at(self, t: float) -> None:
        self.hp.now = max(self.hp.now, t)

    def admitted(self, i: int, t: float) -> None:
        self.hp.note_running(self.bt.requests[i])

    def completed(self, i: int, t: float) -> None:
        sid = self.bt.requests[i].session_id
        self.pol.completed(sid, t)
        signals = self.plan.signals_after[i]
        if not signals:
            self.apply(self.pol.tick(t), t)
        for sig in signals:
            self.apply(self.pol.observe(dataclasses.replace(sig, t=t)), t)

    def send(self, i: int) -> Callable[[float], None]:
        sid = self.bt.requests[i].session_id
        return lambda t: self.apply(self.pol.request(sid, t), t)


def policy_timeline(trace: Trace, bt: BlockTrace, times: RunTimes, *, clairvoyant: bool = False,
                    pin_budget_fraction: float = 0.5, pause_state: Mapping[str, Any] | None = None,
                    queue: bool = True, policy: Any = None,
                    config: Mapping[str, Any] | None = None) -> tuple[list[int | None], dict[str, int]]:
    """`kvhint_client.policy` (through `bench.policy.LibraryPolicy`) on the two-phase timeline
    of one engine repeat: cached tokens per request (trace order) and the timeline's counters.
    `clairvoyant`: every pause predicted by its true end (each session's recorded send times).
    `policy`: another object with LibraryPolicy's methods instead (start, request, completed,
    observe, tick). `config`: fields of the policy's configuration that differ from
    `bench.policy.library_config` (e.g. the engine run's code had another default)."""
    plan = build_plan(trace)
    pool = BlockPoolModel(bt.num_gpu_blocks)
    hp = HintedPool(bt, None, pin_budget_fraction)
    hp.pool = pool
    starts: dict[str, list[float]] | None = None
    if clairvoyant:
        starts = {}
        for r, t in zip(bt.requests, times.send):
            starts.setdefault(r.session_id, []).append(t)
    cfg = dataclasses.replace(bt.library_config, **(config or {}))
    pol = policy or LibraryPolicy(cfg, bt.shared_prefix_target, starts, pause_state)
    obs = _PolicyObserver(bt, plan, hp, pol)
    obs.apply(pol.start(0.0), 0.0)
    timed: list[tuple[float, Callable[[float], None]]] = [(times.send[i], obs.send(i)) for i in range(len(bt.requests))]
    timed += [(sig.t, lambda t, sig=sig: obs.apply(pol.observe(dataclasses.replace(sig, t=t)), t))
              for sig in plan.timed_signals]
    cached, stats = lru_timeline(bt, times.admit, times.finish, lambda p, n, i: hp.choose(p, n, bt.requests[i]),
                                 queue=queue, pool=pool, observer=obs, timed=timed)
    inner = getattr(pol, "policy", None)  # LibraryPolicy's SessionPolicy
    if inner is not None:
        stats["hints_sent"] = inner.stats.get("sent", 0)
    return cached, stats


def _share(lru: int, belady: int, x: float) -> float:
    return (lru - x) / (lru - belady) if lru > belady else math.nan


def model_repeat(trace: Trace, run: Any, pin_budget_fraction: float = 0.5,
                 config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One engine repeat against the models on its own timeline (`config`: see `policy_timeline`)."""
    bt = compile_trace(trace, outputs=run.outputs)
    times = RunTimes.of(run)
    by_idx = sorted(run.records, key=lambda r: r.index)
    engine = [r.cached_tokens for r in by_idx]
    timelines = {
        "lru": lru_timeline(bt, times.admit, times.finish, queue=True),
        "belady": belady_timeline(bt, times.admit, times.finish, queue=True),
        "policy": policy_timeline(trace, bt, times, pin_budget_fraction=pin_budget_fraction, config=config),
        "clairvoyant": policy_timeline(trace, bt, times, pin_budget_fraction=pin_budget_fraction, clairvoyant=True,
                                       config=config),
    }
    rec = {name: timeline_summary(bt, *t)["recomputed_tokens"] for name, t in timelines.items()}
    policy, pstats = timelines["policy"]
    lru = timelines["lru"][0]
    eng = sum(r.prompt_tokens - r.cached_tokens for r in by_idx)
    model = policy if run.spec.name == "policy" else lru
    ids = [r.request_id for r in by_idx]
    return {
        "run": run.spec.name,
        "engine_recomputed": eng,
        "model_recomputed": rec,
        "queued_admissions": pstats["no_room"],
        "policy_hints_sent": pstats["hints_sent"],
        "share_in_model": {k: _share(rec["lru"], rec["belady"], rec[k]) for k in ("policy", "clairvoyant")},
        "engine_share_in_model": _share(rec["lru"], rec["belady"], eng),
        "validation": {k: v for k, v in compare(engine, model, ids).items() if k != "first_mismatches"},
    }


def analyze_dir(d: str | Path, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    rep = load_report(d, offline=False)  # the runs only: the models here are on each run's timeline
    pin = float(rep.capabilities.get("pin_budget_fraction") or 0.5)
    rows = []
    for name in DEVICE_RUNS:
        for k, run in enumerate(rep.runs.get(name, [])):
            rows.append({"repeat": k + 1, **model_repeat(rep.trace, run, pin, config)})
    return {"dir": str(d), "command": rep.command, "engine_commit": (rep.code_version or {}).get("commit"),
            "policy_overrides": dict(config or {}),
            "num_gpu_blocks": rep.trace.header.num_gpu_blocks, "repeats": rows}


def markdown(results: Sequence[dict[str, Any]], command: str) -> str:
    out = [
        "# The hint policy in the two-phase model of each engine repeat",
        "",
        f"Command: `{command}`.",
        "",
        "Each engine repeat's own request times (send, admission, completion) drive the two-phase "
        "model (a request holds its blocks from admission to completion; an admission that finds no "
        "room waits for a completion). On that timeline: LRU, Belady-MIN, kvhint_client.policy (causal; "
        "signals at the times the replay sent them, hints in effect at once) and the same policy with "
        "every pause predicted by its true end. Recomputed prompt tokens; share = (LRU - x) / (LRU - Belady), "
        "all on the same timeline. Validation: requests whose cached tokens the model (LRU for an LRU "
        "repeat, the policy for a policy repeat) gets exactly as the engine did. Hints: what the "
        "modelled policy sent.",
        "",
        "The engine's share puts the engine's recomputed tokens against the model's LRU and Belady on "
        "the same timeline: on an LRU repeat it shows the model's error (0 is exact), on a policy repeat "
        "what the engine's run saved against LRU under the same overlap.",
    ]
    for res in results:
        out += [
            "",
            f"## `{res['dir']}`",
            "",
            f"Engine results of `{res['command']}`, engine code {str(res['engine_commit'])[:7]}; "
            f"pool {res['num_gpu_blocks']} blocks. The model runs this checkout's policy"
            + ("" if not res["policy_overrides"] else " with " + ", ".join(
                f"{k}={json.dumps(v)}" for k, v in sorted(res["policy_overrides"].items())))
            + "; the engine's policy repeats ran that commit's.",
            "",
            "| engine run | repeat | engine recomputed | model: LRU | Belady | policy | clairvoyant policy | engine's share | model policy's share | clairvoyant share | requests matched (model vs engine) | hints (model policy) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in res["repeats"]:
            m, s, v = r["model_recomputed"], r["share_in_model"], r["validation"]
            out.append(
                f"| {r['run']} | {r['repeat']} | {r['engine_recomputed']} | {m['lru']} | {m['belady']} | {m['policy']} | "
                f"{m['clairvoyant']} | {r['engine_share_in_model']:.2f} | {s['policy']:.2f} | {s['clairvoyant']:.2f} | "
                f"{v['matched']}/{v['requests']} | {r['policy_hints_sent']} |"
            )
    return "\n".join(out) + "\n"


def _policy_overrides(ap: argparse.ArgumentParser, items: Sequence[str]) -> dict[str, Any]:
    from kvhint_client.policy import PolicyConfig

    known = {f.name for f in dataclasses.fields(PolicyConfig)}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or key not in known:
            ap.error(f"--policy-set {item}: expected FIELD=JSON with FIELD one of {', '.join(sorted(known))}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError as err:
            ap.error(f"--policy-set {item}: the value is not JSON ({err})")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.policy_timeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", metavar="DIR", help="bench.agentic_engine results directories")
    ap.add_argument("--out", help="write OUT (markdown) and OUT with .json")
    ap.add_argument("--policy-set", action="append", default=[], metavar="FIELD=JSON",
                    help="a kvhint_client.policy.PolicyConfig field for the modelled policy (repeatable), "
                         "e.g. keep_while_running=false for the policy an older engine run ran")
    args = ap.parse_args(argv)
    config = _policy_overrides(ap, args.policy_set)
    results = [analyze_dir(d, config) for d in args.dirs]
    command = "python -m bench.policy_timeline " + " ".join(argv if argv is not None else sys.argv[1:])
    text = markdown(results, command)
    if args.out:
        out = Path(args.out)
        out.write_text(text)
        out.with_suffix(".json").write_text(json.dumps({"generated_by": command, "results": results}, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
