"""Host retention against vLLM's LRU host, from bench.agentic_engine result directories.

Each directory is one `python -m bench.agentic_engine --runs offload,policy+tiers ...`
invocation (its own engine): the unhinted tier run (f) and the policy with tiers (g2), each
repeated. This script reads their results.json and writes one table: the recomputed prompt
tokens of every engine run, grouped by host policy (`host-eviction=kvhint`, which honours
Retain, against vLLM's LRU), and the medians over all repeats of each group side by side.

    python -m bench.host_retention_report \\
        --retention bench/results/default-seed0-host-retention-grants bench/results/default-seed0-host-retention-grants-2 \\
        --lru bench/results/default-seed0-host-lru-grants bench/results/default-seed0-host-lru-grants-2 \\
        --before bench/results/default-seed0-host-retention-b9fe514 \\
        --out bench/results/host_retention_grants.md

`--before`: the same host policy run on the code before grants outlived the device copy (a
control: it tells the change apart from the machine and the run).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .report import machine, write_markdown

RUNS = (("offload", "(f) tiers, no hints"), ("policy+tiers", "(g2) kvhint_client.policy + tiers"))


def load(directory: str) -> dict[str, Any]:
    path = Path(directory) / "results.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"host_retention_report: cannot read {path}: {exc}") from exc
    missing = [run for run, _ in RUNS if run not in data.get("runs_each_repeat", {})]
    if missing:
        raise SystemExit(f"host_retention_report: {path} has no {', '.join(missing)} runs")
    return data


def recomputed(data: dict[str, Any], run: str) -> list[int]:
    return [int(r["recomputed_tokens"]) for r in data["runs_each_repeat"][run]]


BEFORE = "host-eviction=kvhint, code before grants outlived the device copy"


def report(retention: Sequence[str], lru: Sequence[str], before: Sequence[str] = ()) -> list[str]:
    groups = {"host-eviction=kvhint": [(d, load(d)) for d in retention], "LRU (vLLM's)": [(d, load(d)) for d in lru]}
    if before:
        groups[BEFORE] = [(d, load(d)) for d in before]
    infinite = {data["offline"]["results"]["infinite"]["recomputed_tokens"] for dirs in groups.values() for _, data in dirs}
    if len(infinite) != 1:
        raise SystemExit(f"host_retention_report: the directories replay different traces (infinite cache {sorted(infinite)})")
    (inf,) = infinite
    lines = [
        f"Machine: {machine()}. Recomputed prompt tokens of each engine run (lower is better), per invocation "
        "(its own engine, runs interleaved f, g2, f, g2), in the order given; the infinite cache (offline) "
        f"recomputes {inf}.",
        "",
        "| host policy | result directory | commit | (f) per repeat | (g2) per repeat |",
        "|---|---|---|---|---|",
    ]
    medians: dict[str, dict[str, float]] = {}
    for name, dirs in groups.items():
        every: dict[str, list[int]] = {run: [] for run, _ in RUNS}
        for directory, data in dirs:
            commit = (data.get("code_version") or {}).get("commit", "")[:7]
            cells = []
            for run, _ in RUNS:
                values = recomputed(data, run)
                every[run] += values
                cells.append(", ".join(str(v) for v in values))
            lines.append(f"| {name} | `{directory}` | {commit} | {cells[0]} | {cells[1]} |")
        medians[name] = {run: statistics.median(values) for run, values in every.items()}
    kv, lru_m = medians["host-eviction=kvhint"], medians["LRU (vLLM's)"]
    lines += [
        "",
        "Medians over every repeat of each host policy:",
        "",
        "| host policy | (f) median | (g2) median | (g2) / (f) | (g2) / infinite cache |",
        "|---|---|---|---|---|",
    ]
    for name, m in medians.items():
        lines.append(
            f"| {name} | {m['offload']:.0f} | {m['policy+tiers']:.0f} | {m['policy+tiers'] / m['offload']:.2f}x "
            f"| {m['policy+tiers'] / inf:.2f}x |"
        )
    lines += [
        "",
        f"(g2) with host retention / (g2) with the LRU host: {kv['policy+tiers'] / lru_m['policy+tiers']:.2f}x; "
        f"(f), where no hint is in effect and both policies are the same LRU: "
        f"{kv['offload'] / lru_m['offload']:.2f}x.",
    ]
    if before:
        old = medians[BEFORE]
        lines.append(
            f"The same host policy on the code before (`--before`, its commit in the first table), where a grant "
            f"ended with the block's last device copy: (g2) {old['policy+tiers'] / lru_m['policy+tiers']:.2f}x the "
            f"LRU host's; with grants that outlive the device copy: {kv['policy+tiers'] / old['policy+tiers']:.2f}x "
            "the code before."
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.host_retention_report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--retention", nargs="+", required=True, help="result directories run with host-eviction=kvhint")
    ap.add_argument("--lru", nargs="+", required=True, help="result directories run with vLLM's LRU host policy")
    ap.add_argument("--before", nargs="*", default=[],
                    help="result directories run with host-eviction=kvhint on earlier code (a control)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    write_markdown(args.out, "Host retention against vLLM's LRU host (agentic replay, engine runs)",
                   "bench.host_retention_report", argv, report(args.retention, args.lru, args.before))


if __name__ == "__main__":
    main()
