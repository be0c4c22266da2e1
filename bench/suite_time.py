"""Where the test suite's time goes: per tier and per module, for one or more full runs.

Reads pytest's JUnit XML reports (`python3 -m pytest -q --junit-xml=RUN.xml`, the README's command
with a report) and writes one table per measure, the runs side by side, in the order given:

- each run's wall time (the report's own `time`) and its tests' summed time;
- the engine tier (tests that carry the `engine` marker, read from the test files: a module's
  `pytestmark = pytest.mark.engine` or a function's `@pytest.mark.engine`) and the fast tier;
- the modules that took longest in the first run.

    python -m bench.suite_time LABEL=RUN.xml [LABEL=RUN.xml ...] [--about LABEL=TEXT ...] [--out bench/results/suite_time.md]

`--about` says what a run was (its commit, its command line); the table lists it under the runs.
A run made of pytest runs one after the other (scripts/test.sh: the fast tier, then the engine
tier) is `LABEL=FIRST.xml+SECOND.xml`: its wall time is theirs added up, and so is everything else.
Pytest runs at the same time (the engine tier's two lanes in bench/results/engine_lanes_ab.md) are
joined with a comma, as in
`LABEL=FAST.xml+POOL.xml,OWN.xml`: such a part's wall time is its longest report's; tests and
seconds still add up.

Runs made one after another on one machine compare only as far as the machine's speed held
still; the table says so. Writes the tables (.md) and the per-module sums (.json, same name).
"""

from __future__ import annotations

import argparse
import json
import re
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_MODULE_MARK = re.compile(r"^pytestmark\s*=\s*(?:\[[^\]]*)?pytest\.mark\.engine\b", re.M)
_FUNCTION_MARK = re.compile(r"@pytest\.mark\.engine\b(?:\s*\n\s*@[^\n]*)*\s*\n\s*def (\w+)")


def engine_tests(root: Path = ROOT) -> tuple[set[str], set[tuple[str, str]]]:
    """(modules marked as a whole, (module, function) pairs marked one by one), modules dotted as
    JUnit's classname writes them (tests.engine.test_x)."""
    modules: set[str] = set()
    functions: set[tuple[str, str]] = set()
    for path in (root / "tests").rglob("test_*.py"):
        dotted = ".".join(path.relative_to(root).with_suffix("").parts)
        text = path.read_text()
        if _MODULE_MARK.search(text):
            modules.add(dotted)
        functions.update((dotted, name) for name in _FUNCTION_MARK.findall(text))
    return modules, functions


def module_of(classname: str) -> str:
    """`tests.engine.test_x.TestClass` -> `tests.engine.test_x`."""
    parts = classname.split(".")
    while len(parts) > 1 and parts[-1][:1].isupper():
        parts.pop()
    return ".".join(parts)


def summarize(report: Path, marked: tuple[set[str], set[tuple[str, str]]]) -> dict[str, Any]:
    """One run's wall time, test counts and per-tier and per-module seconds."""
    root = ET.parse(report).getroot()
    suite = root.find("testsuite") if root.tag == "testsuites" else root
    assert suite is not None, f"{report}: no <testsuite>"
    modules: Counter[str] = Counter()
    tiers: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for case in suite.iter("testcase"):
        module = module_of(case.get("classname", ""))
        function = re.sub(r"[\[@].*$", "", case.get("name", ""))
        seconds = float(case.get("time", 0.0))
        tier = "engine" if module in marked[0] or (module, function) in marked[1] else "fast"
        modules[module] += seconds
        tiers[tier] += seconds
        counts[tier] += 1
    return {"report": report.name, "wall_s": float(suite.get("time", 0.0)), "tests": sum(counts.values()),
            "failures": int(suite.get("failures", 0)) + int(suite.get("errors", 0)),
            "tiers": dict(tiers), "tier_tests": dict(counts), "modules": dict(modules)}


