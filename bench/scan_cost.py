"""The cost of the retention order's per-block scans: what the engine thread reads per block.

With retention grants in effect, the engine thread finds the cached blocks each freed request
put back in the free queue (`VllmAdapter.refile_freed`) and checks each prefix hit's blocks
(`KvHintBlockPool.touch`): in bench.scale's grants shape about 630 freed and 580 touched blocks
per step, of which about 17% and 10% are free. vLLM's KVCacheBlock has `__slots__`; this times,
side by side in one run over real KVCacheBlock objects and vLLM's real free queue:

  refile, shipped        `vllm_private.appended_since(pool, mark)`: a walk back from the free
                         queue's tail to where it ended before the free, over the freed cached
                         blocks only, then the key check of `refile_freed`;
  refile, comprehension  the scan it replaced (commit b606e57): a copy of the freed blocks
                         (the hook's `list(ordered_blocks)`, needed for a second pass), then a
                         comprehension reading `ref_cnt` and `_block_hash` of every freed block;
  refile, map            the scan before that: the copy, then `zip(blocks,
                         map(attrgetter("_block_hash"), blocks))` with the ref_cnt and key checks
                         in the loop body;
  refile, compress       a C-level prefilter: the copy, then `compress(blocks, map(not_,
                         map(attrgetter("ref_cnt"), blocks)))`, then the keys of the free ones;
  touch, shipped         the loop of `KvHintBlockPool.touch`: `not block.ref_cnt and
                         block.block_id in filed` per block;
  touch, isdisjoint      the check it replaced: `filed.keys().isdisjoint(map(attrgetter(
                         "block_id"), blocks))` before that loop (here no touched block is filed,
                         the usual case, so the loop never runs).

For each fraction of free blocks, the median over rounds of the best of several timeit repeats,
in microseconds per scan of N blocks.

  python -m bench.scan_cost            # writes bench/results/scan_cost.{md,json}
  python -m bench.scan_cost --quick    # small, prints only
"""

from __future__ import annotations

import argparse
import operator
import random
import statistics
import sys
import timeit
from collections.abc import Callable
from itertools import compress
from typing import Any

from types import SimpleNamespace

from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from bench.report import command_line, git_head, machine, write_results
from engine_integration import vllm_private

OUT = "bench/results/scan_cost.md"
CUT = slice(None, -4)  # pool key (digest + 4-byte group id) -> external hash, as the adapter slices it
_key = operator.attrgetter("_block_hash")
_ref_cnt = operator.attrgetter("ref_cnt")
_block_id = operator.attrgetter("block_id")


def make_blocks(n: int, free_fraction: float, granted_fraction: float, rng: random.Random) -> tuple[list[Any], dict[bytes, int]]:
    """`n` cached KVCacheBlocks, `free_fraction` of them free; a grants dict (2800 other blocks,
    plus `granted_fraction` of the free ones)."""
    blocks, grants = [], {rng.randbytes(32): 1 for _ in range(2800)}
    for i in range(n):
        block: Any = KVCacheBlock(rng.randrange(1 << 17))
        block._block_hash = rng.randbytes(32) + b"\0\0\0\0"
        block.ref_cnt = 0 if rng.random() < free_fraction else 2
        if block.ref_cnt == 0 and rng.random() < granted_fraction:
            grants[block._block_hash[CUT]] = 1
        blocks.append(block)
    return blocks, grants


def freed(blocks: list[Any], grants: dict[bytes, int]) -> SimpleNamespace:
    """One free as the refile scans see it: `blocks` just freed, and a pool whose free queue
    (64 blocks free before) got the free cached ones appended, as BlockPool.free_blocks does;
    `mark` is the queue's tail before."""
    queue = FreeKVCacheBlockQueue([KVCacheBlock(-2 - i) for i in range(64)])
    pool = SimpleNamespace(free_block_queue=queue)
    mark = vllm_private.queue_tail(pool)
    queue.append_n([b for b in blocks if not b.ref_cnt and b._block_hash is not None])
    return SimpleNamespace(blocks=blocks, grants=grants, pool=pool, mark=mark)


def refile_shipped(case: SimpleNamespace) -> int:
    n, grants = 0, case.grants
    for _block, key in vllm_private.appended_since(case.pool, case.mark):
        if key[CUT] in grants:
            n += 1
    return n


def refile_comprehension(case: SimpleNamespace) -> int:
    n, grants = 0, case.grants
    blocks = list(case.blocks)
    for block, key in [(b, k) for b in blocks if not b.ref_cnt and (k := b._block_hash) is not None]:
        if key[CUT] in grants and block.pool is None:
            n += 1
    return n


def refile_map(case: SimpleNamespace) -> int:
    n, grants = 0, case.grants
    blocks = list(case.blocks)
    for block, key in zip(blocks, map(_key, blocks)):
        if key is not None and block.ref_cnt == 0 and key[CUT] in grants and block.pool is None:
            n += 1
    return n


