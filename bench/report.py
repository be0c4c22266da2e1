"""Markdown result files for the benchmarks: a title, the exact command, the body."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def command_line(module: str, argv: list[str] | None) -> str:
    args = argv if argv is not None else sys.argv[1:]
    return " ".join(["python -m", module, *args])


def write_markdown(out: str | Path, title: str, module: str, argv: list[str] | None, body: list[str]) -> str:
    """Write `# title`, the command that produced it, and `body`; print and return the text."""
    text = "\n".join([f"# {title}", "", f"Command: `{command_line(module, argv)}`  ", *body, ""])
    print(text)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text


def write_results(out: str | Path, raw: dict[str, Any], text: str) -> None:
    """Write `raw` as JSON next to `out` (same name, .json) and `text` to `out`; print the text."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n")
    path.write_text(text)
    print(text)
