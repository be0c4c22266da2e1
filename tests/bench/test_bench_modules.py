"""The agentic benchmark's modules import each other one way (issue 16, item 6).

`bench.runs` holds what the replay and the report share, so `bench.agentic_report`
never imports `bench.agentic_engine` (nor the reverse through it). Imports are read
with `ast`, function-level ones included: a lazy import inside a function is still
an edge of the graph. `bench.agentic_engine` stays the entry point and re-exports the
names its importers used before the split.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
AGENTIC = ("runs", "agentic_engine", "agentic_report")  # plus every bench/agentic_*.py


def bench_imports(path: Path) -> set[str]:
    """Names of the `bench` modules `path` imports anywhere in its body (top level or in a function)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 1:  # from . import x / from .x import y
            names = [f"bench.{node.module}"] if node.module else [f"bench.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "bench" and len(parts) > 1 and (BENCH / f"{parts[1]}.py").exists():
                out.add(parts[1])
    out.discard(path.stem)
    return out


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Every module of bench/ -> the bench modules it imports (parsed once per test session:
    callers only read it)."""
    return {p.stem: bench_imports(p) for p in sorted(BENCH.glob("*.py")) if p.stem != "__init__"}


def cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A path start -> ... -> start in `graph`, or None."""
    stack: list[tuple[str, list[str]]] = [(start, [start])]
    seen: set[str] = set()
    while stack:
        node, path = stack.pop()
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def agentic_modules() -> list[str]:
    return sorted({*AGENTIC, *(p.stem for p in BENCH.glob("agentic_*.py"))})


def test_the_cycle_finder_finds_a_cycle_and_only_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert cycle_through(graph, "a") == ["a", "b", "c", "a"]
    assert cycle_through(graph, "d") is None
    assert cycle_through({"a": {"b"}, "b": set()}, "a") is None


def test_function_level_imports_are_edges(tmp_path: Path) -> None:
    mod = tmp_path / "m.py"
    mod.write_text("import os\nfrom bench.runs import RUNS\n\ndef f():\n    from bench.agentic_engine import main\n"
                   "    import bench.trace\n")
    assert bench_imports(mod) == {"runs", "agentic_engine", "trace"}


@pytest.mark.parametrize("module", agentic_modules())
def test_no_agentic_module_is_on_an_import_cycle(module: str) -> None:
    assert (BENCH / f"{module}.py").exists()
    assert cycle_through(import_graph(), module) is None


def test_report_and_replay_share_runs_not_each_other() -> None:
    graph = import_graph()
    assert "agentic_engine" not in graph["agentic_report"]
    assert "agentic_report" in graph["agentic_engine"]  # the CLI writes the report
    assert "runs" in graph["agentic_report"] and "runs" in graph["agentic_replay"]
    assert graph["runs"] <= {"trace", "policy"}  # the shared leaf imports no agentic module


def test_the_entry_module_re_exports_the_moved_names() -> None:
    import bench.agentic_driver
    import bench.agentic_engine as engine
    import bench.agentic_plan
    import bench.agentic_replay
    import bench.runs

    assert engine.HintDriver is bench.agentic_driver.HintDriver
    assert engine.build_plan is bench.agentic_plan.build_plan
    assert engine.replay is bench.agentic_replay.replay
    assert engine.RUNS is bench.runs.RUNS and engine.linear_fit is bench.runs.linear_fit
    assert all(hasattr(engine, name) for name in engine.__all__)


def test_bench_scale_runs_as_a_file_path_from_any_folder(tmp_path: Path) -> None:
    """Issue 12 runs `bench/scale.py` from a fresh checkout: as a path, not only as `-m bench.scale`."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(BENCH / "scale.py"), "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--quick" in out.stdout and "--report-only" in out.stdout