def refile_compress(case: SimpleNamespace) -> int:
    n, grants = 0, case.grants
    blocks = list(case.blocks)
    free = [*compress(blocks, map(operator.not_, map(_ref_cnt, blocks)))]
    for block, key in zip(free, map(_key, free)):
        if key is not None and key[CUT] in grants and block.pool is None:
            n += 1
    return n


def touch_shipped(blocks: list[Any], filed: dict[int, Any]) -> int:
    n = 0
    for block in blocks:
        if not block.ref_cnt and block.block_id in filed:
            n += 1
    return n


def touch_isdisjoint(blocks: list[Any], filed: dict[int, Any]) -> int:
    n = 0
    if not filed.keys().isdisjoint(map(_block_id, blocks)):
        for block in blocks:
            if block.ref_cnt == 0 and block.block_id in filed:
                n += 1
    return n


SCANS: dict[str, tuple[str, Callable[..., int]]] = {
    "refile, shipped": ("refile", refile_shipped),
    "refile, comprehension": ("refile", refile_comprehension),
    "refile, map": ("refile", refile_map),
    "refile, compress": ("refile", refile_compress),
    "touch, shipped": ("touch", touch_shipped),
    "touch, isdisjoint": ("touch", touch_isdisjoint),
}


def measure(sizes: dict[str, int], fractions: list[float], rounds: int, number: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for fraction in fractions:
        refile_blocks, grants = make_blocks(sizes["refile"], fraction, 0.02, rng)
        touch_blocks, _ = make_blocks(sizes["touch"], fraction, 0.0, rng)
        touched = {b.block_id for b in touch_blocks}
        filed = {i: None for i in rng.sample(range(1 << 17), 1800) if i not in touched}  # none touched
        inputs: dict[str, tuple[Any, ...]] = {"refile": (freed(refile_blocks, grants),), "touch": (touch_blocks, filed)}
        # The variants of one scan must agree on what they find.
        for kind in ("refile", "touch"):
            found = {name: fn(*inputs[kind]) for name, (k, fn) in SCANS.items() if k == kind}
            if len(set(found.values())) != 1:
                raise AssertionError(f"{kind} variants disagree: {found}")
        per_round: dict[str, list[float]] = {name: [] for name in SCANS}
        for _ in range(rounds):
            for name in rng.sample(list(SCANS), len(SCANS)):
                kind, fn = SCANS[name]
                args = inputs[kind]
                best = min(timeit.repeat(lambda: fn(*args), number=number, repeat=5))
                per_round[name].append(best / number * 1e6)
        for name, vals in per_round.items():
            kind = SCANS[name][0]
            rows.append({"scan": name, "blocks": sizes[kind], "free_fraction": fraction,
                         "us_per_scan": round(statistics.median(vals), 2),
                         "us_min": round(min(vals), 2), "us_max": round(max(vals), 2)})
    return rows


def markdown(raw: dict[str, Any]) -> str:
    out = [
        "# The retention order's per-block scans: a walk of the free queue's tail, bytecode slot reads, attrgetter maps",
        "",
        f"Command: `{raw['command']}`. Machine: {raw['machine']}; commit {raw['commit'][:7]}"
        f"{' (with uncommitted changes)' if raw['dirty'] else ''}. Real vLLM KVCacheBlock objects and free queue; median over "
        f"{raw['rounds']} rounds of the best of 5 timeit repeats (module doc of bench/scan_cost.py). "
        "Microseconds per scan.",
        "",
        "| scan | blocks | free fraction | us per scan (min - max) | against shipped |",
        "|---|---|---|---|---|",
    ]
    kind = {name: k for name, (k, _) in SCANS.items()}
    shipped = {(kind[r["scan"]], r["free_fraction"]): r["us_per_scan"] for r in raw["rows"] if r["scan"].endswith("shipped")}
    for r in raw["rows"]:
        base = shipped[(kind[r["scan"]], r["free_fraction"])]
        out.append(f"| {r['scan']} | {r['blocks']} | {r['free_fraction']:.2f} | {r['us_per_scan']:.2f} "
                   f"({r['us_min']:.2f} - {r['us_max']:.2f}) | {r['us_per_scan'] / base:.2f}x |")
    out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scan_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, one round; print only")
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args(argv)
    if a.quick:
        rounds, rows = 1, measure({"refile": 50, "touch": 50}, [0.17], rounds=1, number=20)
    else:
        rounds, rows = 7, measure({"refile": 630, "touch": 580}, [0.05, 0.17, 0.5, 1.0], rounds=7, number=200)
    commit, dirty = git_head()
    raw = {"command": command_line("bench.scan_cost", argv), "machine": machine(), "commit": commit, "dirty": dirty,
           "rounds": rounds, "rows": rows}
    text = markdown(raw)
    if a.quick:
        print(text)
    else:
        write_results(a.out, raw, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
