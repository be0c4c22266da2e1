"""Offline references, LRU-replay validation and outputs for `bench.agentic_engine`.

* `OfflineRefs.compute`: runs (d) Belady-MIN and (e) infinite cache on the
  block-hash sequence run (a) recorded (its real outputs, in the engine's
  admission order), plus the validation of that run against a two-phase LRU
  (`lru_timeline`) and the colleague's sequential simulators on the same
  outputs for reference. Belady with the requests overlapping as run (a)
  ran them (`belady_timeline`) is the reference for the engine runs' share
  of Belady's savings ("share of overlapped Belady's savings").
* `Report`: collects runs, writes ``results.json``, ``results.md``,
  ``requests.jsonl`` and ``plot.png``.

``python -m bench.agentic_report combine DIR [DIR ...]`` prints one combined
markdown table from several result directories (used for bench/results/README.md);
``python -m bench.agentic_report rebuild DIR`` recomputes a result directory's
offline references and rewrites its outputs from the recorded data.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any, Protocol

from bench.runs import OFFLINE_LABELS, RUNS, RequestRecord, RunRecord, RunSpec, linear_fit
from bench.simulate import (
    BlockPoolModel,
    BlockRequest,
    BlockTrace,
    analyze,
    belady_chooser,
    compile_trace,
    simulate_belady,
    simulate_infinite,
    simulate_lru,
)
from bench.trace import Trace

# The reference policy's runs (hints, hints+release, hints+tiers) are graded against the goals
# set for it; kvhint_client.policy's (policy, policy+tiers) against the goals set for the
# deployable policy (docs/design-notes.md, "Expected reuse and the session policy").
GOAL_G1 = 0.90  # reference policy: hints recover >= 90% of Belady's recomputed-token savings over LRU
GOAL_TTFT = 0.60  # mean TTFT with hints (and tiers) <= 0.6 x LRU
GOAL_TIERS_VS_INFINITE = 1.10  # reference policy with tiers: recomputed <= 1.1 x the infinite-cache bound, and below run (f)
GOAL_G1_POLICY = 0.75  # kvhint_client.policy, device only: >= 75% of Belady's savings over LRU
GOAL_TIERS_POLICY = 1.25  # kvhint_client.policy with tiers: recomputed <= 1.25 x the infinite-cache bound, and below run (f)
LIBRARY_RUNS = ("policy", "policy+tiers")  # the runs of kvhint_client.policy
TIERED_HINT_RUNS = ("hints+tiers", "policy+tiers")  # hinted runs on the tier engine, compared with run (f)


# --------------------------------------------------------------------------- block sequences


def reorder(bt: BlockTrace, order: Sequence[int]) -> BlockTrace:
    """The same block trace with requests executed in `order` (indices into
    bt.requests); signals are dropped (LRU / Belady / infinite ignore them)."""
    reqs = [replace(bt.requests[i], index=k) for k, i in enumerate(order)]
    return replace(bt, items=list(reqs), requests=reqs)


def admission_times(run: Any) -> list[float]:
    """Engine wall time at which each request (by trace index) was admitted: its
    continuation's first BlocksStored event, else (no full block stored) the
    client's send time. Clamped into [send, first token]."""
    out = [math.nan] * len(run.records)
    for rec in run.records:
        t = run.admission.get(rec.continuation_id, math.nan)
        lo, hi = rec.wall_send, rec.wall_send + rec.ttft_s
        if math.isnan(t):
            t = lo
        out[rec.index] = min(max(t, lo), hi)
    return out


def completion_times(run: Any) -> list[float]:
    """Engine wall time at which each request (by trace index) completed, just
    before the client saw its last token."""
    return [r.wall_done - 0.002 for r in sorted(run.records, key=lambda r: r.index)]


# choose(pool, n, i): the n free blocks to evict for request i of the timeline's trace.
TimelineChooser = Callable[[BlockPoolModel, int, int], list[int]]


class TimelineObserver(Protocol):
    """What a hint policy sees of a timeline (`bench.policy_timeline`): the clock, each
    admission and completion (after the pool changed), and its own timed calls."""

    def at(self, t: float) -> None: ...

    def admitted(self, i: int, t: float) -> None: ...

    def completed(self, i: int, t: float) -> None: ...


