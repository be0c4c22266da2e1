"""Where KvHint's no-hints scheduler cost goes: `bench.scale`'s paired steps with one piece of
KvHint's bookkeeping replaced by a no-op at a time.

    python -m bench.scale_ablation [--pool 16384] [--sessions 10000] [--steps 150] [--bookkeeping auto]
                                   [--shape NAME] [--out bench/results/scale_ablation.md]

--shape takes the Shape fields of one of bench.scale_ab's shapes (hybrid: two KV-cache groups
sharing the pool; settler: the settler thread and a device wait); a field the shape names wins
over --bookkeeping.

A diagnostic, not a configuration anyone runs: a no-op'd callback leaves the index and the event
stream wrong (e.g. without removals the index only grows). Each variant is a fresh stock/KvHint
pair (`scale_driver.Pair`) filled and warmed as in bench.scale, then the piece is replaced and
the steady steps are measured. Variants:

  * full: KvHint as shipped;
  * no collector: the same with Python's cyclic garbage collector disabled during the steps;
  * no event publishing: `EventBus.publish` does nothing (events are still built);
  * no index on admission: `KvHintCore.on_stored` does nothing;
  * no index on removal: `KvHintCore.on_removed` does nothing;
  * hooks only: the adapter's residency callbacks (`on_blocks_cached`, `on_keys_removed`,
    `on_prefix_hit`) do nothing, so what is left is the hooked vLLM methods themselves;
  * stock methods: as hooks only, and every method KvHint's pool, manager and scheduler
    classes override is taken off those classes for the run (put back after it), so vLLM's own
    runs: what is left of KvHint on its side is its objects (the index the fill built), the
    sidecar's threads and an empty journal's settle;
  * stock methods, no sidecar: the same with the sidecar stopped (its gRPC and metrics threads);
  * re-classed: KvHint as shipped, except that after the fill its BlockPool and
    KVCacheManager objects get their own class assigned again (`obj.__class__ = type(obj)`),
    which is what hooks.install did before KvHint's classes were built by vLLM: CPython then
    keeps the objects' attributes in a plain dict, and every attribute access in vLLM's pool
    and manager code is slower (engine_integration/hooks.py, module doc);
  * settled after the unit, settled inline after the unit, settler settles nothing, settler
    settles nothing, collects after the unit: `--shape settler` only (each refuses another
    shape). Where the settler's work lands: in the settler shape it settles during the
    KvHint side's device wait, between its `schedule()` and `update_from_output()`, and after
    the step. "settled after the unit": the settler is woken only where
    `update_from_output()` ends and its periodic look is off, so it settles, and collects,
    only after the unit, while the driver waits for it (a placement an engine, whose next
    `schedule()` follows at once, does not have). "settled inline after the unit": no
    settler thread; the driver settles after the unit on its own thread, as the async shape
    does. "settler settles nothing": the settler wakes as shipped, but drops the entries
    unsettled, and still runs its young collection. "... collects after the unit": the
    same, with the young collection run by the driver after the unit instead;
  * A/A: both sides stock (the pairing's own noise);
  * A/A, ballast: both sides stock, and every admission of the second side's fill is followed
    by `BALLAST_PER_FILL` small unrelated Python objects kept alive, as KvHint's index is (the
    row names their deep size): the same vLLM code over a heap laid out like the KvHint side's.

The difference between two variants is what the removed piece cost, within the run-to-run noise
of `bench.scale` (single figures move by about +-5%).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from .report import write_results
from .scale_ab import SHAPES
from .scale_driver import Pair
from .scale_probes import deep_stats
from .scale_workload import Shape

BALLAST_PER_FILL = 20  # small dicts (each with a tuple, a str and a list) per fill admission


def _noop(*_a: Any, **_k: Any) -> None:
    return None


def _publish(pair: Pair) -> None:
    pair.kv.core.bus.publish = _noop


def _stored(pair: Pair) -> None:
    pair.kv.core.on_stored = _noop


def _removed(pair: Pair) -> None:
    pair.kv.core.on_removed = _noop


def _callbacks(pair: Pair) -> None:
    adapter = pair.kv.sched.kvhint_adapter
    adapter.on_blocks_cached = _noop
    adapter.on_keys_removed = _noop
    adapter.flush_removed = adapter._carried.clear  # the allocation fast path's carried keys, dropped
    adapter.on_prefix_hit = _noop


# vLLM's own method each KvHint class overrides, by owner: the pool's, the manager's, the
# scheduler's (its step entry points, and add_request).
def _stock_overrides() -> list[tuple[type, str]]:
    from engine_integration.hooks import KvHintBlockPool, KvHintKVCacheManager
    from engine_integration.scheduler import KvHintScheduler

    return [(cls, name) for cls in (KvHintBlockPool, KvHintKVCacheManager, KvHintScheduler)
            for name in ("get_num_free_blocks", "touch", "free_blocks", "get_new_blocks", "cache_full_blocks",
                         "_emit_block_removed_events", "_maybe_evict_cached_block", "get_computed_blocks",
                         "get_computed_blocks_for_connector", "free", "record_prefix_cache_stats", "schedule",
                         "update_from_output", "add_request")
            if name in vars(cls)]


def _stock_methods(pair: Pair) -> Callable[[], None]:
    """"hooks only", and every method KvHint's pool, manager and scheduler classes override is
    vLLM's own again (taken off the classes, so lookups find vLLM's; the objects and their
    attribute storage are untouched): what is left of KvHint on its side is its objects, the
    sidecar's threads and the driver's settle (of an empty journal). Returns the undo."""
    _callbacks(pair)
    taken = [(cls, name, vars(cls)[name]) for cls, name in _stock_overrides()]
    for cls, name, _ in taken:
        delattr(cls, name)
    sched = pair.kv.sched
    cls = type(sched)  # (the instance's own schedule / update_from_output are the Side's timers)
    pair.kv.time_steps(cls.schedule.__get__(sched), cls.update_from_output.__get__(sched))  # vLLM's now

    def undo() -> None:
        for cls, name, fn in taken:
            setattr(cls, name, fn)

    return undo


def _stock_methods_no_sidecar(pair: Pair) -> Callable[[], None]:
    """"stock methods", with the sidecar stopped (its gRPC and metrics threads gone)."""
    undo = _stock_methods(pair)
    pair.kv.sched.kvhint_server.stop()
    return undo


def _reclassed(pair: Pair) -> None:
    manager = pair.kv.sched.kv_cache_manager
    for obj in (manager.block_pool, manager):
        obj.__class__ = type(obj)  # same class; CPython turns the attribute storage into a dict


def _settler_journal(pair: Pair) -> Any:
    """The KvHint side's journal, whose settler thread runs (the settler shape)."""
    journal = pair.kv.core.journal
    if not pair.shape.settler_thread or not journal.deferring:
        raise ValueError("this variant moves the settler thread's work: it needs --shape settler")
    return journal


