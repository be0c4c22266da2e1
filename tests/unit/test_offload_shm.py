"""tests/engine/offload_shm.py: which of vLLM's host-tier shared memory files a stopped engine left
behind, and which files a given engine's processes map (the tier tests' clean-shutdown checks)."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap
import uuid

from offload_shm import left_behind, mapped_regions


def child(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def test_a_mapped_file_is_not_left_behind_and_an_unmapped_one_is() -> None:
    prefix = f"/dev/shm/kvhint_test_{uuid.uuid4().hex}_"
    path = prefix + "a.mmap"
    with open(path, "wb") as f:
        f.truncate(mmap.PAGESIZE)
    holder = subprocess.Popen(
        child(f"""
            import mmap, sys, time
            f = open({path!r}, "r+b")
            m = mmap.mmap(f.fileno(), 0)
            f.close()
            print("mapped", flush=True)
            time.sleep(60)
        """),
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "mapped"
        # Another process's engine (another pytest run, a benchmark) maps its file: not left behind.
        assert left_behind(settle_s=0, prefix=prefix) == set()
        assert mapped_regions({holder.pid}, prefix=prefix) == {path}
        assert mapped_regions({os.getpid()}, prefix=prefix) == set()
        holder.kill()
        holder.wait(timeout=10)
        # Its process gone and the file still there: left behind, as a leak would be.
        slept = []
        assert left_behind(settle_s=0.5, prefix=prefix, sleep=slept.append) == {path}
        assert slept == [0.5]
    finally:
        if holder.poll() is None:
            holder.kill()
        os.unlink(path)
    assert left_behind(settle_s=0, prefix=prefix) == set()
