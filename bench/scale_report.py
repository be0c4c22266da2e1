"""Tables and plots of `bench.scale`, computed from its raw data alone (`raw.json` + one CSV of
timed units per run), so `python -m bench.scale --report-only` regenerates them.

Costs per block, three ways:
  * churn: (KvHint - stock) CPU over the steady steps / (blocks admitted + blocks evicted);
  * bulk admission: the same over the fill units that admitted without evicting (large
    admissions through the KVCacheManager: the per-call costs are spread over many blocks);
  * callbacks: the adapter's residency callbacks timed per call in steady steps (raw.json
    "attribution"): us per admitted block (on_blocks_cached) and per evicted block
    (`_report_removed`, through which every removal report goes; raw data written before the
    allocations' removals were carried to the step's next report timed `on_keys_removed`, which
    those reports no longer pass); the hook wrappers around vLLM's methods come on top.
"""

from __future__ import annotations

import csv
import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

UNIT_FIELDS = ("phase", "stock_ns", "kv_ns", "stock_proc_ns", "kv_proc_ns", "admitted", "evicted", "hints", "running",
               "kv_settle_ns", "stock_wall_ns", "kv_wall_ns", "kv_first")
STEP_PHASES = ("steady", "quiet", "quiet-admit")
TARGET_RATIO = 1.03
# A quiet step's KvHint overhead above this is work that scales with something: even an empty
# Python loop over 10^4 sessions, or a C-level copy of a 10^5-entry map, takes longer on this
# machine. Below it, the line counts decide (verdicts).
SCAN_US = 100.0


