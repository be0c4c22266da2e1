"""The engine tier (`-m engine`) imports only the test files whose source says `mark.engine`, and
an engine test anywhere else is a usage error in every run (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def suite_conftest(request: pytest.FixtureRequest) -> ModuleType:
    for plugin in request.config.pluginmanager.get_plugins():
        if isinstance(plugin, ModuleType) and Path(getattr(plugin, "__file__", "")) == ROOT / "tests" / "conftest.py":
            return plugin
    raise AssertionError("tests/conftest.py is not loaded as a plugin")


def config(markexpr: str) -> Any:
    return SimpleNamespace(option=SimpleNamespace(markexpr=markexpr))


def test_the_engine_tier_skips_test_files_that_never_say_mark_engine(suite_conftest: ModuleType, tmp_path: Path) -> None:
    marked, plain, helper = tmp_path / "test_marked.py", tmp_path / "test_plain.py", tmp_path / "support.py"
    marked.write_text("import pytest\npytestmark = pytest.mark.engine\n")
    plain.write_text("def test_x():\n    pass\n")
    helper.write_text("")
    ignore = suite_conftest.pytest_ignore_collect
    assert ignore(marked, config("engine")) is None
    assert ignore(plain, config("  engine ")) is True
    assert ignore(helper, config("engine")) is None  # not a test file: pytest decides
    for markexpr in ("not engine", "", "engine and not slow"):  # any other selection collects everything
        assert ignore(plain, config(markexpr)) is None


def test_an_engine_test_in_a_file_that_does_not_say_so_is_a_usage_error(suite_conftest: ModuleType, tmp_path: Path) -> None:
    hidden = tmp_path / "test_hidden.py"
    hidden.write_text("import pytest\nengine = getattr(pytest.mark, 'eng' + 'ine')\n")  # the marker, by another spelling
    said = tmp_path / "test_said.py"
    said.write_text("pytestmark = pytest.mark.engine\n")

    def item(path: Path, engine: bool) -> Any:
        return SimpleNamespace(path=path, get_closest_marker=lambda name: object() if engine and name == "engine" else None)

    hook = suite_conftest.pytest_collection_modifyitems
    hook(config("not engine"), [item(said, True), item(hidden, False)])  # fine: no hidden engine test
    with pytest.raises(pytest.UsageError, match="test_hidden.py"):
        hook(config("not engine"), [item(said, True), item(hidden, True)])


def test_every_engine_test_file_in_the_tree_says_so(suite_conftest: ModuleType) -> None:
    """The tree's own engine modules (the fast tier's collection runs the hook above on all of them;
    this names them, so that the skip rule is seen to keep them)."""
    files = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py") if suite_conftest.says_engine(str(p)))
    assert "tests/engine/test_engine_retention.py" in files and "tests/bench/test_agentic_smoke.py" in files
    assert "tests/unit/test_engine_pool.py" not in files