def _settled_after_unit(pair: Pair) -> None:
    journal = _settler_journal(pair)
    sched = pair.kv.sched
    journal.stop()
    sched.kvhint_start_settler(interval_s=3600.0)  # no periodic look during the run
    wake = journal.wake
    journal.wake = _noop  # not where schedule() ends...
    cls = type(sched)
    schedule, update = cls.schedule.__get__(sched), cls.update_from_output.__get__(sched)

    def update_then_wake(*a: Any, **k: Any) -> Any:
        try:
            return update(*a, **k)
        finally:
            wake()  # ...only where update_from_output() ends

    pair.kv.time_steps(schedule, update_then_wake)


def _settled_inline(pair: Pair) -> None:
    journal = _settler_journal(pair)
    journal.stop()
    journal.start(thread=False)
    pair.kv.shape = dataclasses.replace(pair.kv.shape, settler_thread=False)  # Side.settle settles itself


def _settles_nothing(pair: Pair) -> None:
    journal = _settler_journal(pair)

    def drop(limit: int | None = None, deadline: float | None = None) -> int:
        with journal.lock:
            n = journal.pending()
            journal._entries.clear()
            journal.settled = journal._recorded
            return n

    journal.settle = drop


def _settles_nothing_collects_after(pair: Pair) -> None:
    _settles_nothing(pair)
    journal, side = pair.kv.core.journal, pair.kv
    collect, settle = journal.collect_young, side.settle
    journal.collect_young = lambda: False

    def settle_then_collect() -> None:
        settle()
        collect()

    side.settle = settle_then_collect  # type: ignore[method-assign]


