"""A served engine's vLLM processes and how its API server started them (fork or spawn).

A forked process keeps its parent's memory layout, so the C library sits at the same address in
both (/proc/PID/maps); a spawned one is a new exec, whose libraries the kernel's address-space
randomization places anew. `aslr_on()` says whether that tells the two apart on this machine.
"""

from __future__ import annotations

from pathlib import Path

from bench.agentic_monitor import group_pids


def aslr_on() -> bool:
    return Path("/proc/sys/kernel/randomize_va_space").read_text().strip() != "0"


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def vllm_children(api: int) -> dict[int, str]:
    """The served process's children that vLLM named (pid -> its 15-character name, e.g.
    "VLLM::EngineCor"): EngineCore per data-parallel rank and, with data parallelism, the DP
    coordinator and the API servers."""
    out = {}
    for pid in group_pids(api):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            if _parent(pid) == api and name.startswith("VLLM::"):
                out[pid] = name
        except OSError:  # exited meanwhile
            continue
    return out


def _libc_at(pid: int) -> str:
    """Where the C library's first mapping starts in process `pid`."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if "/libc.so" in line or "/libc-" in line:
            return line.split("-", 1)[0]
    raise AssertionError(f"no libc mapping in /proc/{pid}/maps")


def forked_from(child: int, parent: int) -> bool:
    """`child` was forked from `parent` (not spawned: exec'd). Meaningful only with aslr_on()."""
    return _libc_at(child) == _libc_at(parent)