def summarize_parts(groups: list[list[Path]], marked: tuple[set[str], set[tuple[str, str]]]) -> dict[str, Any]:
    """One run made of the given parts, one after the other, each part the reports of pytest runs
    made at the same time (usually one): wall times of parts added up (a part's: its longest
    report's), everything else added up."""
    summaries = [[summarize(r, marked) for r in group] for group in groups]
    parts = [{"report": ",".join(s["report"] for s in group), "wall_s": max(s["wall_s"] for s in group)}
             for group in summaries]
    flat = [s for group in summaries for s in group]
    run = {"report": "+".join(p["report"] for p in parts), "wall_s": sum(p["wall_s"] for p in parts),
           "tests": sum(p["tests"] for p in flat), "failures": sum(p["failures"] for p in flat)}
    for key in ("tiers", "tier_tests", "modules"):
        total: Counter[str] = Counter()
        for p in flat:
            total.update(p[key])
        run[key] = dict(total)
    if len(parts) > 1:
        run["parts_wall_s"] = [p["wall_s"] for p in parts]
    return run


def render(runs: list[tuple[str, dict[str, Any]]], about: dict[str, str] | None = None, top: int = 20) -> str:
    labels = [label for label, _ in runs]
    head = "| measure | " + " | ".join(labels) + " |"
    rule = "|---|" + "---|" * len(labels)
    command = " ".join(f"{label}=" + "+".join(",".join(f"bench/results/suite_time/{r}" for r in part.split(","))
                                              for part in run["report"].split("+"))
                       for label, run in runs)
    lines = [
        "# Where the test suite's time goes",
        "",
        f"Command: `python -m bench.suite_time {command}` (and `--about` for each run). "
        "Seconds from pytest's JUnit reports; the engine tier is the "
        "tests with the `engine` marker. The runs were made one after another on one machine: they compare only as far "
        "as its speed held still between them.",
        "",
        *[f"- {label}: {about[label]}" for label in labels if about and label in about],
        "",
        head, rule,
        "| wall time (s) | " + " | ".join(f"{r['wall_s']:.0f}" for _, r in runs) + " |",
        "| tests (failed) | " + " | ".join(f"{r['tests']} ({r['failures']})" for _, r in runs) + " |",
    ]
    for tier in ("engine", "fast"):
        lines.append(f"| {tier} tier: tests, summed time (s) | "
                     + " | ".join(f"{r['tier_tests'].get(tier, 0)}, {r['tiers'].get(tier, 0.0):.0f}" for _, r in runs) + " |")
    first = runs[0][1]["modules"]
    lines += ["", f"The {top} modules that took longest in {labels[0]} (summed seconds of their tests, setup and "
              "teardown included):", "", "| module | " + " | ".join(labels) + " |", rule]
    for module, _ in Counter(first).most_common(top):
        lines.append(f"| `{module}` | " + " | ".join(f"{r['modules'].get(module, 0.0):.0f}" for _, r in runs) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.suite_time", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="LABEL=RUN.xml",
                        help="a label and a pytest JUnit XML report (or reports joined with +: runs one after the "
                             "other; with a comma: runs at the same time)")
    parser.add_argument("--about", action="append", default=[], metavar="LABEL=TEXT", help="what a run was")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "suite_time.md"))
    args = parser.parse_args(argv)
    marked = engine_tests(ROOT)
    runs = []
    for item in args.runs:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            parser.error(f"{item!r}: expected LABEL=RUN.xml")
        runs.append((label, summarize_parts([[Path(r) for r in part.split(",")] for part in path.split("+")], marked)))
    about = {}
    for item in args.about:
        label, sep, text = item.partition("=")
        if not sep or label not in dict(runs):
            parser.error(f"--about {item!r}: expected LABEL=TEXT for one of the runs' labels")
        about[label] = text
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = render(runs, about)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({label: run for label, run in runs}, indent=1, sort_keys=True) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