# name -> (what it changes, collector on, pair: "kvhint" | "aa" | "aa-ballast")
VARIANTS: dict[str, tuple[Callable[[Pair], Any] | None, bool, str]] = {
    "full": (None, True, "kvhint"),
    "no collector": (None, False, "kvhint"),
    "no event publishing": (_publish, True, "kvhint"),
    "no index on admission": (_stored, True, "kvhint"),
    "no index on removal": (_removed, True, "kvhint"),
    "hooks only": (_callbacks, True, "kvhint"),
    "stock methods": (_stock_methods, True, "kvhint"),
    "stock methods, no sidecar": (_stock_methods_no_sidecar, True, "kvhint"),
    "re-classed": (_reclassed, True, "kvhint"),
    "settled after the unit": (_settled_after_unit, True, "kvhint"),
    "settled inline after the unit": (_settled_inline, True, "kvhint"),
    "settler settles nothing": (_settles_nothing, True, "kvhint"),
    "settler settles nothing, collects after the unit": (_settles_nothing_collects_after, True, "kvhint"),
    "A/A": (None, True, "aa"),
    "A/A, ballast": (None, True, "aa-ballast"),
}


# The variants that move the settler thread's work (--shape settler only).
SETTLER_VARIANTS = ("settled after the unit", "settled inline after the unit", "settler settles nothing",
                    "settler settles nothing, collects after the unit")


def default_variants(shape: str | None) -> list[str]:
    """Every variant that applies to `shape` (the settler's own only with the settler shape)."""
    return [v for v in VARIANTS if shape == "settler" or v not in SETTLER_VARIANTS]


def _add_ballast(pair: Pair, ballast: list[Any]) -> None:
    side, fill = pair.kv, pair.kv.fill

    def fill_then_ballast(turn: Any) -> bool:
        ok = fill(turn)
        ballast.append([{"k": (i, str(i)), "v": [i]} for i in range(BALLAST_PER_FILL)])
        return ok

    side.fill = fill_then_ballast  # type: ignore[method-assign]


def measure(shape: Shape, name: str) -> dict[str, Any]:
    change, collector, kind = VARIANTS[name]
    pair = Pair(shape, aa=kind != "kvhint")
    ballast: list[Any] = []
    if kind == "aa-ballast":
        _add_ballast(pair, ballast)
    undo = None
    try:
        pair.fill_and_freeze()
        if change is not None:
            undo = change(pair)  # a change of classes (shared by every pair) returns its undo
        pair.steps(shape.warmup_steps, "warmup")
        pair.units.clear()
        if not collector:
            gc.disable()
        try:
            pair.steps(shape.steps, "steady")
        finally:
            gc.enable()
        units = pair.units
        stock = sum(u.stock_ns for u in units)
        kv = sum(u.kv_ns for u in units)
        return {
            "variant": name,
            "ballast_bytes": deep_stats([ballast])[0] if ballast else None,
            "steps": len(units),
            "median_ratio": round(statistics.median(u.kv_ns / u.stock_ns for u in units), 4),
            "ratio_of_totals": round(kv / stock, 4),
            "stock_ms_per_step": round(stock / len(units) / 1e6, 3),
            "extra_us_per_step": round((kv - stock) / len(units) / 1e3, 1),
        }
    finally:
        if callable(undo):
            undo()
        pair.close()


def _summary(raw: dict[str, Any]) -> list[str]:
    """With --repeat: per variant, the median and the range over its pairs."""
    by_variant: dict[str, list[dict[str, Any]]] = {}
    for r in raw["rows"]:
        by_variant.setdefault(r["variant"], []).append(r)
    out = [
        f"Each variant measured on {raw['repeat']} fresh pairs, the variants taken in turn in each round (so a drift "
        "of the machine reaches them all). Per variant, the median over its pairs and the range:",
        "",
        "| variant | pairs | median of per-step ratios: median (min - max) | ratio of totals: median (min - max) |",
        "|---|---|---|---|",
    ]
    for variant, rows in by_variant.items():
        med = [r["median_ratio"] for r in rows]
        tot = [r["ratio_of_totals"] for r in rows]
        out.append(f"| {variant} | {len(rows)} | {statistics.median(med):.3f}x ({min(med):.3f}x - {max(med):.3f}x) "
                   f"| {statistics.median(tot):.3f}x ({min(tot):.3f}x - {max(tot):.3f}x) |")
    out += ["", "Every pair:", ""]
    return out


