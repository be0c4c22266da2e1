"""Command line: ``python -m bench <command>`` (the lead can mount `main` as
``kvhint bench``).

  generate  --preset default --seed 0 [--set concurrency=4 --set turns=[3,8]] -o trace.jsonl
  analyze   TRACE.jsonl | --trace TRACE.jsonl [--num-gpu-blocks N] [--pin-budget 0.5] [--async-scheduling] [--no-tiers] [--json]
            side by side on one trace (yours or generated): (a) LRU, (b) the earlier reference
            policy, (c) kvhint_client.policy, (d) Belady, (e) infinite cache, and the tier runs
            (f, g) on a host tier as large as the device pool
  headroom  --preset default --seeds 0,1,2 [--set ...]    analyze several generated traces
  policy    TRACE.jsonl | --trace TRACE.jsonl [--no-release]                    the reference policy's actions, JSON lines
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from typing import Any

from bench.generate import PRESETS, TraceParams, generate_trace
from bench.policy import PolicyConfig, action_to_json, run_policy, shared_prefix_target
from bench.simulate import analyze
from bench.trace import Trace, TraceError


class UsageError(ValueError):
    """A bad command-line value (reported as `python -m bench CMD: error: ...`, exit 2)."""


def _same_kind(value: Any, default: Any) -> bool:
    if default is None:
        return True
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, type(default))


def _params(preset: str, sets: list[str]) -> TraceParams:
    p = PRESETS[preset]
    fields = TraceParams.__dataclass_fields__
    kw: dict[str, Any] = {}
    for s in sets:
        key, eq, val = s.partition("=")
        if not eq:
            raise UsageError(f"--set {s!r}: expected KEY=JSON, e.g. --set concurrency=4")
        if key not in fields:
            raise UsageError(f"--set {key}: unknown parameter (known: {', '.join(sorted(fields))})")
        try:
            v = json.loads(val)
        except json.JSONDecodeError as e:
            raise UsageError(f"--set {key}={val}: the value is not JSON ({e.msg}); a string needs quotes, "
                             f"e.g. --set {key}='\"{val}\"'") from None
        if isinstance(v, list):  # ranges and the tools table: tuples, as in TraceParams
            v = tuple(tuple(x) if isinstance(x, list) else x for x in v)
        default = getattr(p, key)
        if not _same_kind(v, default):
            raise UsageError(f"--set {key}={val}: expected a value like the preset's {json.dumps(default)}")
        kw[key] = v
    params = replace(p, **kw)
    try:
        params.validate()
    except (ValueError, TypeError) as e:
        raise UsageError(f"--set: {e}") from None
    return params


def _cmd_generate(a: argparse.Namespace) -> int:
    tr = generate_trace(_params(a.preset, a.set), a.seed, preset=a.preset)
    if a.output == "-":
        sys.stdout.write(tr.dumps())
    else:
        tr.save(a.output)
        print(f"wrote {a.output}: {json.dumps(tr.header.stats)} num_gpu_blocks={tr.header.num_gpu_blocks}",
              file=sys.stderr)
    return 0


def _load(a: argparse.Namespace) -> Trace:
    tr = Trace.load(a.trace)
    tr.validate()
    return tr


def _cmd_analyze(a: argparse.Namespace) -> int:
    tr = _load(a)
    tr.header.pool_blocks(a.num_gpu_blocks)  # a clear error before the simulator's
    t0 = time.perf_counter()
    res = analyze(tr, num_gpu_blocks=a.num_gpu_blocks, pin_budget_fraction=a.pin_budget,
                  async_scheduling=a.async_scheduling, tiers=not a.no_tiers)
    dt = time.perf_counter() - t0
    if a.json:
        print(json.dumps({**res.to_json(), "seconds": round(dt, 3)}, indent=2))
    else:
        print(res.table())
        print(f"(simulated in {dt:.2f}s)")
    return 0


def _cmd_headroom(a: argparse.Namespace) -> int:
    p = _params(a.preset, a.set)
    print(f"{'seed':>6}{'reqs':>6}{'pool':>6}{'live':>6}{'LRU hit':>9}{'hints':>8}{'+rel':>8}"
          f"{'Belady':>8}{'inf':>7}{'B/LRU':>7}{'h/LRU':>7}{'h+r/LRU':>8}{'pol/LRU':>8}{'pol/B':>7}")
    for seed in (int(s) for s in a.seeds.split(",")):
        tr = generate_trace(p, seed, preset=a.preset)
        r = analyze(tr, pin_budget_fraction=a.pin_budget)
        R = r.results
        lru = R["lru"].recomputed_tokens or 1
        print(f"{seed:>6}{len(R['lru'].cached_tokens):>6}{r.num_gpu_blocks:>6}{r.peak_live_blocks:>6}"
              f"{R['lru'].hit_rate:>9.3f}{R['hints'].hit_rate:>8.3f}{R['hints+release'].hit_rate:>8.3f}"
              f"{R['belady'].hit_rate:>8.3f}{R['infinite'].hit_rate:>7.3f}{r.belady_over_lru:>7.3f}"
              f"{R['hints'].recomputed_tokens / lru:>7.3f}{R['hints+release'].recomputed_tokens / lru:>8.3f}"
              f"{R['policy'].recomputed_tokens / lru:>8.3f}{r.share_of_belady('policy'):>7.2f}")
    return 0


def _cmd_policy(a: argparse.Namespace) -> int:
    tr = _load(a)
    cfg = PolicyConfig.from_header(tr.header, release_on_end=not a.no_release)
    for ta in run_policy(tr.signals(), cfg, shared_prefix_target(tr.header)):
        print(json.dumps({"t": ta.t, **action_to_json(ta.action)}))
    return 0


def _trace_argument(parser: argparse.ArgumentParser) -> None:
    """The trace file, positional or as `--trace` (the spelling `kvhint bench run` uses)."""
    parser.add_argument("trace_path", nargs="?", metavar="TRACE", help="trace file (JSON lines, bench/trace.py format)")
    parser.add_argument("--trace", dest="trace_option", metavar="TRACE", help="the same, as an option")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate a trace")
    g.add_argument("--preset", choices=sorted(PRESETS), default="default")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="override a TraceParams field")
    g.add_argument("-o", "--output", default="-")
    g.set_defaults(fn=_cmd_generate)

    n = sub.add_parser("analyze", help="simulate all policies on a trace")
    _trace_argument(n)
    n.add_argument("--num-gpu-blocks", type=int, default=None, help="override the header's pool size")
    n.add_argument("--pin-budget", type=float, default=0.5, help="pin budget, fraction of usable blocks")
    n.add_argument("--async-scheduling", action="store_true", help="model GPU async scheduling (decode cache lag)")
    n.add_argument("--no-tiers", action="store_true", help="skip the simulated tier runs (f, g)")
    n.add_argument("--json", action="store_true")
    n.set_defaults(fn=_cmd_analyze)

    h = sub.add_parser("headroom", help="analyze generated traces over several seeds")
    h.add_argument("--preset", choices=sorted(PRESETS), default="default")
    h.add_argument("--seeds", default="0,1,2")
    h.add_argument("--set", action="append", default=[], metavar="KEY=JSON")
    h.add_argument("--pin-budget", type=float, default=0.5)
    h.set_defaults(fn=_cmd_headroom)

    pol = sub.add_parser("policy", help="print the reference policy's hint actions")
    _trace_argument(pol)
    pol.add_argument("--no-release", action="store_true")
    pol.set_defaults(fn=_cmd_policy)
    return ap


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if hasattr(a, "trace_path"):
        if (a.trace_path is None) == (a.trace_option is None):
            parser.error(f"{a.cmd}: give the trace once, as TRACE or --trace TRACE")
        a.trace = a.trace_path or a.trace_option
    try:
        return int(a.fn(a) or 0)
    except (TraceError, OSError, UsageError) as e:
        print(f"python -m bench {a.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())


__all__ = ["build_parser", "main"]
