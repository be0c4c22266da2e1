"""What assigning `__class__` costs vLLM's own code: the same vLLM methods timed on objects built
as their class and on the same kind of objects re-classed after construction.

    python -m bench.reclass_probe [--calls 200000] [--rounds 7] [--out bench/results/reclass_probe.md]

KvHint used to hook vLLM by assigning `__class__` on the KVCacheManager and BlockPool that vLLM
had built. CPython (3.11, 3.12) then keeps such an object's attributes in a plain dict, and
the specialised attribute loads of every method that reads `self.<attribute>` no longer apply.
KvHint now has vLLM build its classes (engine_integration/hooks.py). This diagnostic measures
the effect on two vLLM methods that do little besides reading attributes:
`BlockPool.get_num_free_blocks` and `KVCacheManager.usage`, called through vLLM's code on two
stock schedulers built alike, one of which has its pool and manager re-classed to their own
class (`obj.__class__ = type(obj)`: nothing else changes). The rounds alternate which object goes
first; each cell is the best round's nanoseconds per call.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

OUT = Path("bench/results/reclass_probe.md")


def _per_call_ns(fn: Any, calls: int) -> float:
    t = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - t) / calls


def measure(calls: int, rounds: int, num_blocks: int = 16384) -> list[dict[str, Any]]:
    from engine_integration import inproc

    built = inproc.make_scheduler(num_blocks=num_blocks, kvhint=False)
    reclassed = inproc.make_scheduler(num_blocks=num_blocks, kvhint=False)
    try:
        for obj in (reclassed.kv_cache_manager.block_pool, reclassed.kv_cache_manager):
            obj.__class__ = type(obj)
        rows = []
        for name, target in (("BlockPool.get_num_free_blocks", lambda s: s.kv_cache_manager.block_pool.get_num_free_blocks),
                             ("KVCacheManager.usage", lambda s: lambda: s.kv_cache_manager.usage)):
            fns = {"built": target(built), "re-classed": target(reclassed)}
            best = {k: float("inf") for k in fns}
            for r in range(rounds):
                order = list(fns) if r % 2 == 0 else list(reversed(fns))
                for k in order:
                    best[k] = min(best[k], _per_call_ns(fns[k], calls))
            rows.append({"method": name, "built_ns": round(best["built"], 1), "reclassed_ns": round(best["re-classed"], 1),
                         "ratio": round(best["re-classed"] / best["built"], 3)})
        return rows
    finally:
        inproc.close(built)
        inproc.close(reclassed)


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    out = [
        "# vLLM's methods on objects built as their class and on re-classed objects",
        "",
        f"Command: `{command}`. Python {platform.python_version()} ({platform.python_implementation()}), "
        f"{platform.machine()}. Two stock schedulers built alike; the second's KVCacheManager and BlockPool get "
        "`obj.__class__ = type(obj)` (see the module doc of bench/reclass_probe.py). Best round, nanoseconds per call.",
        "",
        "| vLLM method | built | re-classed | re-classed / built |",
        "|---|---|---|---|",
    ]
    for r in rows:
        out.append(f"| `{r['method']}` | {r['built_ns']:.1f} | {r['reclassed_ns']:.1f} | {r['ratio']:.2f}x |")
    out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200_000, help="calls per round and object")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    if a.calls < 1 or a.rounds < 1:
        ap.error("--calls and --rounds must be at least 1")
    args = [f"--calls {a.calls}" if a.calls != 200_000 else "", f"--rounds {a.rounds}" if a.rounds != 7 else "",
            f"--out {shlex.quote(a.out)}" if a.out != str(OUT) else ""]
    command = " ".join(["python -m bench.reclass_probe", *[x for x in args if x]])
    text = markdown(measure(a.calls, a.rounds), command)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