def lru_timeline(bt: BlockTrace, admit: Sequence[float], finish: Sequence[float],
                 choose: TimelineChooser | None = None, queue: bool = False, *,
                 pool: BlockPoolModel | None = None, observer: TimelineObserver | None = None,
                 timed: Sequence[tuple[float, Callable[[float], None]]] = ()) -> tuple[list[int | None], dict[str, int]]:
    """Two-phase LRU over overlapping requests (vLLM BlockPool semantics as in
    `bench.simulate`, but a request holds its blocks while it runs):

    * admit (at its admission time): prefix hit (capped at (P-1)//bs), touch,
      allocate the prompt's ceil(P/bs) blocks, cache the full prompt blocks;
    * finish (at its completion): allocate its decode blocks, cache the rest of
      its chain, free in reverse order.

    Decode blocks are allocated at finish rather than at the step that needs
    them. Returns the cached tokens per request and counters. An admission that
    finds no room (`no_room`: the engine queued or preempted) gets None, or with
    `queue` waits, first come first served, and is admitted when a completion
    frees enough blocks (at the latest at its own recorded completion; None if
    not even then: `never_admitted`). `choose` replaces LRU's victim choice
    (the free queue's head); it is called with the index of the latest request
    admitted so far. `pool`: start from this pool (default: an empty one of the
    trace's size). `observer` hears of the clock before each event and of each
    admission and completion after it; `timed` calls run at their times, before
    an admission or completion of the same time.
    """
    bs = bt.block_size
    pool = BlockPoolModel(bt.num_gpu_blocks) if pool is None else pool
    events = sorted([(admit[i], 0, i) for i in range(len(bt.requests))] + [(finish[i], 1, i) for i in range(len(bt.requests))]
                    + [(t, -1, k) for k, (t, _) in enumerate(timed)])
    held: dict[int, list[int]] = {}
    cached: list[int | None] = [None] * len(bt.requests)
    stats = {"no_room": 0, "never_admitted": 0}
    waiting: list[int] = []
    latest = -1

    def victims_for(n: int) -> list[int]:
        return pool.head(n) if choose is None or n <= 0 else choose(pool, n, latest)

    def try_admit(i: int, t: float) -> bool:
        nonlocal latest
        r: BlockRequest = bt.requests[i]
        P = r.num_prompt_tokens
        hits = pool.lookup(r.chain, r.hit_cap_blocks)
        n_new = -(-P // bs) - len(hits)
        free_hits = sum(1 for b in hits if pool.ref[b] == 0)  # touching them takes them off the free queue
        if n_new > len(pool.free) - free_hits:
            return False
        latest = max(latest, i)
        pool.touch(hits)
        victims = victims_for(n_new)
        pool.take(victims)
        blocks = hits + victims
        for k in range(len(hits), min(P // bs, len(r.chain))):
            pool.cache(blocks[k], r.chain[k])
        held[i] = blocks
        cached[i] = len(hits) * bs
        if observer is not None:
            observer.admitted(i, t)
        return True

    def complete(i: int, t: float) -> None:
        r: BlockRequest = bt.requests[i]
        P = r.num_prompt_tokens
        blocks = held.pop(i)
        extra = r.num_alloc_blocks - len(blocks)
        if extra > 0:
            extra = min(extra, len(pool.free))
            victims = victims_for(extra)
            pool.take(victims)
            blocks = blocks + victims
        for k in range(max(P // bs, 0), min(len(r.chain), len(blocks))):
            if pool.block_hash[blocks[k]] is None:
                pool.cache(blocks[k], r.chain[k])
        pool.free_request(blocks)
        if observer is not None:
            observer.completed(i, t)

    for t, kind, i in events:
        if observer is not None:
            observer.at(t)
        if kind < 0:
            timed[i][1](t)
            continue
        if kind == 0:
            if waiting or not try_admit(i, t):  # (only a queue has anyone waiting)
                stats["no_room"] += 1
                if queue:
                    waiting.append(i)
            continue
        if i in waiting:  # its completion came while it waited: admitted now or never
            waiting.remove(i)
            if not try_admit(i, t):
                stats["never_admitted"] += 1
        if i in held:
            complete(i, t)
        while waiting and try_admit(waiting[0], t):
            waiting.pop(0)
    stats["never_admitted"] += len(waiting)
    return cached, stats


def belady_timeline(bt: BlockTrace, admit: Sequence[float], finish: Sequence[float],
                    queue: bool = False) -> tuple[list[int | None], dict[str, int]]:
    """Belady-MIN under the engine's concurrency: `lru_timeline` (requests hold
    their blocks from admission to completion, at the recorded times) with
    Belady's victim choice, next uses counted in admission order: the
    clairvoyant reference for a run whose requests overlapped as they did (a
    reference, not a proven optimum, as for the sequential Belady). Cached
    tokens per request in `bt`'s order."""
    order = sorted(range(len(bt.requests)), key=lambda i: (admit[i], i))
    rec = reorder(bt, order)
    cached, stats = lru_timeline(rec, [admit[i] for i in order], [finish[i] for i in order], belady_chooser(rec), queue=queue)
    out: list[int | None] = [None] * len(order)
    for k, i in enumerate(order):
        out[i] = cached[k]
    return out, stats


def timeline_summary(bt: BlockTrace, cached: Sequence[int | None], stats: dict[str, int]) -> dict[str, Any]:
    """A queued timeline's totals; a request never admitted counts as a full recompute."""
    prompt = sum(r.num_prompt_tokens for r in bt.requests)
    hit = sum(c or 0 for c in cached)
    return {"prompt_tokens": prompt, "cached_tokens": hit, "hit_rate": hit / prompt if prompt else 0.0,
            "recomputed_tokens": prompt - hit, "queued_admissions": stats["no_room"],
            "never_admitted": stats["never_admitted"]}


def compare(engine: Sequence[int], sim: Sequence[int | None], ids: Sequence[str]) -> dict[str, Any]:
    mism = [(ids[i], engine[i], sim[i]) for i in range(len(engine)) if sim[i] != engine[i]]
    return {
        "requests": len(engine),
        "matched": len(engine) - len(mism),
        "engine_cached_tokens": sum(engine),
        "sim_cached_tokens": sum(s or 0 for s in sim),
        "first_mismatches": [{"request": r, "engine": e, "sim": s} for r, e, s in mism[:8]],
    }


@dataclass
class OfflineRefs:
    results: dict[str, dict[str, Any]]  # belady, infinite, lru-sim on the recorded sequence
    sequential_sims: dict[str, dict[str, Any]]  # bench.simulate.analyze on the trace order, same outputs
    concurrent_validation: dict[str, Any]
    num_gpu_blocks: int
    recomputed_per_request: dict[str, list[int]] = field(default_factory=dict)

    @staticmethod
    def validate_concurrent(trace: Trace, run_a: Any) -> dict[str, Any]:
        """Validation 2 for one run: the concurrent run against the two-phase LRU
        (and against the sequential LRU fed the same admission order)."""
        bt = compile_trace(trace, outputs=run_a.outputs)
        admit = admission_times(run_a)
        order = sorted(range(len(bt.requests)), key=lambda i: (admit[i], i))
        by_idx = sorted(run_a.records, key=lambda r: r.index)
        finish = completion_times(run_a)
        timeline, tstats = lru_timeline(bt, admit, finish)
        engine = [r.cached_tokens for r in by_idx]
        ids = [r.request_id for r in by_idx]
        val = compare(engine, timeline, ids)
        val["no_room_admissions"] = tstats["no_room"]
        lru_atomic = simulate_lru(reorder(bt, order))
        atomic = [0] * len(order)
        for k, i in enumerate(order):
            atomic[i] = lru_atomic.cached_tokens[k]
        val["atomic_in_admission_order"] = {k: v for k, v in compare(engine, atomic, ids).items() if k != "first_mismatches"}
        return val

    @classmethod
    def compute(cls, trace: Trace, run_a: Any, *, pin_budget_fraction: float = 0.5,
                other_runs: Sequence[Any] = ()) -> OfflineRefs:
        """References on `run_a`'s recorded sequence; validation 2 on `run_a`
        and on `other_runs` (further repeats of run a)."""
        bt = compile_trace(trace, outputs=run_a.outputs)
        admit = admission_times(run_a)
        order = sorted(range(len(bt.requests)), key=lambda i: (admit[i], i))
        rec = reorder(bt, order)
        belady = simulate_belady(rec)
        infinite = simulate_infinite(rec)
        lru_atomic = simulate_lru(rec)
        finish = completion_times(run_a)
        results = {
            "belady": _sim_summary(belady),
            "infinite": _sim_summary(infinite),
            "lru-sim": _sim_summary(lru_atomic),
            "belady-concurrent": timeline_summary(bt, *belady_timeline(bt, admit, finish, queue=True)),
            "lru-concurrent": timeline_summary(bt, *lru_timeline(bt, admit, finish, queue=True)),
        }
        val = cls.validate_concurrent(trace, run_a)
        if other_runs:
            val["each_repeat"] = [
                {k: v for k, v in cls.validate_concurrent(trace, r).items() if k != "first_mismatches"}
                for r in other_runs
            ]
        seq = analyze(bt, pin_budget_fraction=pin_budget_fraction)
        sims = {name: _sim_summary(r) for name, r in seq.results.items()}
        per_req = {
            name: [q.num_prompt_tokens - c for q, c in zip(rec.requests, r.cached_tokens)]
            for name, r in (("belady", belady), ("infinite", infinite), ("lru-sim", lru_atomic))
        }
        return cls(results, sims, val, bt.num_gpu_blocks, per_req)

    def to_json(self) -> dict[str, Any]:
        return {
            "results": self.results,
            "sequential_sims": self.sequential_sims,
            "concurrent_validation": self.concurrent_validation,
            "num_gpu_blocks": self.num_gpu_blocks,
        }


def _fmt(v: Any, fmt: str = "{:.0f}") -> str:
    """`v` in `fmt`, or n/a when it is missing (None or NaN)."""
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def _sim_summary(r: Any) -> dict[str, Any]:
    return {
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.hit_tokens,
        "hit_rate": r.hit_rate,
        "recomputed_tokens": r.recomputed_tokens,
        "peak_blocks_in_use": r.peak_blocks_in_use,
        "evictions": r.evictions,
        **{k: v for k, v in r.extra.items()},
    }


# --------------------------------------------------------------------------- TTFT model


def ttft_model(calibration: dict[str, Any]) -> Any:
    """Modelled TTFT (ms) of a request that recomputes `r` prompt tokens, from the
    idle-engine calibration: the median hit TTFT plus the prefill time of `r`
    tokens, interpolated between the calibrated lengths (linear beyond). No
    queueing and no attention over the cached prefix: an idle-engine estimate,
    immune to CPU contention, used to compare runs and the offline references."""
    rows = (calibration or {}).get("rows") or []
    if not rows:
        return None
    hit = statistics.median(r["hit_ttft_ms"] for r in rows)
    pts = [(0.0, 0.0)] + sorted((float(r["prompt_tokens"]), max(0.0, r["miss_ttft_ms"] - hit)) for r in rows)

    def f(x: float) -> float:
        if x <= 0:
            return hit
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if x <= x1:
                return hit + y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
        return hit + y1 + (y1 - y0) / (x1 - x0) * (x - x1)

    return f


# --------------------------------------------------------------------------- report


def code_version() -> dict[str, Any]:
    """The repository commit and the files modified in the working tree (the
    engine integration under test may be uncommitted work)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--", "kvhint_server", "engine_integration", "bench",
                                 "kvhint_client"], cwd=root, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"commit": commit, "modified": [ln[3:] for ln in status.splitlines() if ln.strip()]}


def _mean(vals: Sequence[float]) -> float:
    vals = [v for v in vals if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.fmean(vals) if vals else math.nan


@dataclass
class Report:
    trace: Trace
    plan_closed_loop: bool
    mode: str
    model: str
    command: str
    time_scale: float = 1.0
    nice: int = 0
    tiers: str = ""  # the --kvhint-tiers spec of the tier runs (f, g)
    engine_start_s: list[float] = field(default_factory=list)
    capabilities: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)
    calibration_measured: dict[str, Any] = field(default_factory=dict)
    validation: dict[str, Any] = field(default_factory=dict)
    runs: dict[str, list[Any]] = field(default_factory=dict)
    offline: OfflineRefs | None = None
    runtime_s: float = 0.0
    code_version: dict[str, Any] = field(default_factory=lambda: code_version())

    # -- collection
    def set_sequential_validation(self, run: Any) -> None:
        bt = compile_trace(self.trace, outputs=run.outputs)
        sim = simulate_lru(bt).cached_tokens
        by_idx = sorted(run.records, key=lambda r: r.index)
        self.validation["sequential"] = {
            **compare([r.cached_tokens for r in by_idx], sim, [r.request_id for r in by_idx]),
            "prompt_tokens": sum(r.prompt_tokens for r in by_idx),
            "seconds": round(run.makespan_s, 1),
        }

    def add_run(self, run: Any, repeat: int = 0) -> None:
        self.runs.setdefault(run.spec.name, []).append(run)

    def reference_run(self) -> Any:
        """Run (a)'s repeat with the median recomputed tokens (the first run
        without an `lru` run): its recorded block sequence feeds (d) and (e)."""
        runs = self.runs.get("lru") or next(iter(self.runs.values()))
        ranked = sorted(runs, key=lambda r: r.metrics()["recomputed_tokens"])
        return ranked[(len(ranked) - 1) // 2]

    def compute_offline(self) -> OfflineRefs:
        ref = self.reference_run()
        runs = self.runs.get("lru") or []
        self.offline = OfflineRefs.compute(
            self.trace, ref, pin_budget_fraction=float(self.capabilities.get("pin_budget_fraction") or 0.5),
            other_runs=runs if len(runs) > 1 else (),
        )
        return self.offline

    # -- metrics
    def repeat_metrics(self, name: str) -> list[dict[str, Any]]:
        return [{**r.metrics(), "modelled_ttft_mean_ms": self.modelled_ttft(
            [x.prompt_tokens - x.cached_tokens for x in r.records if x.error is None])} for r in self.runs[name]]

    def run_metrics(self, name: str) -> dict[str, Any]:
        """Metrics of a run: the median over repeats of each numeric field (robust
        to one repeat disturbed by other processes; per-repeat values are kept)."""
        ms = self.repeat_metrics(name)
        if len(ms) == 1:
            return ms[0]
        out = dict(ms[0])
        for k, v in ms[0].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                vals = [m[k] for m in ms if m[k] is not None and not (isinstance(m[k], float) and math.isnan(m[k]))]
                out[k] = statistics.median(vals) if vals else math.nan
        out["cpu"] = {k: statistics.median([(m.get("cpu") or {}).get(k, math.nan) for m in ms])
                      for k in (ms[0].get("cpu") or {})}
        out["repeats"] = len(ms)
        out["ttft_mean_ms_each"] = [round(m["ttft_mean_ms"], 1) for m in ms]
        return out

    def modelled_ttft(self, recomputed: Sequence[int]) -> float:
        f = ttft_model(self.calibration)
        if f is None or not recomputed:
            return math.nan
        return statistics.fmean(f(r) for r in recomputed)

    def run_modelled_ttft(self, name: str) -> float:
        return _mean([self.modelled_ttft([r.prompt_tokens - r.cached_tokens for r in run.records if r.error is None])
                      for run in self.runs[name]])

    def goals(self) -> dict[str, Any]:
        g: dict[str, Any] = {}
        if "lru" not in self.runs or self.offline is None:
            return g
        lru = self.run_metrics("lru")
        belady = self.offline.results["belady"]["recomputed_tokens"]
        infinite = self.offline.results["infinite"]["recomputed_tokens"]
        headroom = lru["recomputed_tokens"] - belady
        overlapped = self.offline.results.get("belady-concurrent")
        headroom_overlapped = lru["recomputed_tokens"] - overlapped["recomputed_tokens"] if overlapped else math.nan
        sims = self.offline.sequential_sims
        sim_headroom = sims["lru"]["recomputed_tokens"] - sims["belady"]["recomputed_tokens"]
        for name in self.runs:
            if name == "lru":
                continue
            m = self.run_metrics(name)
            saved = lru["recomputed_tokens"] - m["recomputed_tokens"]
            goal_g1 = GOAL_G1_POLICY if name in LIBRARY_RUNS else GOAL_G1
            entry = {
                "g1_savings_vs_belady": saved / headroom if headroom > 0 else math.nan,
                "g1_goal": goal_g1,
                "g1_met": bool(headroom > 0 and saved / headroom >= goal_g1),
                "g1_savings_vs_belady_overlapped": saved / headroom_overlapped if headroom_overlapped > 0 else math.nan,
                "ttft_mean_vs_lru": m["ttft_mean_ms"] / lru["ttft_mean_ms"] if lru["ttft_mean_ms"] else math.nan,
                "recomputed_vs_infinite": m["recomputed_tokens"] / infinite if infinite else math.nan,
            }
            entry["ttft_met"] = bool(entry["ttft_mean_vs_lru"] <= GOAL_TTFT)
            if name in TIERED_HINT_RUNS:
                f = self.run_metrics("offload")["recomputed_tokens"] if "offload" in self.runs else math.nan
                entry["recomputed_vs_offload"] = m["recomputed_tokens"] / f if f else math.nan
                f_ttft = self.run_metrics("offload")["ttft_mean_ms"] if "offload" in self.runs else math.nan
                entry["ttft_mean_vs_offload"] = m["ttft_mean_ms"] / f_ttft if f_ttft else math.nan
                entry["tiers_goal"] = GOAL_TIERS_POLICY if name in LIBRARY_RUNS else GOAL_TIERS_VS_INFINITE
                entry["tiers_met"] = bool(entry["recomputed_vs_infinite"] <= entry["tiers_goal"]
                                          and m["recomputed_tokens"] < f)
            lru_mod = self.run_modelled_ttft("lru")
            entry["modelled_ttft_vs_lru"] = self.run_modelled_ttft(name) / lru_mod if lru_mod else math.nan
            if name in sims and sim_headroom > 0:
                entry["g1_sim_sequential"] = (sims["lru"]["recomputed_tokens"] - sims[name]["recomputed_tokens"]) / sim_headroom
            g[name] = entry
        g["belady_headroom_tokens"] = headroom
        g["belady_overlapped_headroom_tokens"] = headroom_overlapped
        lru_mod = self.run_modelled_ttft("lru")
        g["offline_modelled_ttft_vs_lru"] = {
            k: self.modelled_ttft(v) / lru_mod if lru_mod else math.nan
            for k, v in self.offline.recomputed_per_request.items() if k in ("belady", "infinite")
        }
        return g

    def ttft_prefill_share(self) -> dict[str, Any]:
        """From run (a), all repeats pooled: TTFT ~ a + b * recomputed tokens over all requests."""
        if "lru" not in self.runs:
            return {}
        recs = [r for run in self.runs["lru"] for r in run.records if r.error is None]
        xs = [r.prompt_tokens - r.cached_tokens for r in recs]
        ys = [r.ttft_s * 1000 for r in recs]
        a, b = linear_fit(xs, ys)
        mean_ttft = statistics.fmean(ys)
        return {
            "intercept_ms": round(a, 1),
            "ms_per_1k_recomputed_tokens": round(b * 1000, 1),
            "share_of_mean_ttft_from_recomputation": round(b * statistics.fmean(xs) / mean_ttft, 3) if mean_ttft else math.nan,
        }

    # -- output
    def to_json(self) -> dict[str, Any]:
        h = self.trace.header
        return {
            "command": self.command,
            "mode": self.mode,
            "model": self.model,
            "time_scale": self.time_scale,
            "nice": self.nice,
            "tiers": self.tiers,
            "runtime_s": self.runtime_s,
            "engine_start_s": self.engine_start_s,
            "code_version": self.code_version,
            "trace": {"preset": h.preset, "seed": h.seed, "num_gpu_blocks": h.num_gpu_blocks,
                      "block_size": h.block_size, "stats": h.stats, "closed_loop": self.plan_closed_loop},
            "capabilities": self.capabilities,
            "calibration": self.calibration,
            **({"calibration_measured": self.calibration_measured} if self.calibration_measured else {}),
            "ttft_vs_recomputation": self.ttft_prefill_share(),
            "validation": {**self.validation,
                           **({"concurrent": self.offline.concurrent_validation} if self.offline else {})},
            "runs": {name: self.run_metrics(name) for name in self.runs},
            "runs_raw": {name: [{"makespan_s": r.makespan_s, "monitor": r.monitor, "hints": r.hints,
                                 "loadavg": list(r.loadavg)} for r in rs] for name, rs in self.runs.items()},
            "runs_each_repeat": {name: [r.metrics() for r in rs] for name, rs in self.runs.items()} if any(len(v) > 1 for v in self.runs.values()) else {},
            "offline": self.offline.to_json() if self.offline else None,
            "goals": self.goals(),
        }

    def table_rows(self) -> list[dict[str, Any]]:
        rows = []
        for name in self.runs:
            m = self.run_metrics(name)
            rows.append({"run": RUNS[name].label if name in RUNS else name, **m})
        if self.offline is not None:
            for name in ("belady", "infinite"):
                r = self.offline.results[name]
                rows.append({"run": OFFLINE_LABELS[name], **r, "offline": True,
                             "modelled_ttft_mean_ms": self.modelled_ttft(self.offline.recomputed_per_request.get(name, [])),
                             "peak_resident_blocks": r.get("distinct_blocks", self.offline.num_gpu_blocks - 1)})
        return rows

    def markdown_table(self) -> str:
        f = _fmt

        rep = max((len(v) for v in self.runs.values()), default=1)
        lines = [
            "| run | hit rate | recomputed prompt tokens | TTFT mean / p50 / p99 (ms, measured) "
            "| modelled TTFT mean (ms, idle engine) | TPOT mean (ms) | throughput (req/s, out tok/s) "
            "| peak blocks in use | pins broken | bytes moved between tiers (prompt tokens loaded from a lower tier) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in self.table_rows():
            if r.get("offline"):
                lines.append(
                    f"| {r['run']} | {r['hit_rate']:.3f} | {r['recomputed_tokens']} | n/a (offline) "
                    f"| {f(r.get('modelled_ttft_mean_ms'))} | n/a | n/a "
                    f"| {r['peak_blocks_in_use']} (sequential sim) | n/a | n/a |"
                )
                continue
            each = r.get("ttft_mean_ms_each")
            lines.append(
                f"| {r['run']} | {r['hit_rate']:.3f} | {f(r['recomputed_tokens'])} "
                f"| {f(r['ttft_mean_ms'])} / {f(r['ttft_p50_ms'])} / {f(r['ttft_p99_ms'])}"
                + (f" (means per repeat: {', '.join(f'{x:.0f}' for x in each)})" if each else "")
                + f" | {f(r.get('modelled_ttft_mean_ms'))} | {f(r.get('tpot_mean_ms'), '{:.1f}')} "
                f"| {f(r['throughput_req_s'], '{:.2f}')}, {f(r['throughput_out_tok_s'], '{:.1f}')} "
                f"| {f(r['peak_blocks_in_use'])} | {f(r['pins_broken'])} "
                f"| {_mib(r['bytes_moved_between_tiers'])} ({f(r.get('tier_cached_tokens', 0))}) |"
            )
        if rep > 1:
            lines.append("")
            lines.append(f"Engine runs: median over {rep} interleaved repeats (a, b, c, a, b, c, ..., then the tier runs f, g, f, g, ... on their own engine); "
                         "per-repeat values under \"Engine runs: details\". The offline references (d, e) use the "
                         "block sequence of run (a)'s repeat with the median recomputed tokens.")
        return "\n".join(lines)

    def markdown_summary(self) -> str:
        h = self.trace.header
        st = h.stats
        out = [
            f"# KvHint agentic benchmark: {h.describe()} ({self.mode} mode)",
            "",
            f"Command: `{self.command}`",
            "",
            f"Trace: {st.get('requests')} requests in {st.get('sessions')} sessions, {st.get('prompt_tokens')} prompt tokens, "
            f"pool {h.num_gpu_blocks} blocks of {h.block_size} tokens (peak live set {st.get('peak_live_blocks')} blocks), "
            f"nominal duration {st.get('duration_s')} s, time scale {self.time_scale:g}, "
            f"{'closed-loop' if self.plan_closed_loop else 'open-loop'} concurrent replay. "
            f"Model `{self.model}`; engine {self.capabilities.get('engine', '?')}, pin budget "
            f"{self.capabilities.get('pin_budget_blocks', '?')} blocks."
            + (f" Tier runs (f, g): `--kvhint-tiers {self.tiers}`." if self.tiers else "")
            + f" Runtime {self.runtime_s:.0f} s.",
            "",
            self.markdown_table(),
            "",
        ]
        g = self.goals()
        if g:
            out.append("## Goals")
            out.append("")
            out.append(f"Belady's savings over LRU (engine run a): {g['belady_headroom_tokens']:.0f} recomputed prompt tokens.")
            res = self.offline.results
            if "belady-concurrent" in res:
                bc, lc = res["belady-concurrent"], res["lru-concurrent"]
                out.append("")
                out.append(
                    "Belady (d) replays run (a)'s block sequence one request at a time, so every block not in the "
                    "current request is evictable. On the engine, requests overlap and hold their blocks until they "
                    "complete. Belady-MIN with the requests overlapping as in run (a) (the two-phase model of the "
                    "validation below at run (a)'s admission and completion times, an admission that finds no room "
                    f"queued until a completion frees it; Belady's victim choice) recomputes {bc['recomputed_tokens']} "
                    f"prompt tokens ({bc['queued_admissions']} admissions queued, {bc['never_admitted']} never admitted "
                    f"and counted as full recomputes). The same model with LRU recomputes {lc['recomputed_tokens']} "
                    f"({lc['queued_admissions']} queued), engine run (a) {self.run_metrics('lru')['recomputed_tokens']:.0f}. "
                    f"Savings of the overlapped Belady over run (a): {g['belady_overlapped_headroom_tokens']:.0f} tokens, "
                    "the last column's denominator.")
            out.append("")
            out.append(f"| run | G1: share of Belady's savings (goal >= {GOAL_G1:.2f}, kvhint_client.policy >= "
                       f"{GOAL_G1_POLICY:.2f}; device-only runs) | same, sequential simulation | "
                       f"mean TTFT / LRU, measured (goal <= {GOAL_TTFT}) | modelled TTFT / LRU | recomputed / infinite "
                       f"(tiers goal: (g) <= {GOAL_TIERS_VS_INFINITE}, (g2) <= {GOAL_TIERS_POLICY}, and below (f)) | "
                       "share of overlapped Belady's savings (device-only runs) |")
            out.append("|---|---|---|---|---|---|---|")
            for name, e in g.items():
                if name not in self.runs:
                    continue
                tiered = name in ("offload", *TIERED_HINT_RUNS)
                g1 = f"{e['g1_savings_vs_belady']:.2f}" + ("" if tiered else f" ({'met' if e['g1_met'] else 'missed'})")
                inf = f"{e['recomputed_vs_infinite']:.2f}"
                if "tiers_met" in e:
                    vs_f = e["recomputed_vs_offload"]
                    inf += (f" ({vs_f:.2f} x (f)" if not math.isnan(vs_f) else " (no run f")
                    inf += f"; {'met' if e['tiers_met'] else 'missed'})"
                sim = f"{e['g1_sim_sequential']:.2f}" if "g1_sim_sequential" in e else "n/a"
                out.append(
                    f"| {name} | {g1} | {sim} "
                    f"| {e['ttft_mean_vs_lru']:.2f} ({'met' if e['ttft_met'] else 'missed'}) "
                    f"| {e.get('modelled_ttft_vs_lru', math.nan):.2f} "
                    f"| {inf} | {'-' if tiered else _fmt(e.get('g1_savings_vs_belady_overlapped'), '{:.2f}')} |"
                )
            gt = g.get("hints+tiers")
            if gt is not None and "offload" in self.runs and "lru" in self.runs:
                tp = self.run_metrics("offload")["tpot_mean_ms"] / self.run_metrics("lru")["tpot_mean_ms"]
                out.append("")
                out.append(
                    "(f) and (g) run on an engine with vLLM's KV connector, which trades decode speed for TTFT: its "
                    f"time per output token is {tp:.2f}x run (a)'s (on the default trace its TTFT was also lower at "
                    "equal recomputation; see bench/results/README.md). "
                    "So their TTFT ratios to LRU mix the connector's scheduling with the effect of the cache. "
                    f"Same engine, hints vs none: recomputed (g)/(f) = {gt['recomputed_vs_offload']:.2f}, "
                    f"mean TTFT (g)/(f) = {gt['ttft_mean_vs_offload']:.2f}.")
            om = g.get("offline_modelled_ttft_vs_lru") or {}
            if om:
                out.append("")
                out.append("Modelled mean TTFT / LRU of the offline references (the best any eviction policy could do "
                           "on this pool, and with no eviction at all): "
                           + ", ".join(f"{k} {v:.2f}" for k, v in om.items()) + ".")
            out.append("")
        if self.calibration:
            stat = self.calibration.get("statistic", "median of 3")
            src = self.calibration.get("source")
            out.append(f"## TTFT calibration (idle engine, one request at a time, max_tokens=1, {stat})")
            if src:
                out.append("")
                out.append(src)
            out.append("")
            out.append("| prompt tokens | miss TTFT (ms) | hit TTFT (ms) | prefill share of miss TTFT |")
            out.append("|---|---|---|---|")
            for row in self.calibration["rows"]:
                out.append(f"| {row['prompt_tokens']} | {row['miss_ttft_ms']} | {row['hit_ttft_ms']} | {row['prefill_share']:.0%} |")
            fit = self.calibration.get("miss_fit_ms", {})
            out.append("")
            out.append(f"Miss TTFT ~ {fit.get('intercept')} ms + {fit.get('per_1k_tokens')} ms per 1K prompt tokens.")
            sh = self.ttft_prefill_share()
            if sh:
                out.append(
                    f"In run (a) (concurrent, repeats pooled): TTFT ~ {sh['intercept_ms']} ms + {sh['ms_per_1k_recomputed_tokens']} ms per 1K "
                    f"recomputed tokens; recomputation explains {sh['share_of_mean_ttft_from_recomputation']:.0%} of mean TTFT."
                )
            out.append("")
        out.append("## Validation of the LRU replay")
        out.append("")
        v = self.validation.get("sequential")
        if v:
            out.append(
                f"* Sequential replay (one request at a time, same harness, no hints): `simulate_lru` matches the engine's "
                f"cached tokens on {v['matched']}/{v['requests']} requests ({v['engine_cached_tokens']} engine vs "
                f"{v['sim_cached_tokens']} simulated cached tokens)."
            )
        if self.offline is not None:
            c = self.offline.concurrent_validation
            at = c["atomic_in_admission_order"]
            out.append(
                f"* Concurrent run (a) vs two-phase LRU in the engine's admission order: {c['matched']}/{c['requests']} "
                f"requests match ({c['engine_cached_tokens']} engine vs {c['sim_cached_tokens']} simulated cached tokens; "
                f"{c['no_room_admissions']} admissions found no room). The sequential simulator fed the same order matches "
                f"{at['matched']}/{at['requests']} ({at['sim_cached_tokens']} tokens)."
                + (" Every repeat of run (a), two-phase LRU: "
                   + ", ".join(f"{e['matched']}/{e['requests']}" for e in c["each_repeat"]) + "."
                   if c.get("each_repeat") else "")
            )
            sims = self.offline.sequential_sims
            out.append(
                "* Sequential simulators on the same outputs (trace order, hit rate / recomputed): "
                + ", ".join(f"{k} {v['hit_rate']:.3f} / {v['recomputed_tokens']}" for k, v in sims.items())
                + "."
            )
        out.append("")
        others = [(name, (self.run_metrics(name).get("cpu") or {}).get("other_cores")) for name in self.runs]
        busy = [(n, c) for n, c in others if isinstance(c, (int, float)) and not math.isnan(c) and c > 0.25]
        if busy:
            out.append(
                "**Caution: other processes used CPU during the engine runs** ("
                + ", ".join(f"{n}: {c:.2f} cores" for n, c in busy)
                + f" of {os.cpu_count()}). TTFT includes that contention; hit rates and recomputed tokens are "
                "unaffected except through request timing."
                + (f" The engine ran at nice {self.nice}." if self.nice else "")
            )
            out.append("")
        out.append("## Engine runs: details")
        out.append("")
        out.append("| run | repeat | hit rate | recomputed | TTFT mean / p99 (ms) | makespan (s) | preemptions "
                   "| CPU cores: engine / other processes (of ncpu) | load avg 1m (start, end) | hints sent (outcomes) |")
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for name in self.runs:
            for i, m in enumerate(self.repeat_metrics(name)):
                hints = m.get("hints") or {}
                oc = "; ".join(f"{a}: " + ", ".join(f"{k} {v}" for k, v in o.items())
                               for a, o in (hints.get("outcomes") or {}).items())
                out.append(
                    f"| {name} | {i + 1} | {m['hit_rate']:.3f} | {m['recomputed_tokens']:.0f} "
                    f"| {m['ttft_mean_ms']:.0f} / {m['ttft_p99_ms']:.0f} | {m['makespan_s']:.0f} | {m['preemptions']:.0f} "
                    f"| {_cpu_str(m.get('cpu'))} | {', '.join(f'{x:.1f}' for x in m['loadavg_1m_start_end'])} | {oc or '-'} |"
                )
        out.append("")
        out.append("Peak resident blocks (BlocksStored - BlocksRemoved on WatchEvents): "
                   + ", ".join(f"{n} {self.run_metrics(n)['peak_resident_blocks']:.0f}" for n in self.runs)
                   + f" of {self.trace.header.num_gpu_blocks - 1} usable.")
        out.append("")
        return "\n".join(out)


def _mib(b: Any) -> str:
    if b is None or (isinstance(b, float) and math.isnan(b)):
        return "n/a"
    return f"{b / 2**20:.1f} MiB" if b else "0"


def _cpu_str(cpu: Any) -> str:
    if not cpu:
        return "n/a"
    if isinstance(cpu, list):
        cpu = cpu[0]
    return f"{cpu.get('engine_cores')} / {cpu.get('other_cores')} (of {cpu.get('ncpu')})"


def plot(report: Report, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return None
    rows = report.table_rows()
    names = [r["run"].split(" ")[0] + " " + r["run"].split(" ", 2)[1] if " " in r["run"] else r["run"] for r in rows]
    colors = ["#888888", "#4c72b0", "#55a868", "#c44e52", "#8172b2", "#dd8452", "#937860"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax = axes[0]
    vals = [r["recomputed_tokens"] for r in rows]
    ax.bar(range(len(rows)), vals, color=colors[: len(rows)])
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["run"].split(")")[0] + ")" for r in rows])
    ax.set_ylabel("recomputed prompt tokens")
    ax.set_title("Recomputed prompt tokens (lower is better)")
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v}", ha="center", va="bottom", fontsize=8)
    engine_rows = [r for r in rows if not r.get("offline")]
    ax = axes[1]
    width = 0.25
    for k, (key, lab) in enumerate((("ttft_mean_ms", "mean"), ("ttft_p50_ms", "p50"), ("ttft_p99_ms", "p99"))):
        ax.bar([i + (k - 1) * width for i in range(len(engine_rows))], [r[key] for r in engine_rows], width, label=lab)
    ax.set_xticks(range(len(engine_rows)))
    ax.set_xticklabels([r["run"].split(")")[0] + ")" for r in engine_rows])
    ax.set_ylabel("TTFT (ms, client-side)")
    ax.set_title("TTFT on the engine")
    ax.legend()
    ax = axes[2]
    for k, name in enumerate(report.runs):
        ttft = sorted(r.ttft_s * 1000 for r in report.runs[name][0].records if r.error is None)
        ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=name, color=colors[k % len(colors)])
    ax.set_xscale("log")
    from matplotlib.ticker import NullFormatter

    ax.xaxis.set_minor_formatter(NullFormatter())  # label decades only
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.legend()
    _ = names
    h = report.trace.header
    fig.suptitle(f"KvHint agentic benchmark: {h.describe()}, {len(report.reference_run().records)} requests, "
                 f"pool {h.num_gpu_blocks} blocks, model {report.model}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(report: Report, out: Path, *, with_plot: bool = True) -> list[Path]:
    """Raw data first (requests.jsonl, usage.jsonl), then results.json, results.md
    and plot.png (unless with_plot is False: an existing plot is left as it is), so a
    reporting problem never loses a run's data."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    p = out / "requests.jsonl"
    with open(p, "w") as f:
        for name, runs in report.runs.items():
            for rep, run in enumerate(runs):
                for rec in run.records:
                    f.write(json.dumps({"run": name, "repeat": rep, **rec.to_json(),
                                        "admission_wall": run.admission.get(rec.continuation_id),
                                        "output_ids": run.outputs.get(rec.request_id)}, default=_json_default) + "\n")
    paths.append(p)
    p = out / "usage.jsonl"
    with open(p, "w") as f:
        for name, runs in report.runs.items():
            for rep, run in enumerate(runs):
                f.write(json.dumps({"run": name, "repeat": rep, "usable_blocks": report.trace.header.num_gpu_blocks - 1,
                                    "samples": [[round(t, 2), u] for t, u in run.usage_samples],
                                    "cpu": [[round(t, 2), c.get("engine_cores"), c.get("other_cores")]
                                            for t, c in run.cpu_samples]}, default=_json_default) + "\n")
    paths.append(p)
    p = out / "results.json"
    p.write_text(json.dumps(report.to_json(), indent=2, default=_json_default) + "\n")
    paths.append(p)
    p = out / "results.md"
    p.write_text(report.markdown_summary() + "\n")
    paths.append(p)
    png = plot(report, out / "plot.png") if with_plot else None
    if png is not None:
        paths.append(png)
    return paths


def _json_default(o: Any) -> Any:
    if isinstance(o, float) and math.isnan(o):
        return None
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


# --------------------------------------------------------------------------- combined table


def combined_table(dirs: Sequence[str | Path]) -> str:
    """One markdown table over several results.json files."""

    f = _fmt

    lines = [
        "| trace | run | hit rate | recomputed prompt tokens | x LRU | G1 (share of Belady's savings) "
        "| TTFT mean / p50 / p99 (ms, measured) | TTFT mean / LRU | modelled TTFT / LRU | peak blocks in use | pins broken |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in dirs:
        js = json.loads((Path(d) / "results.json").read_text())
        tr = js["trace"]
        label = f"{tr['preset']} seed {tr['seed']}"
        runs = js["runs"]
        lru = runs.get("lru", {})
        lru_re = lru.get("recomputed_tokens") or 0
        lru_mod = lru.get("modelled_ttft_mean_ms")
        goals = js.get("goals") or {}
        for name, m in runs.items():
            g = goals.get(name, {}) if name != "lru" else {}
            lines.append(
                f"| {label} | {name} | {m['hit_rate']:.3f} | {m['recomputed_tokens']:.0f} "
                f"| {m['recomputed_tokens'] / lru_re if lru_re else math.nan:.3f} "
                f"| {f(g.get('g1_savings_vs_belady'), '{:.2f}') if g else '-'} "
                f"| {m['ttft_mean_ms']:.0f} / {m['ttft_p50_ms']:.0f} / {m['ttft_p99_ms']:.0f} "
                f"| {m['ttft_mean_ms'] / lru['ttft_mean_ms'] if lru.get('ttft_mean_ms') else math.nan:.2f} "
                f"| {f(m.get('modelled_ttft_mean_ms') / lru_mod if lru_mod and m.get('modelled_ttft_mean_ms') else None, '{:.2f}')} "
                f"| {m['peak_blocks_in_use']:.0f} | {m['pins_broken']:.0f} |"
            )
        off = (js.get("offline") or {}).get("results", {})
        om = goals.get("offline_modelled_ttft_vs_lru") or {}
        for name in ("belady", "infinite"):
            if name in off:
                r = off[name]
                lines.append(
                    f"| {label} | {name} (offline) | {r['hit_rate']:.3f} | {r['recomputed_tokens']} "
                    f"| {r['recomputed_tokens'] / lru_re if lru_re else math.nan:.3f} "
                    f"| {'1.00' if name == 'belady' else '-'} | n/a | n/a | {f(om.get(name), '{:.2f}')} | n/a | n/a |"
                )
    return "\n".join(lines)


def load_report(d: str | Path, *, offline: bool = True) -> Report:
    """Rebuild a Report from a results directory (results.json, trace.jsonl,
    requests.jsonl with outputs, usage.jsonl) and recompute the offline parts
    (unless offline is False: a caller that reads only the runs skips the simulations)."""
    d = Path(d)
    js = json.loads((d / "results.json").read_text())
    trace = Trace.load(d / "trace.jsonl")
    rep = Report(trace=trace, plan_closed_loop=js["trace"]["closed_loop"], mode=js["mode"], model=js["model"],
                 command=js["command"], time_scale=js.get("time_scale", 1.0), nice=js.get("nice", 0), tiers=js.get("tiers", ""))
    rep.engine_start_s = js.get("engine_start_s", [])
    rep.capabilities = js.get("capabilities", {})
    rep.calibration = js.get("calibration", {})
    rep.calibration_measured = js.get("calibration_measured", {})
    rep.validation = {k: v for k, v in (js.get("validation") or {}).items() if k != "concurrent"}
    rep.code_version = js.get("code_version", {})
    rep.runtime_s = js.get("runtime_s", 0.0)
    fields = {f.name for f in dataclass_fields(RequestRecord)}
    rows: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for line in (d / "requests.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.setdefault((row["run"], row["repeat"]), []).append(row)
    usage: dict[tuple[str, int], dict[str, Any]] = {}
    if (d / "usage.jsonl").exists():
        for line in (d / "usage.jsonl").read_text().splitlines():
            u = json.loads(line)
            usage[(u["run"], u["repeat"])] = u
    for name, raws in js["runs_raw"].items():
        for i, raw in enumerate(raws):
            rr = rows[(name, i)]
            recs = [RequestRecord(**{k: (math.nan if v is None and k not in ("error",) else v)
                                     for k, v in row.items() if k in fields}) for row in rr]
            u = usage.get((name, i), {})
            run = RunRecord(
                RUNS.get(name, RunSpec(name, name)), recs, {row["request_id"]: row["output_ids"] for row in rr},
                raw["makespan_s"], raw["monitor"], raw["hints"], tuple(raw["loadavg"]),
                [tuple(x) for x in u.get("samples", [])],
                [(t, {"engine_cores": e, "other_cores": o}) for t, e, o in u.get("cpu", [])],
                {row["continuation_id"]: row["admission_wall"] for row in rr if row.get("admission_wall") is not None},
            )
            rep.add_run(run, i)
    if offline:
        rep.compute_offline()
    return rep


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.agentic_report", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("combine", help="one markdown table over several result directories")
    c.add_argument("dirs", nargs="+")
    r = sub.add_parser("rebuild", help="recompute the offline references and rewrite a result directory's outputs")
    r.add_argument("dir")
    r.add_argument("--calibration-from", metavar="DIR",
                   help="use the TTFT calibration of another result directory (same model and machine) for the "
                        "modelled TTFT, e.g. when this run's calibration was disturbed; the measured one is kept "
                        "as calibration_measured")
    r.add_argument("--no-plot", action="store_true",
                   help="rewrite the data and tables only; leave plot.png as it is (drawing it takes seconds)")
    a = ap.parse_args(argv)
    if a.cmd == "combine":
        print(combined_table(a.dirs))
        return 0
    rep = load_report(a.dir)
    if a.calibration_from:
        other = json.loads((Path(a.calibration_from) / "results.json").read_text())
        rep.calibration_measured = rep.calibration_measured or rep.calibration
        rep.calibration = {**other["calibration"],
                           "source": f"Taken from `{a.calibration_from}` (same model, engine settings and machine): "
                                     "this run's own calibration (`calibration_measured` in results.json) was "
                                     "disturbed by other processes."}
    paths = write_outputs(rep, Path(a.dir), with_plot=not a.no_plot)
    print("rewrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
