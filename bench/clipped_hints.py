"""What a Pin clipped by a block budget grants, and what the session's resume then hits, with the
executor's window-tail trim (kvhint_server/window_tails.py) and without it (the code before it:
the trim replaced by the identity), side by side in one run.

In-process, on vLLM's real scheduler, KVCacheManager and BlockPool with KvHint installed (no
model): 16-token blocks, a 64-token sliding window, vLLM's default
prefix_cache_retention_interval=0 (window tails only at prompt ends). Layouts: dense (one
full-attention group), hybrid (a full-attention and a window group) and two windows (two window
groups and a full-attention one, as Gemma 3 has five). After the hints, every free block is
taken once and given back (whatever no hint protects is evicted), then each session resumes.

  one turn    one 20-block prompt; Pin(max_blocks=15)
  two turns   turns of 10 and 20 blocks; Pin(max_blocks=15)
  pin budget  a pin budget of 12 blocks; session A (turns of 8 and 16 blocks) pinned, then B (4 blocks)

    python -m bench.clipped_hints        # writes bench/results/clipped_hints.md (+ .json)
    python -m bench.clipped_hints --scenarios "one turn" --layouts dense hybrid --out /tmp/c.md
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .report import command_line, machine, write_results

BLOCK = 16
WINDOW = 64
RESULTS = Path(__file__).resolve().parent / "results" / "clipped_hints.md"
LAYOUTS = ("dense", "hybrid", "two windows")
SCENARIOS = ("one turn", "two turns", "pin budget")


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(3, 4000) for _ in range(n)]


@contextlib.contextmanager
def _scheduler(layout: str, num_blocks: int) -> Iterator[Any]:
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    from engine_integration import inproc

    def config(cfg: Any) -> None:
        cfg.prefix_cache_retention_interval = 0
        full, window = cfg.kv_cache_groups
        if layout == "dense":
            cfg.kv_cache_groups[:] = [full]
        elif layout == "two windows":
            cfg.kv_cache_groups[:] = [window, KVCacheGroupSpec(["window.1"], window.kv_cache_spec), full]

    with inproc.running_scheduler(num_blocks=num_blocks, block_size=BLOCK, hybrid=True, sliding_window=WINDOW,
                                  edit_kv_cache_config=config) as s:
        yield s


def _run(s: Any, rid: str, prompt: list[int], sid: str) -> int:
    from engine_integration import inproc

    s.add_request(inproc.make_request(rid, prompt, session_id=sid, max_tokens=1, block_size=BLOCK))
    hit = 0
    while inproc.busy(s):
        hit = inproc.step(s).prefix_hits.get(rid, hit)
    return hit


def _pin(s: Any, *hints: tuple[str, int]) -> list[Any]:
    from kvhint.v1 import kvhint_pb2 as pb
    from kvhint_server.validation import parse_apply_request

    msgs = [pb.Hint(selector=pb.Selector(session=pb.SessionSelector(session_id=sid)), max_blocks=mb,
                    pin=pb.PinAction(ttl={"seconds": 60})) for sid, mb in hints]
    core = s.kvhint_core
    parsed = parse_apply_request(pb.ApplyHintsRequest(hints=msgs), core.config, core.info)
    with core.exclusive():
        return core.executor.apply_batch(parsed).results


def _pressure(s: Any) -> None:
    pool = s.kv_cache_manager.block_pool
    pool.free_blocks(pool.get_new_blocks(pool.free_block_queue.num_free_blocks))


def _turns(s: Any, sid: str, seed: int, *blocks: int) -> list[int]:
    prompt: list[int] = []
    for i, n in enumerate(blocks):
        prompt = prompt + _tokens(seed + i, (n - len(prompt) // BLOCK) * BLOCK)
        _run(s, f"{sid}-t{i}", prompt, sid)
    return prompt


def _row(result: Any) -> dict[str, Any]:
    return {
        "outcome": result.outcome.name,
        "clips": [[c.reason.name, c.requested_blocks, c.granted_blocks] for c in result.clips],
        "granted": sum(result.affected.values()),
    }


def scenario(name: str, layout: str) -> list[dict[str, Any]]:
    """One scenario on one layout: a row per pinned session."""
    if name == "pin budget":
        os.environ["KVHINT_PIN_BUDGET_FRACTION"] = "0.2"  # int(0.2 * 63) = 12 blocks
        try:
            with _scheduler(layout, 64) as s:
                a = _turns(s, "A", 1, 8, 16)
                b = _turns(s, "B", 7, 4)
                ra, rb = _pin(s, ("A", 0), ("B", 0))
                _pressure(s)
                hits = [_run(s, "A-r", a + _tokens(99, 20), "A"), _run(s, "B-r", b + _tokens(98, 20), "B")]
        finally:
            del os.environ["KVHINT_PIN_BUDGET_FRACTION"]
        return [{"session": "A", **_row(ra), "hit": hits[0]}, {"session": "B", **_row(rb), "hit": hits[1]}]
    with _scheduler(layout, 96) as s:
        prompt = _turns(s, "A", 1, 20) if name == "one turn" else _turns(s, "A", 1, 10, 20)
        (r,) = _pin(s, ("A", 15))
        _pressure(s)
        hit = _run(s, "A-r", prompt + _tokens(99, 20), "A")
    return [{"session": "A", **_row(r), "hit": hit}]


def measure(scenarios: tuple[str, ...] = SCENARIOS, layouts: tuple[str, ...] = LAYOUTS) -> list[dict[str, Any]]:
    from kvhint_server.executor import HintExecutor

    trim = HintExecutor._resumable
    rows = []
    for name in scenarios:
        for layout in layouts:
            for mode in ("without the trim", "with the trim"):
                HintExecutor._resumable = trim if mode == "with the trim" else (lambda self, hashes, tiers, clips, **_: hashes)
                try:
                    for row in scenario(name, layout):
                        rows.append({"scenario": name, "layout": layout, "mode": mode, **row})
                finally:
                    HintExecutor._resumable = trim
    return rows


def render(rows: list[dict[str, Any]], argv: list[str] | None) -> str:
    lines = [
        "# A Pin clipped by a block budget: blocks granted and the resume's hit, with and without the window-tail trim",
        "",
        f"Command: `{command_line('bench.clipped_hints', argv)}`. Machine: {machine()}. "
        "In-process vLLM scheduler, KVCacheManager and BlockPool (no model), 16-token blocks, 64-token window, "
        "window tails only at prompt ends; scenarios and layouts in the module doc of bench/clipped_hints.py. "
        "Without the trim is the code before it (the executor's trim replaced by the identity).",
        "",
        "| scenario | layout | session | mode | outcome | clips (reason, requested, granted) | blocks granted | resume hit (tokens) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        clips = "; ".join(f"{c[0]} {c[1]}->{c[2]}" for c in r["clips"]) or "-"
        lines.append(f"| {r['scenario']} | {r['layout']} | {r['session']} | {r['mode']} | {r['outcome']} | {clips} | "
                     f"{r['granted']} | {r['hit']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    args = parser.parse_args(argv)
    rows = measure(tuple(args.scenarios), tuple(args.layouts))
    write_results(args.out, {"rows": rows}, render(rows, argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
