"""vLLM's host-tier shared memory files, and which of them a stopped engine left behind.

vLLM's CPU offloading keeps its host tier in `/dev/shm/vllm_offload_<engine id>.mmap`, mapped by
the engine's processes while it runs and removed at a clean shutdown. A file left behind is one
that no live process maps: its engine is gone. Engines something else runs meanwhile (another
pytest process, a benchmark) map theirs, so they are not counted as left behind, and a test names
the files its own engines map (`mapped_regions(their process groups)`) to check those are gone.
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Callable

from bench.agentic_monitor import group_pids

_PREFIX = "/dev/shm/vllm_offload_"


def mapped_regions(pgids: set[int] | None = None, prefix: str = _PREFIX) -> set[str]:
    """The offload files live processes map now (/proc/<pid>/maps): every process's, or those of
    the processes in the groups `pgids` (a served engine's group is its API server's pid)."""
    if pgids is None:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    else:
        pids = [pid for pgid in pgids for pid in group_pids(pgid)]
    mapped: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    at = line.find(prefix)
                    if at >= 0:
                        mapped.add(line[at:].rstrip("\n").removesuffix(" (deleted)"))
        except OSError:  # exited meanwhile, or not ours to read
            continue
    return mapped


def left_behind(settle_s: float = 2.0, prefix: str = _PREFIX, sleep: Callable[[float], None] = time.sleep) -> set[str]:
    """The offload files that exist and that no live process maps, now and again after
    `settle_s` (an engine between creating its file and mapping it, or between unmapping and
    removing it, is not counted)."""
    unmapped = set(glob.glob(prefix + "*")) - mapped_regions(prefix=prefix)
    if not unmapped:
        return set()
    sleep(settle_s)
    return {p for p in unmapped if os.path.exists(p)} - mapped_regions(prefix=prefix)
