"""Markdown result files for the benchmarks: a title, the exact command, the body."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any


def machine() -> str:
    """The machine line of a results file: architecture, CPUs, Python."""
    return f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def git(*args: str, cwd: Path | None = None) -> str:
    """`git ARGS` in `cwd` (default: the current directory); its stdout, stripped."""
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def git_head() -> tuple[str, bool]:
    """The checked-out commit, and whether tracked files differ from it."""
    return git("rev-parse", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))


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


def write_results(out: str | Path | None, raw: dict[str, Any], text: str) -> None:
    """Write `raw` as JSON next to `out` (same name, .json) and `text` to `out`; print the text.
    With no `out`, print it only."""
    if out is None:
        print(text)
        return
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n")
    path.write_text(text)
    print(text)
