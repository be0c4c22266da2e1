"""CI runs the README's test command, and that command runs both tiers."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_test_command() -> str:
    """The command after `bash scripts/install.sh &&` on the README's "whole test suite" line."""
    (line,) = [l for l in (ROOT / "README.md").read_text().splitlines() if "the whole test suite" in l and "install.sh" in l]
    m = re.match(r"bash scripts/install\.sh && (.+?)\s+#", line)
    assert m, line
    return m.group(1)


def test_ci_runs_the_readmes_test_command() -> None:
    command = readme_test_command()
    ci = [l.strip() for l in (ROOT / ".ci" / "run").read_text().splitlines() if l.strip() and not l.lstrip().startswith("#")]
    assert command in ci, f"{command!r} is not a line of .ci/run"


def test_the_test_script_runs_the_fast_tier_then_the_engine_tier() -> None:
    pytest_lines = [l.strip() for l in (ROOT / "scripts" / "test.sh").read_text().splitlines() if l.strip().startswith("python3 -m pytest")]
    assert pytest_lines == ['python3 -m pytest -q -m "not engine"', "python3 -m pytest -q -m engine"]


def test_the_test_script_takes_no_arguments() -> None:
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "test.sh"), "tests/unit"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "no arguments" in proc.stderr
