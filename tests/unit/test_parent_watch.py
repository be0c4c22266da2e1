"""ParentWatch (engine_integration/parent_watch.py): an EngineCore whose front-end died by kill -9
notices it. Real processes: the test starts a parent, the parent a multiprocessing child that
watches it, and the test kills the parent."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import types

from engine_integration.parent_watch import ParentWatch, watch_parent

CTX = multiprocessing.get_context("fork")


def _child(report: object) -> None:
    """The watched child: reports its pid, then whether and whom the watch saw exit."""
    fired: list[int] = []
    watch = watch_parent(fired.append, poll_s=0.05)
    report.put(("started", os.getpid(), watch is not None and watch.parent_pid))  # type: ignore[attr-defined]
    deadline = time.monotonic() + 20
    while not fired and time.monotonic() < deadline:
        time.sleep(0.02)
    report.put(("fired", fired))  # type: ignore[attr-defined]


def _parent(report: object) -> None:
    child = CTX.Process(target=_child, args=(report,))
    child.start()
    time.sleep(60)  # killed by the test long before


def test_a_child_sees_its_parent_killed_and_is_told_once() -> None:
    report = CTX.Queue()
    parent = CTX.Process(target=_parent, args=(report,))
    parent.start()
    try:
        kind, child_pid, watched = report.get(timeout=20)
        assert kind == "started" and watched == parent.pid  # the child watches the process that started it
        os.kill(parent.pid, signal.SIGKILL)  # the API server's kill -9
        started = time.monotonic()
        kind, fired = report.get(timeout=20)
        assert kind == "fired" and fired == [parent.pid], fired
        assert time.monotonic() - started < 5
    finally:
        parent.kill()
        parent.join(5)


def test_a_process_that_is_no_multiprocessing_child_watches_nothing() -> None:
    assert watch_parent(lambda pid: None) is None  # pytest's own process, or an xdist worker


def _pipe_parent() -> tuple[types.SimpleNamespace, int]:
    r, w = os.pipe()
    return types.SimpleNamespace(pid=os.getppid(), sentinel=r), w


def test_a_sentinel_closed_while_the_parent_is_still_the_parent_is_not_its_end() -> None:
    """multiprocessing's Popen closes its end of the pipe when the parent finalizes it: the
    parent pid says the parent is alive, so the engine is not stopped."""
    parent, w = _pipe_parent()
    fired: list[int] = []
    watch = ParentWatch(parent, fired.append, poll_s=0.02)
    try:
        os.close(w)  # the sentinel turns readable (EOF)
        time.sleep(0.3)
        assert fired == [] and not watch.fired.is_set()
    finally:
        watch.stop()
        os.close(parent.sentinel)


def test_a_stopped_watch_does_not_call_back() -> None:
    parent, w = _pipe_parent()
    parent.pid = -1  # not this process's parent: the sentinel alone decides
    fired: list[int] = []
    watch = ParentWatch(parent, fired.append, poll_s=0.02)
    watch.stop()
    os.close(w)
    time.sleep(0.2)
    assert fired == []
    os.close(parent.sentinel)


def test_without_the_parent_pid_the_sentinel_decides() -> None:
    """A process started through an intermediate one: its sentinel's EOF is the parent's end."""
    parent, w = _pipe_parent()
    parent.pid = -1
    fired: list[int] = []
    watch = ParentWatch(parent, fired.append, poll_s=0.02)
    try:
        os.close(w)
        assert watch.fired.wait(2) and fired == [-1]
    finally:
        watch.stop()
        os.close(parent.sentinel)