def markdown(raw: dict[str, Any]) -> str:
    rows = raw["rows"]
    repeat = raw.get("repeat", 1)
    out = [
        "# Where the no-hints scheduler cost goes (bench.scale's paired steps, one piece removed at a time)",
        "",
        f"Command: `{raw['command']}`. {raw['shape']}; {rows[0]['steps']} measured steps per variant, each a fresh "
        "stock/KvHint pair. A no-op'd piece leaves KvHint's state wrong: this is a diagnostic (see the module doc "
        "of bench/scale_ablation.py).",
        "",
        *(_summary(raw) if repeat > 1 else []),
        "| variant | median of per-step ratios | ratio of totals | stock ms per step | KvHint - stock us per step "
        "| us per step against full |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:  # against the full variant of the same round (the only one without --repeat)
        full = next((f for f in rows if f["variant"] == "full" and f.get("round") == r.get("round")), None)
        against = "-" if full is None or r is full else f"{r['extra_us_per_step'] - full['extra_us_per_step']:+.0f}"
        variant = r["variant"]
        if r.get("ballast_bytes"):
            variant += f" ({r['ballast_bytes'] / 2**20:.0f} MiB)"
        if repeat > 1:
            variant += f", pair {r['round'] + 1}"
        out.append(
            f"| {variant} | {r['median_ratio']:.3f}x | {r['ratio_of_totals']:.3f}x | {r['stock_ms_per_step']:.3f} "
            f"| {r['extra_us_per_step']:.0f} | {against} |"
        )
    out.append("")
    out.append("KvHint side: the second side (for A/A, a second stock scheduler). Bookkeeping: "
               f"{raw.get('bookkeeping', 'auto')} (KVHINT_RESIDENCY_BOOKKEEPING; a deferred side's journal is "
               "settled after each step, outside the timed region).")
    out.append("")
    return "\n".join(out)


def build_shape(pool: int, sessions: int, steps: int, bookkeeping: str, shape: str | None = None) -> Shape:
    """The measured Shape: bench.scale's workload, with `shape`'s fields (bench.scale_ab.SHAPES)."""
    return Shape(pool, sessions, steps=steps, **{"bookkeeping": bookkeeping, **(SHAPES[shape] if shape else {})})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scale_ablation", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool", type=int, default=16384)
    ap.add_argument("--sessions", type=int, default=10000)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--bookkeeping", default="auto", choices=("auto", "inline", "deferred"))
    ap.add_argument("--shape", default=None, choices=[n for n in SHAPES if n != "aa"],
                    help="one of bench.scale_ab's shapes (default: bench.scale's workload as --bookkeeping says)")
    ap.add_argument("--variants", nargs="*", default=None, choices=list(VARIANTS),
                    help="default: every variant that applies to the shape")
    ap.add_argument("--repeat", type=int, default=1,
                    help="measure every variant on this many fresh pairs, the variants in turn in each round")
    ap.add_argument("--out", default="bench/results/scale_ablation.md")
    a = ap.parse_args(argv)
    if a.repeat < 1:
        ap.error("--repeat must be at least 1")
    defaults = default_variants(a.shape)
    if a.variants is None:
        a.variants = defaults
    wrong = [v for v in a.variants if v in SETTLER_VARIANTS and a.shape != "settler"]
    if wrong:
        ap.error(f"{', '.join(map(repr, wrong))}: each moves the settler thread's work, so it needs --shape settler")
    shape = build_shape(a.pool, a.sessions, a.steps, a.bookkeeping, a.shape)
    command = "python -m bench.scale_ablation" + "".join(
        f" --{k} {v}" for k, v, d in (
            ("pool", a.pool, 16384), ("sessions", a.sessions, 10000), ("steps", a.steps, 150),
            ("bookkeeping", a.bookkeeping, "auto"), ("shape", a.shape, None), ("repeat", a.repeat, 1),
        ) if v != d
    ) + ("" if a.variants == defaults else " --variants " + " ".join(shlex.quote(v) for v in a.variants)) + (
        "" if a.out == "bench/results/scale_ablation.md" else f" --out {a.out}")
    raw: dict[str, Any] = {"command": command, "shape": shape.label, "bookkeeping": a.bookkeeping, "repeat": a.repeat,
                           "rows": []}
    t0 = time.monotonic()
    for round_ in range(a.repeat):
        for name in a.variants:
            row = measure(shape, name)
            if a.repeat > 1:
                row["round"] = round_
            raw["rows"].append(row)
            print(f"[scale_ablation] {name}: {row}", flush=True)
    raw["wall_s"] = round(time.monotonic() - t0, 1)
    write_results(a.out, raw, markdown(raw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
