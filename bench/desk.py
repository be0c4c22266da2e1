"""A held-out trace shape that `bench.generate` does not make: a support desk, with users who leave.

    python -m bench.desk [--seeds 8]   # writes bench/results/policy/desk.{md,json}
    python -m bench.desk --report-only # desk.md again from desk.json

Three tenants with their own system prompts (384, 640 and 1024 tokens). Tools are known only by
name: order lookups (0.2-1 s) and knowledge-base searches (1-3 s), waits for the customer
(20-120 s) and escalations to a human (60-300 s), uniform within each range. A share of the users
(`leave_prob`) leave after an answer and the runtime never signals the end. The trace reads as a
router would record it: literal segments, no duration classes, and a `session_ended` that comes
half a second after the last request starts, usually before that answer has completed.

Each seed is run twice, with a quarter of the users leaving and with every end signalled, through
LRU, the earlier reference policy, `kvhint_client.policy` (cold) and Belady in the sequential
simulator (`bench.simulate`, a 200-block pool). The tables are generated from desk.json;
docs/design-notes.md quotes them.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any

from bench.reference_policy import policy_variant
from bench.report import command_line
from bench.simulate import compile_trace, simulate_belady, simulate_hinted, simulate_library, simulate_lru
from bench.trace import Trace

OUT = "bench/results/policy/desk"
TENANTS = {"acme": 384, "globex": 640, "initech": 1024}
#: (tool, weight, (shortest, longest) seconds)
TOOLS = [
    ("lookup_order", 0.4, (0.2, 1.0)),
    ("kb_search", 0.3, (1.0, 3.0)),
    ("wait_customer", 0.2, (20.0, 120.0)),
    ("escalate_human", 0.1, (60.0, 300.0)),
]
LEAVE_PROB = 0.25


def desk_trace(seed: int, *, leave_prob: float = LEAVE_PROB, sessions: int = 60, pool: int = 200) -> Trace:
    """The support-desk trace of `seed` (module doc); deterministic in its arguments. The users
    who leave are drawn independently of everything else, so `leave_prob` 0 is the same traffic
    with every end signalled."""
    rng = random.Random(seed)
    events: list[dict[str, Any]] = []
    t0 = 0.0
    for s in range(sessions):
        sid = f"desk-{s}"
        tenant = rng.choice(sorted(TENANTS))
        prompt: list[dict[str, Any]] = [{"seg": f"sys/{tenant}", "len": TENANTS[tenant]}]
        t, t0 = t0, t0 + rng.expovariate(1 / 6.0)
        turns = rng.randint(2, 9)
        leaves = rng.random() < leave_prob
        for k in range(turns):
            prompt = [*prompt, {"seg": f"u/{sid}/{k}", "len": rng.randint(30, 200)}]
            tokens = sum(p["len"] for p in prompt)
            if tokens + 48 > 3500:
                break
            max_tokens = rng.randint(16, 48)
            done = t + 0.03 + tokens / 3000 + max_tokens * 0.005
            rid = f"{sid}-{k}"
            events.append({"kind": "request", "t": round(t, 3), "request_id": rid, "session_id": sid,
                           "prompt": prompt, "max_tokens": max_tokens, "t_done": round(done, 3)})
            prompt = [*prompt, {"out": rid, "len": max_tokens}]
            if k == turns - 1:
                break
            r, acc = rng.random(), 0.0
            for name, weight, (lo, hi) in TOOLS:
                acc += weight
                if r <= acc:
                    break
            events.append({"kind": "tool_call_started", "t": round(done, 3), "session_id": sid, "tool": name})
            prompt = [*prompt, {"seg": f"tool/{sid}/{k}", "len": rng.randint(20, 300)}]
            t = done + rng.uniform(lo, hi)
        if not leaves:
            events.append({"kind": "session_ended", "t": round(t + 0.5, 3), "session_id": sid})
    events.sort(key=lambda e: (e["t"], e["kind"] != "request"))
    header = {"format": "kvhint-trace", "version": 1, "block_size": 32, "vocab_size": 4096, "min_token_id": 3,
              "num_gpu_blocks": pool, "max_model_len": 4096}
    return Trace.loads("\n".join(json.dumps(x) for x in [header, *events]) + "\n")


def measure(seed: int, leave_prob: float) -> dict[str, Any]:
    """Recomputed prompt tokens per run on one desk trace."""
    bt = compile_trace(desk_trace(seed, leave_prob=leave_prob))
    reference = simulate_hinted(bt, policy_variant("hints+release", bt.policy_config), name="hints+release")
    return {
        "seed": seed,
        "leave_prob": leave_prob,
        "prompt_tokens": bt.prompt_tokens,
        "lru": simulate_lru(bt).recomputed_tokens,
        "reference": reference.recomputed_tokens,
        "policy": simulate_library(bt).recomputed_tokens,
        "belady": simulate_belady(bt, bt.num_gpu_blocks).recomputed_tokens,
    }


def share(row: dict[str, Any], run: str) -> float:
    """The run's share of Belady's savings over LRU."""
    return (row["lru"] - row[run]) / (row["lru"] - row["belady"])


def report(raw: dict[str, Any]) -> str:
    rows = raw["rows"]
    by = {(r["seed"], r["leave_prob"]): r for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    out = ["# Support-desk traces: users who leave without an end signal (`bench.desk`)", "",
           f"Command: `{raw['command']}`  ",
           "Sequential simulator, 200-block pool, 60 sessions per trace (module doc of bench/desk.py). "
           "Recomputed prompt tokens relative to LRU (lower is better) and share of Belady's savings "
           f"over LRU. 'leavers': {LEAVE_PROB:.0%} of the users leave without a session_ended; "
           "'all ends': the same traffic with every end signalled.", "",
           "| seed | leavers: reference / LRU | leavers: policy / LRU | leavers: Belady / LRU | leavers: policy share "
           "| all ends: policy / LRU | all ends: policy share | share lost to leavers |",
           "|---|---|---|---|---|---|---|---|"]
    worst = 0.0
    for seed in seeds:
        a, b = by[(seed, LEAVE_PROB)], by[(seed, 0.0)]
        lost = share(b, "policy") - share(a, "policy")
        worst = max(worst, a["policy"] / a["lru"])
        out.append(f"| {seed} | {a['reference'] / a['lru']:.3f} | {a['policy'] / a['lru']:.3f} | {a['belady'] / a['lru']:.3f} "
                   f"| {share(a, 'policy'):.2f} | {b['policy'] / b['lru']:.3f} | {share(b, 'policy'):.2f} | {lost:+.2f} |")
    leavers = [share(by[(s, LEAVE_PROB)], "policy") for s in seeds]
    ends = [share(by[(s, 0.0)], "policy") for s in seeds]
    out += ["", f"* Policy / LRU with leavers: at most {worst:.3f} (never worse than LRU: "
            f"{'met' if worst <= 1.0 else 'missed'}).",
            f"* Mean share of Belady's savings: {statistics.mean(leavers):.2f} with leavers, "
            f"{statistics.mean(ends):.2f} with every end signalled.", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.desk", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=8, help="seeds 1..N (default 8)")
    ap.add_argument("--out", default=OUT, help="path prefix of the .md and .json written")
    ap.add_argument("--report-only", action="store_true", help="regenerate the .md from the .json")
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error("--seeds must be >= 1")
    if args.report_only:
        raw = json.loads(Path(args.out + ".json").read_text())
    else:
        rows = [measure(seed, p) for seed in range(1, args.seeds + 1) for p in (LEAVE_PROB, 0.0)]
        raw = {"command": command_line("bench.desk", argv), "rows": rows}
        Path(args.out + ".json").parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".json").write_text(json.dumps(raw, indent=1) + "\n")
    text = report(raw)
    Path(args.out + ".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
