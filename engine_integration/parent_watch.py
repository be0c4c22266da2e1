"""The end of the process that started this EngineCore.

vLLM's API server (or the offline LLM's process) starts EngineCore as a multiprocessing child and
stops it with SIGTERM when it exits cleanly. When the API server dies without that (kill -9, the
OOM killer), vLLM 0.32's EngineCore does not notice: it waits on its input queue for good, holding
the device memory, and KvHint's sidecar in it went on answering health SERVING and applying hints
for an engine no request can reach, its gRPC port still bound, so a supervisor's restart on the
same ports failed after the model load.

`ParentWatch` is a daemon thread that notices the parent's end: the multiprocessing parent's
sentinel (a pipe the parent holds open until it exits) turns readable, or this process's parent
pid changes (re-parented to init or a subreaper; it also covers a sentinel that another child
holds open). Where the parent started this process directly, the parent pid confirms the
sentinel: a sentinel readable while the parent is still the parent is not its end, and from then
on the pid alone decides, compared every `POLL_S`. It then calls `on_exit(parent_pid)` once. It watches only where this process is a
multiprocessing child (`multiprocessing.parent_process()`): in the offline engine without
multiprocessing, the scheduler runs in the user's own process and nothing is watched.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

log = logging.getLogger("kvhint.vllm")

POLL_S = 1.0  # how often the parent pid is compared when the sentinel stays quiet


class ParentWatch:
    """Calls `on_exit(parent_pid)` once, from its own daemon thread, when `parent` (a
    multiprocessing parent process, as `multiprocessing.parent_process()` gives it) has exited.
    `stop()` ends the watch without calling it."""

    def __init__(self, parent: Any, on_exit: Callable[[int], None], poll_s: float = POLL_S) -> None:
        self.parent_pid: int = parent.pid
        self._sentinel: int | None = parent.sentinel
        self._on_exit = on_exit
        self._poll_s = poll_s
        # Compared only when the parent was this process's parent at the start (a process started
        # through an intermediate one keeps the sentinel alone).
        self._ppid = os.getppid() if os.getppid() == parent.pid else None
        self._stopped = threading.Event()
        self.fired = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvhint-parent-watch", daemon=True)
        self._thread.start()

    def _gone(self) -> bool:
        if self._sentinel is not None:
            if not wait([self._sentinel], timeout=self._poll_s):
                return self._ppid is not None and os.getppid() != self._ppid
            if self._ppid is None or os.getppid() != self._ppid:
                return True
            # Readable while the parent is still this process's parent: the parent closed its end
            # itself (multiprocessing's Popen finalized), or it is exiting and the kernel has not
            # re-parented this process yet. The parent pid decides from now on.
            self._sentinel = None
            return False
        self._stopped.wait(self._poll_s)
        return os.getppid() != self._ppid

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                gone = self._gone()
            except OSError:  # the sentinel closed under us: this process is ending
                return
            if gone and not self._stopped.is_set():
                self.fired.set()
                try:
                    self._on_exit(self.parent_pid)
                except Exception:  # noqa: BLE001 - a daemon thread: log, never raise
                    log.exception("kvhint: handling the end of the parent process failed")
                return

    def stop(self) -> None:
        self._stopped.set()


def watch_parent(on_exit: Callable[[int], None], poll_s: float = POLL_S) -> ParentWatch | None:
    """A `ParentWatch` on this process's multiprocessing parent; None in a process that is not a
    multiprocessing child."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return None
    return ParentWatch(parent, on_exit, poll_s)