def write_units(path: Path, units: Sequence[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=UNIT_FIELDS)
        w.writeheader()
        w.writerows(units)


def read_units(path: Path) -> list[dict[str, Any]]:
    with open(path, newline="") as f:
        rows = [{k: (v if k == "phase" else int(v)) for k, v in row.items()} for row in csv.DictReader(f)]
    for row in rows:
        for key in ("kv_settle_ns", "stock_wall_ns", "kv_wall_ns"):
            row.setdefault(key, 0)  # units written before deferred bookkeeping existed
    return rows


# ---------------------------------------------------------------- per-run analysis


def _ratios(units: Sequence[dict[str, Any]], key: str = "") -> dict[str, float]:
    s, k = f"stock{key}_ns", f"kv{key}_ns"
    per = [u[k] / u[s] for u in units if u[s] > 0]
    return {
        "median_ratio": statistics.median(per) if per else float("nan"),
        "total_ratio": sum(u[k] for u in units) / max(1, sum(u[s] for u in units)),
        "stock_median_ms": statistics.median(u[s] for u in units) / 1e6 if units else float("nan"),
        "kv_median_ms": statistics.median(u[k] for u in units) / 1e6 if units else float("nan"),
    }


def _p90(values: Sequence[int]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) >= 2 else float("nan")


def churn_costs(units: Sequence[dict[str, Any]]) -> dict[str, float]:
    """(KvHint - stock) us per churned block in steady steps, and per admitted block in bulk fills."""
    steady = [u for u in units if u["phase"] == "steady"]
    bulk = [u for u in units if u["phase"] == "fill" and u["admitted"] and not u["evicted"]]
    churned = sum(u["admitted"] + u["evicted"] for u in steady)
    admitted = sum(u["admitted"] for u in bulk)
    return {
        "churn_us": sum(u["kv_ns"] - u["stock_ns"] for u in steady) / 1e3 / churned if churned else float("nan"),
        "bulk_admit_us": sum(u["kv_ns"] - u["stock_ns"] for u in bulk) / 1e3 / admitted if admitted else float("nan"),
        "stock_bulk_admit_us": sum(u["stock_ns"] for u in bulk) / 1e3 / admitted if admitted else float("nan"),
    }


def analyse(run: dict[str, Any], units: Sequence[dict[str, Any]]) -> dict[str, Any]:
    steady = [u for u in units if u["phase"] == "steady"]
    quiet = [u for u in units if u["phase"] == "quiet" and u["admitted"] == 0 and u["evicted"] == 0]
    out: dict[str, Any] = {
        "steady": _ratios(steady),
        "steady_wall": _ratios(steady, "_wall") if steady and steady[0]["stock_wall_ns"] else None,
        "wall_p90": (_p90([u["stock_wall_ns"] for u in steady]) / 1e6, _p90([u["kv_wall_ns"] for u in steady]) / 1e6),
        "steady_proc": _ratios(steady, "_proc"),
        "quiet": _ratios(quiet),
        "quiet_steps": len(quiet),
        "quiet_overhead_us": statistics.median(u["kv_ns"] - u["stock_ns"] for u in quiet) / 1e3 if quiet else float("nan"),
        "steps": len(steady),
        "admitted_per_step": statistics.mean(u["admitted"] for u in steady) if steady else 0.0,
        "evicted_per_step": statistics.mean(u["evicted"] for u in steady) if steady else 0.0,
        "running_median": statistics.median(u["running"] for u in steady) if steady else 0,
        "hints_per_step": statistics.mean(u["hints"] for u in steady) if steady else 0.0,
        # Deferred bookkeeping (journal.py): settled after each unit, outside kv_ns.
        "settle_us_per_step": sum(u["kv_settle_ns"] for u in steady) / 1e3 / len(steady) if steady else 0.0,
        "total_with_settle": (sum(u["kv_ns"] + u["kv_settle_ns"] for u in steady) / max(1, sum(u["stock_ns"] for u in steady))),
    }
    if not run["shape"]["hints_per_step"] and not run.get("aa"):  # hints: the caches differ; A/A: no bus to count blocks
        out["costs"] = churn_costs(units)
    return out


# ---------------------------------------------------------------- tables


# The removal callback timed by scale_probes.attribution, by its name in raw data, newest first:
# `_report_removed` (every removal report), then `on_keys_removed` (raw data written before the
# allocations' removals were carried to the step's next report).
REMOVAL_CALLBACKS = ("_report_removed", "on_keys_removed")


def removal_callback(attribution: dict[str, Any]) -> str:
    """The removal callback's name in one run's attribution (the newest name when it has none)."""
    return next((name for name in REMOVAL_CALLBACKS if name in attribution), REMOVAL_CALLBACKS[0])


def _f(x: float, digits: int = 2) -> str:
    return "-" if x != x else f"{x:.{digits}f}"


def _memory_fit(runs: Sequence[dict[str, Any]]) -> tuple[float, float, float] | None:
    """bytes = p * cached blocks + q * sessions + r over the no-hint runs (least squares)."""
    mem = [r["memory"] for r in runs if r.get("memory") and not r["shape"]["hints_per_step"]]
    if len(mem) < 4:  # three unknowns: a fit needs more runs than that to say anything
        return None
    x = np.array([[m["cached_blocks"], m["sessions"], 1.0] for m in mem])
    y = np.array([m["index_bytes"] + m["hash_map_bytes"] + m["retention_bytes"] for m in mem], dtype=float)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    pred = x @ coef
    worst = float(np.max(np.abs(pred - y) / y))
    return float(coef[0]), float(coef[1]), worst


def _index_fit(runs: Sequence[dict[str, Any]]) -> tuple[float, float, float] | None:
    """index bytes = a * nodes + b * memberships over the no-hint runs (no constant; sessions
    are left out: their memberships are nearly proportional to them, so a third term is not
    identifiable from these runs)."""
    mem = [r["memory"] for r in runs if r.get("memory") and not r["shape"]["hints_per_step"]]
    if len(mem) < 4:
        return None
    x = np.array([[m["index_nodes"], m["memberships"]] for m in mem], dtype=float)
    y = np.array([m["index_bytes"] for m in mem], dtype=float)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    worst = float(np.max(np.abs(x @ coef - y) / y))
    return float(coef[0]), float(coef[1]), worst


def tables(raw: dict[str, Any], analyses: dict[str, dict[str, Any]]) -> list[str]:
    runs = raw["runs"]
    lines = [
        f"Machine: {raw['machine']}. vLLM {raw['vllm']}, real `Scheduler` / `KvHintScheduler` built by "
        "`engine_integration.inproc` (no model: fake model-runner outputs), 16-token blocks. CPU time of the "
        "engine thread; stock and KvHint do each unit back to back in random order.",
        f"Workload per step (simulated {raw['step_seconds'] * 1e3:.0f} ms GPU step): {raw['workload']}.",
        "",
        "## Scheduler CPU per step, KvHint / stock",
        "",
        "Bookkeeping (`KVHINT_RESIDENCY_BOOKKEEPING`, kvhint_server/journal.py): inline runs the index and event work "
        "inside vLLM's block-pool calls on the engine thread; deferred journals it there and settles it in order on the "
        "sidecar's settler thread. Deferred runs here settle after each unit, outside the timed region, and that CPU is "
        "the 'settle' column: the engine thread no longer pays it, the process still does (the last column).",
        "",
        "| run | live sessions | running | blocks admitted / evicted per step | stock median ms | KvHint median ms | median of per-step ratios | ratio of totals (thread) | ratio of totals (process) | deferred settle us per step | ratio of totals, engine thread + settle |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        a = analyses[r["name"]]
        s, p = a["steady"], a["steady_proc"]
        live = r.get("memory", {}).get("sessions", "-")
        churn = "-" if r.get("aa") else f"{a['admitted_per_step']:.0f} / {a['evicted_per_step']:.0f}"
        lines.append(
            f"| {r['label']} | {live} | {a['running_median']:.0f} | {churn} | "
            f"{_f(s['stock_median_ms'], 3)} | {_f(s['kv_median_ms'], 3)} | {_f(s['median_ratio'], 3)}x | {_f(s['total_ratio'], 3)}x | "
            f"{_f(p['total_ratio'], 3)}x | {_f(a['settle_us_per_step'], 0) if a['settle_us_per_step'] else '-'} | "
            f"{_f(a['total_with_settle'], 3) + 'x' if a['settle_us_per_step'] else '-'} |"
        )
    waits = [r for r in runs if r["shape"].get("gpu_wait_s")]
    if waits:
        lines += [
            "",
            "## The engine thread's wall time with a device wait per step",
            "",
            "Each side sleeps the device's share of a step where EngineCore waits for the model's output, between "
            "schedule() and update_from_output() (the GIL free, as while EngineCore waits on the GPU), and deferred "
            "bookkeeping is settled by the journal's own settler thread, as on an engine. Wall time "
            "of the same timed regions as the CPU columns: a settler that held the GIL while the engine thread "
            "needed it would show here. The settler's own CPU is not in either column.",
            "",
            "| run | median of per-step CPU ratios | ratio of CPU totals | median of per-step wall ratios | ratio of wall totals | stock wall p90 ms | KvHint wall p90 ms |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in waits:
            a = analyses[r["name"]]
            s, w = a["steady"], a["steady_wall"] or {}
            lines.append(
                f"| {r['label']} | {_f(s['median_ratio'], 3)}x | {_f(s['total_ratio'], 3)}x | "
                f"{_f(w.get('median_ratio', float('nan')), 3)}x | {_f(w.get('total_ratio', float('nan')), 3)}x | "
                f"{_f(a.get('wall_p90', (float('nan'), 0))[0], 3)} | {_f(a.get('wall_p90', (0, float('nan')))[1], 3)} |"
            )
    lines += [
        "",
        "## Costs per block and per step",
        "",
        "Churn: (KvHint - stock) CPU of the steady steps / (blocks admitted + evicted). Bulk: the same per block of "
        "the fill admissions that evicted nothing (whole prompts at once; KvHint also records the session's membership of the "
        "prefix-hit blocks there, which are not counted as admitted, so runs with many sessions on shared prompts cost more "
        "per admitted block). Callbacks: the adapter's "
        "`on_blocks_cached` / `_report_removed` (every removal report, the carried ones included) timed per call over steady steps of the KvHint side (index, retention "
        "and event bookkeeping; the hook wrappers come on top). Quiet steps: 32 resumed sessions decode inside one "
        "block each (no block stored or evicted, no hint). KvHint lines per strictly quiet step: one more quiet round, "
        "untimed, with `sys.settrace` counting the lines of kvhint_server/ and engine_integration/ that the KvHint side "
        "runs in each step that stores, evicts and frees no block (scale_probes.quiet_lines; the distinct counts).",
        "",
        "| run | churn: KvHint - stock us per block | bulk admission: us per block (stock) | admission callback: us per block (per call, blocks per call) | removal callback: us per block (per call, blocks per call) | quiet steps | quiet step: stock us | quiet step: KvHint - stock us (median) | quiet step ratio (median) | KvHint lines per strictly quiet step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        a = analyses[r["name"]]
        c, q, at = a.get("costs"), a["quiet"], r.get("attribution", {})
        cells = [f"{_f(c['churn_us'])}", f"{_f(c['bulk_admit_us'])} ({_f(c['stock_bulk_admit_us'])})"] if c else ["-", "-"]
        for name in ("on_blocks_cached", removal_callback(at)):
            x = at.get(name)
            cells.append(f"{x['us_per_block']:.1f} ({x['us_per_call']:.0f}, {x['blocks'] / max(1, x['calls']):.1f})" if x else "-")
        lines.append(
            f"| {r['label']} | {' | '.join(cells)} | {a['quiet_steps']} | {_f(q['stock_median_ms'] * 1e3, 0)} | "
            f"{_f(a['quiet_overhead_us'], 1)} | {_f(q['median_ratio'], 3)}x | {_lines_cell(r)} |"
        )
    fits = [(r, r.get("attribution", {})) for r in runs]
    if any("fit_us_fixed" in x for _, at in fits for x in at.values()):
        lines += [
            "",
            "Callback cost per call as fixed + per block (least squares over every call of the steady steps):",
            "",
            "| run | admission: us per call + us per block | removal: us per call + us per block |",
            "|---|---|---|",
        ]
        for r, at in fits:
            cells = []
            for name in ("on_blocks_cached", removal_callback(at)):
                x = at.get(name, {})
                cells.append(f"{x['fit_us_fixed']:.1f} + {x['fit_us_per_block']:.2f} x blocks" if "fit_us_fixed" in x else "-")
            lines.append(f"| {r['label']} | {' | '.join(cells)} |")
    lines += [
        "",
        "## Memory of the KvHint structures (deep sys.getsizeof, after the steady phase)",
        "",
        "| run | cached blocks | index nodes | sessions | memberships | index bytes | hash map bytes | retention bytes (retained blocks) | (index + map) / cached block | index / session | retention / retained block | event ring |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    gc_rows = []
    for r in runs:
        m = r.get("memory")
        if not m:
            continue
        per_block = (m["index_bytes"] + m["hash_map_bytes"]) / max(1, m["cached_blocks"])
        lines.append(
            f"| {r['label']} | {m['cached_blocks']} | {m['index_nodes']} | {m['sessions']} | {m['memberships']} | {m['index_bytes']} | "
            f"{m['hash_map_bytes']} | {m['retention_bytes']} ({m['retained_blocks']}) | {per_block:.0f} | "
            f"{m['index_bytes'] / max(1, m['sessions']):.0f} | "
            f"{_f(m['retention_bytes'] / m['retained_blocks'] if m['retained_blocks'] else float('nan'), 0)} | {m['bus_bytes']} |"
        )
        if "kvhint_gc_objects" in m and "gc_full_ms" in m:
            per_object_us = m["gc_full_ms"] * 1e3 / max(1, m["gc_objects"])
            gc_rows.append(
                f"| {r['label']} | {m['kvhint_gc_objects']} ({m['index_gc_objects']}) | "
                f"{m['kvhint_gc_objects'] / max(1, m['cached_blocks']):.2f} | {m['gc_objects']} | {m['gc_full_ms']:.0f} | "
                f"{per_object_us:.2f} | {m['kvhint_gc_objects'] * per_object_us / 1e3:.0f} |"
            )
    if gc_rows:
        lines += [
            "",
            "Garbage collection: Python's cyclic collector traverses every tracked container at each full "
            "(generation 2) collection. vLLM freezes its start-up heap (gc.freeze), so its pool is not traversed; "
            "KvHint's structures are built while serving and are. Full collection: one gc.collect() of this whole "
            "process (both schedulers, the workload, start-up heap unfrozen for it), fastest of three. KvHint's share "
            "is estimated as its tracked objects x the process's time per tracked object.",
            "",
            "| run | KvHint GC-tracked objects (index) | per cached block | process tracked objects | full collection ms "
            "| us per tracked object | KvHint's share of a full collection, est. ms |",
            "|---|---|---|---|---|---|---|",
            *gc_rows,
        ]
    fit = _memory_fit(runs)
    if fit:
        lines += ["", f"Linear fit over the runs without hints: bytes = {fit[0]:.0f} x cached blocks + {fit[1]:.0f} x sessions "
                      f"(+ constant); worst relative error of the fit {fit[2] * 100:.1f}%."]
    index_fit = _index_fit(runs)
    if index_fit:
        lines += [f"The index alone: {index_fit[0]:.0f} B per index node + {index_fit[1]:.0f} B per membership (a session's "
                  f"claim on a block, shared system-prompt blocks included); worst relative error {index_fit[2] * 100:.1f}%. "
                  "A session's cost grows with the blocks it is a member of, so a long shared prefix costs every session "
                  "that uses it."]
    sweep = raw.get("apply_sweep")
    if sweep:
        lines += [
            "",
            f"## ApplyHints apply time against blocks selected ({sweep['run']}; engine thread, median of repeats)",
            "",
            "| action | blocks selected | apply us | us per block |",
            "|---|---|---|---|",
        ]
        for row in sweep["rows"]:
            lines.append(f"| {row['action']} | {row['blocks']} | {row['us']:.0f} | {row['us'] / max(1, row['blocks']):.2f} |")
        shared = sweep.get("shared")
        if shared:
            lines += [
                "",
                "Retain of one session whose prefix (a shared system prompt) is retained by k sessions in all, this one included:",
                "",
                "| k: sessions retaining the shared blocks | blocks selected | apply us |",
                "|---|---|---|",
                *(f"| {row['owners']} | {row['blocks']} | {row['us']:.0f} |" for row in shared),
            ]
    for r in runs:
        hb = r.get("hint_batches")
        if hb:
            ns = [b["ns"] for b in hb]
            lines += [
                "",
                f"Hint batches during '{r['label']}': {len(hb)} batches of {hb[0]['hints']} hints, apply median "
                f"{statistics.median(ns) / 1e3:.0f} us, p99 {sorted(ns)[int(len(ns) * 0.99) - 1] / 1e3:.0f} us, "
                f"{statistics.mean(b['blocks'] for b in hb):.0f} blocks affected per batch on average.",
            ]
    ev = raw.get("events")
    if ev:
        lines += [
            "",
            f"## Event bus, {ev['subscribers']} in-process WatchEvents subscribers ({ev['run']})",
            "",
            "| source | events | wall s | events/s | publisher thread CPU s | delivered to each (min) | lost | resyncs |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for src in ev["sources"]:
            lines.append(
                f"| {src['source']} | {src['events']} | {src['wall_s']:.2f} | {src['events_per_s']:.0f} | {src['publisher_cpu_s']:.2f} | "
                f"{src['delivered_min']} | {src['lost']} | {src['resyncs']} |"
            )
    lines += ["", *verdicts(raw, analyses)]
    return lines


def _bookkeeping(run: dict[str, Any]) -> str:
    """The KvHint side's bookkeeping in a run (runs before it existed were inline)."""
    shape = run["shape"]
    mode = shape.get("bookkeeping", "inline")
    if mode == "auto":
        mode = "deferred" if shape.get("async_scheduling") else "inline"
    return mode


def verdicts(raw: dict[str, Any], analyses: dict[str, dict[str, Any]]) -> list[str]:
    runs = [r for r in raw["runs"] if not r["shape"]["hints_per_step"] and not r.get("aa")
            and not r["shape"].get("stock_kv_events")]  # targets are against plain stock
    big = [r for r in runs if r["shape"]["sessions"] == max(x["shape"]["sessions"] for x in runs)]
    out = ["## Targets", "", "| target | measured | verdict |", "|---|---|---|"]
    for mode in ("inline", "deferred"):
        of_mode = [r for r in big if _bookkeeping(r) == mode]
        if not of_mode:
            continue
        worst = max(of_mode, key=lambda r: analyses[r["name"]]["steady"]["total_ratio"])
        a = analyses[worst["name"]]["steady"]
        met = a["total_ratio"] <= TARGET_RATIO and a["median_ratio"] <= TARGET_RATIO
        settle = ""
        if mode == "deferred":
            measured = [analyses[r["name"]]["total_with_settle"] for r in of_mode if analyses[r["name"]]["settle_us_per_step"]]
            if analyses[worst["name"]]["settle_us_per_step"]:
                settle = (f"; with the settling CPU counted (another thread on an engine), "
                          f"{analyses[worst['name']]['total_with_settle']:.3f}x of totals")
            elif measured:
                settle = (f"; its settler thread's CPU is not in these figures (the runs that settle after each "
                          f"step count it: up to {max(measured):.3f}x of totals)")
        out.append(
            f"| <= {TARGET_RATIO}x scheduler CPU, {worst['shape']['sessions']} sessions, no hints, {mode} bookkeeping "
            f"| worst run ({worst['label']}): engine thread {a['median_ratio']:.3f}x median of per-step ratios, "
            f"{a['total_ratio']:.3f}x of totals{settle} | {'met' if met else 'missed'} |"
        )
    fit = _memory_fit(raw["runs"])
    if fit:
        out.append(f"| memory linear in resident blocks plus sessions | {fit[0]:.0f} B/cached block + {fit[1]:.0f} B/session, "
                   f"fit error <= {fit[2] * 100:.1f}% | {'met' if fit[2] <= 0.1 else 'missed'} |")
    quiet = [(r, analyses[r["name"]]["quiet_overhead_us"]) for r in runs if analyses[r["name"]]["quiet_steps"]]
    if len(quiet) >= 2:
        lo, hi = min(q for _, q in quiet), max(q for _, q in quiet)
        pools = sorted({r["shape"]["pool_blocks"] for r, _ in quiet})
        sessions = sorted({r["shape"]["sessions"] for r, _ in quiet})
        # The verdict is a count: the lines of KvHint's code run per strictly quiet step
        # (scale_probes.quiet_lines), which any per-step walk over the pool or the sessions
        # would make grow with them. The times are the cross-check for work hidden inside one
        # line (a C-level copy of a 10^5-entry structure): the overhead must stay under
        # SCAN_US. The timed overhead alone cannot decide flatness: the per-run medians of one
        # run spread by tens of us with no order in pool or sessions.
        counts = _quiet_line_counts([r for r, _ in quiet])
        flat = _flat(counts) and hi <= SCAN_US
        out.append(
            f"| no per-step work proportional to pool size or sessions when nothing changes | "
            f"lines of KvHint's code per strictly quiet step: {_lines_text(counts)}, in every run across pools {pools[0]}..{pools[-1]} blocks and {sessions[0]}..{sessions[-1]} sessions "
            f"({pools[-1] // pools[0]}x pool, {sessions[-1] // sessions[0]}x sessions); quiet-step overhead {lo:.1f} to {hi:.1f} us "
            f"(at most {SCAN_US:.0f} us) | {'met' if flat else 'missed'} |"
        )
        # Grants in effect (the hints runs, after their hints stop) must add no per-step work either.
        hinted = [r for r in raw["runs"] if r["shape"]["hints_per_step"] and analyses[r["name"]]["quiet_steps"]]
        if hinted:
            hq = [analyses[r["name"]]["quiet_overhead_us"] for r in hinted]
            hcounts = _quiet_line_counts(hinted)
            hpools = sorted({r["shape"]["pool_blocks"] for r in hinted})
            ok = _flat(hcounts) and len(hpools) >= 2 and max(hq) <= SCAN_US
            out.append(
                f"| the same with retention grants in effect ({'; '.join(r['label'] for r in hinted)}) | "
                f"lines of KvHint's code per strictly quiet step: {_lines_text(hcounts)} in each (without grants: "
                f"{_lines_text(counts)}); quiet-step overhead "
                f"{min(hq):.1f} to {max(hq):.1f} us (at most {SCAN_US:.0f} us) | {'met' if ok else 'missed'} |"
            )
    return out


def _quiet_line_counts(runs: list[dict[str, Any]]) -> dict[str, set[tuple[int, ...]]] | None:
    """Per scheduler class (sync, async), the distinct KvHint line counts per strictly quiet step
    of each of `runs` (None when a run has no traced quiet step: a raw.json from before the probe,
    or a round in which every step changed something). Flat: one tuple per scheduler class."""
    out: dict[str, set[tuple[int, ...]]] = {}
    for r in runs:
        q = r.get("quiet_lines")
        if not q or not q["steps"]:
            return None
        out.setdefault("async" if r["shape"].get("async_scheduling") else "sync", set()).add(tuple(q["lines"]))
    return out


def _flat(counts: dict[str, set[tuple[int, ...]]] | None) -> bool:
    return counts is not None and all(len(v) == 1 for v in counts.values())


def _lines_cell(run: dict[str, Any]) -> str:
    q = run.get("quiet_lines")
    if not q:
        return "-"
    return f"{', '.join(str(c) for c in q['lines'])} ({q['steps']} steps)" if q["steps"] else "no quiet step"


def _lines_text(counts: dict[str, set[tuple[int, ...]]] | None) -> str:
    """'19 (sync scheduler); 4, 19 (async scheduler)': each scheduler class's distinct counts."""
    if counts is None:
        return "not traced"
    parts = []
    for kind in sorted(counts, reverse=True):
        shown = " / ".join(", ".join(str(c) for c in t) for t in sorted(counts[kind]))
        parts.append(f"{shown} ({kind} scheduler{'' if len(counts[kind]) == 1 else ', differing between runs'})")
    return "; ".join(parts)


# ---------------------------------------------------------------- plot


def plot(raw: dict[str, Any], analyses: dict[str, dict[str, Any]], path: Path) -> bool:
    """Log-log: costs against pool size (at the most sessions) and against sessions (at the
    middle pool). Returns False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return False
    runs = [r for r in raw["runs"] if "costs" in analyses[r["name"]] and not r["shape"].get("stock_kv_events")
            and not r["shape"].get("async_scheduling")]  # one point per pool and session count
    if not runs:
        return False
    most = max(r["shape"]["sessions"] for r in runs)
    by_pool = sorted((r for r in runs if r["shape"]["sessions"] == most), key=lambda r: r["shape"]["pool_blocks"])
    pools = sorted({r["shape"]["pool_blocks"] for r in runs})
    mid = pools[len(pools) // 2]
    by_sessions = sorted((r for r in runs if r["shape"]["pool_blocks"] == mid), key=lambda r: r["shape"]["sessions"])
    def callback(name_in: Callable[[dict[str, Any]], str]) -> Any:
        """us per block of the callback `name_in(attribution)` names in a run's attribution."""
        def per_block(r: dict[str, Any], a: Any) -> float:
            at = r.get("attribution", {})
            return at.get(name_in(at), {}).get("us_per_block", float("nan"))
        return per_block

    series = (
        ("KvHint - stock us per churned block", lambda r, a: a["costs"]["churn_us"]),
        ("admission callback us per block", callback(lambda at: "on_blocks_cached")),
        ("removal callback us per block", callback(removal_callback)),
        ("KvHint - stock us per bulk-admitted block", lambda r, a: a["costs"]["bulk_admit_us"]),
        ("KvHint - stock us per quiet step", lambda r, a: a["quiet_overhead_us"]),
        ("stock us per quiet step", lambda r, a: a["quiet"]["stock_median_ms"] * 1e3),
        ("KvHint - stock us per steady step", lambda r, a: (a["steady"]["kv_median_ms"] - a["steady"]["stock_median_ms"]) * 1e3),
    )
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, group, key, xlabel in (
        (axes[0], by_pool, "pool_blocks", f"pool size, blocks ({most} sessions)"),
        (axes[1], by_sessions, "sessions", f"sessions ({mid} blocks)"),
    ):
        xs = [r["shape"][key] for r in group]
        for label, get in series:
            ys = [get(r, analyses[r["name"]]) for r in group]
            pts = [(x, y) for x, y in zip(xs, ys) if y == y and y > 0]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel(xlabel)
        ax.set_ylabel("us (CPU, engine thread)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("bench.scale: KvHint costs against pool size and session count (log-log)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def report(out_dir: Path, title: str, command: str) -> str:
    """Regenerate RESULTS.md (and the plot) in out_dir from raw.json and the unit CSVs."""
    raw = json.loads((out_dir / "raw.json").read_text())
    analyses = {r["name"]: analyse(r, read_units(out_dir / r["units_csv"])) for r in raw["runs"]}
    plotted = plot(raw, analyses, out_dir / "scale_loglog.png")
    body = [f"# {title}", "", f"Command: `{command}` (tables regenerated from raw data: `python -m bench.scale --report-only "
            f"--out {out_dir}`)", "", *tables(raw, analyses)]
    if plotted:
        body += ["", "![costs against pool size and sessions, log-log](scale_loglog.png)"]
    text = "\n".join(body) + "\n"
    (out_dir / "RESULTS.md").write_text(text)
    (out_dir / "analysis.json").write_text(json.dumps(analyses, indent=1, sort_keys=True))
    return text
