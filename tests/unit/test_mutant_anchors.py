"""tools/mutants.py's mutants still apply to the code they name.

Each mutant's anchor must match its file exactly once; the tool refuses a
verdict otherwise (exit 2), so an anchor that rots when code moves would leave
the mutation check unrunnable until someone ran it. This keeps it runnable."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _mutants_module():
    spec = importlib.util.spec_from_file_location("kvhint_mutants_tool", REPO / "tools" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


TOOL = _mutants_module()


@pytest.mark.parametrize("mutant", TOOL.MUTANTS, ids=lambda m: m.name)
def test_every_mutant_anchor_matches_its_file_once_and_changes_it(mutant) -> None:
    text = (REPO / mutant.path).read_text()
    mutated = TOOL.mutate(text, mutant)  # raises when the anchor matches 0 or 2+ times
    assert mutated != text, f"{mutant.name}: the replacement leaves {mutant.path} unchanged"


def test_mutant_names_are_unique() -> None:
    names = [m.name for m in TOOL.MUTANTS]
    assert len(names) == len(set(names))
