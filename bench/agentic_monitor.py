"""What one agentic-benchmark run observes besides the client (`bench.agentic_engine`):
the KvHint WatchEvents stream (`Monitor`), vLLM's /metrics (`scrape_metrics`,
`scrape_tier_counters`) and CPU use of the machine, engine and client (`CpuMeter`).
"""

from __future__ import annotations

import math
import os
import re
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from bench.agentic_served import EngineHandle


_USAGE_RE = re.compile(r"^vllm:kv_cache_usage_perc\{[^}]*\}\s+(\S+)", re.M)
_PREEMPT_RE = re.compile(r"^vllm:num_preemptions_total\{[^}]*\}\s+(\S+)", re.M)


_TIER_BYTES_RE = re.compile(
    r"^vllm:kv_offload_(?:store_bytes|load_bytes|tiering_read_bytes|tiering_write_bytes)_total(?:\{[^}]*\})?\s+(\S+)", re.M)
_CACHED_BY_SOURCE_RE = re.compile(r'^vllm:prompt_tokens_cached_by_source_total\{[^}]*source="([^"]+)"[^}]*\}\s+(\S+)', re.M)


def scrape_tier_counters(http_url: str) -> dict[str, float]:
    """Cumulative bytes moved between tiers and prompt tokens served per cache source."""
    with urllib.request.urlopen(http_url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {"tier_bytes": sum(float(v) for v in _TIER_BYTES_RE.findall(text))}
    for src, v in _CACHED_BY_SOURCE_RE.findall(text):
        out[f"cached:{src}"] = out.get(f"cached:{src}", 0.0) + float(v)
    return out


def scrape_metrics(http_url: str) -> tuple[float, float]:
    with urllib.request.urlopen(http_url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    usage = _USAGE_RE.search(text)
    pre = _PREEMPT_RE.search(text)
    return (float(usage.group(1)) if usage else math.nan, float(pre.group(1)) if pre else math.nan)


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far (/proc/stat)."""
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return (math.nan, math.nan)
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    total = sum(vals[:8])
    return ((total - idle) / _CLK_TCK, total / _CLK_TCK)


def group_pids(pgid: int) -> list[int]:
    """Processes of a process group (the served engine: API server, EngineCore, workers)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                out.append(int(d))
        except (OSError, IndexError, ValueError):
            continue
    return out


def pids_cpu(pids: Sequence[int]) -> float:
    """utime + stime seconds of `pids` (exited ones count 0)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
    return total / _CLK_TCK


class CpuMeter:
    """CPU used by the machine, the engine's process group and this process over an interval:
    'other' = machine - engine - bench client, i.e. background load that competes with the engine."""

    def __init__(self, engine_pgid: int | None) -> None:
        self.pids = group_pids(engine_pgid) if engine_pgid else []
        self.start = self._read()

    def _read(self) -> tuple[float, float, float, float]:
        busy, _ = machine_cpu()
        t = os.times()
        return (time.perf_counter(), busy, pids_cpu(self.pids), t.user + t.system)

    def since(self, start: tuple[float, float, float, float] | None = None) -> dict[str, float]:
        a, b = start or self.start, self._read()
        wall = b[0] - a[0]
        if wall <= 0:
            return {}
        machine, engine, client = (b[1] - a[1]) / wall, (b[2] - a[2]) / wall, (b[3] - a[3]) / wall
        return {"machine_cores": round(machine, 2), "engine_cores": round(engine, 2) if self.pids else math.nan,
                "client_cores": round(client, 2),
                "other_cores": round(machine - engine - client, 2) if self.pids else math.nan,
                "ncpu": os.cpu_count() or 0}


class Monitor:
    """WatchEvents + /metrics sampling for one run."""

    def __init__(self, engine: EngineHandle, usable_blocks: int, sample_s: float = 0.1) -> None:
        from kvhint.v1 import kvhint_pb2 as pb
        from kvhint_client import KvHintClient

        self.pb = pb
        self.engine = engine
        self.usable = usable_blocks
        self.sample_s = sample_s
        self.client = KvHintClient(engine.grpc_address)
        self.lock = threading.Lock()
        self.resident: set[bytes] = set()
        self.peak_resident = 0
        self.pins_broken_events = 0
        self.pins_broken_blocks = 0
        self.pin_broken_removals = 0
        self.bytes_moved = 0
        self.operations_completed: dict[str, int] = {}  # final state name -> OperationCompleted events
        self.cleared = 0
        self.resyncs = 0
        self.first_store: dict[str, float] = {}  # continuation -> engine wall time of first stored/hit event
        self.removed_listeners: list[Callable[[Iterable[bytes]], None]] = []
        self.usage_samples: list[tuple[float, float]] = []
        self.cpu_samples: list[tuple[float, dict[str, float]]] = []
        self.cpu: CpuMeter | None = None
        self.cpu_total: dict[str, float] = {}
        self.preempt_start = math.nan
        self.preempt_end = math.nan
        self.tier_start: dict[str, float] = {}
        self.tier_end: dict[str, float] = {}
        self._stop = threading.Event()
        self._stream: Any = None
        self._threads: list[threading.Thread] = []
        self._ready = threading.Event()

    def start(self) -> None:
        served = self.engine.served
        self.cpu = CpuMeter(served.proc.pid if served is not None and served.proc is not None else None)
        self._stream = self.client.watch(heartbeat=1.0)
        t = threading.Thread(target=self._watch, name="bench-watch", daemon=True)
        t.start()
        self._threads.append(t)
        try:
            self.preempt_start = scrape_metrics(self.engine.http_url)[1]
            self.tier_start = scrape_tier_counters(self.engine.http_url)
        except OSError:
            pass
        s = threading.Thread(target=self._sample, name="bench-metrics", daemon=True)
        s.start()
        self._threads.append(s)
        self._ready.wait(10)

    def _watch(self) -> None:
        pb = self.pb
        try:
            for msg in self._stream:
                kind = msg.WhichOneof("payload")
                if kind == "heartbeat":
                    self._ready.set()
                    continue
                self._ready.set()
                ts = msg.time.seconds + msg.time.nanos * 1e-9
                with self.lock:
                    if kind == "blocks_stored":
                        ev = msg.blocks_stored
                        if ev.tier in (pb.TIER_DEVICE, pb.TIER_UNSPECIFIED):
                            if not ev.prefix_hit:
                                self.resident.update(ev.block_hashes)
                                self.peak_resident = max(self.peak_resident, len(self.resident))
                            cid = ev.coordinates.continuation_id
                            if cid and cid not in self.first_store:
                                self.first_store[cid] = ts
                    elif kind == "blocks_removed":
                        ev = msg.blocks_removed
                        if ev.tier in (pb.TIER_DEVICE, pb.TIER_UNSPECIFIED):
                            self.resident.difference_update(ev.block_hashes)
                            if ev.cause == pb.REMOVAL_CAUSE_PIN_BROKEN:
                                self.pin_broken_removals += len(ev.block_hashes)
                            for cb in self.removed_listeners:
                                cb(ev.block_hashes)
                    elif kind == "pin_broken":
                        self.pins_broken_events += 1
                        self.pins_broken_blocks += len(msg.pin_broken.block_hashes)
                    elif kind == "tier_transfer_completed":
                        self.bytes_moved += msg.tier_transfer_completed.bytes_moved
                    elif kind == "operation_completed":
                        state = pb.Operation.State.Name(msg.operation_completed.operation.state)
                        self.operations_completed[state] = self.operations_completed.get(state, 0) + 1
                    elif kind == "all_blocks_cleared":
                        if msg.all_blocks_cleared.tier in (pb.TIER_DEVICE, pb.TIER_UNSPECIFIED):
                            self.resident.clear()
                        self.cleared += 1
                    elif kind == "resync":
                        self.resyncs += 1
        except Exception as err:  # noqa: BLE001 - a cancelled/ended stream ends the monitor
            if not self._stop.is_set():
                print(f"  [monitor] event stream ended: {err}", file=sys.stderr, flush=True)

    def _sample(self) -> None:
        t0 = time.perf_counter()
        cpu_every = max(1, int(round(0.5 / self.sample_s)))
        k = 0
        last = self.cpu._read() if self.cpu is not None else None
        while not self._stop.wait(self.sample_s):
            k += 1
            if self.cpu is not None and k % cpu_every == 0:
                self.cpu_samples.append((time.perf_counter() - t0, self.cpu.since(last)))
                last = self.cpu._read()
            try:
                usage, pre = scrape_metrics(self.engine.http_url)
            except OSError:
                continue
            self.usage_samples.append((time.perf_counter() - t0, usage))
            self.preempt_end = pre

    def stop(self) -> None:
        self._stop.set()
        if self.cpu is not None:
            self.cpu_total = self.cpu.since()
        if self._stream is not None:
            self._stream.cancel()
        for t in self._threads:
            t.join(timeout=5)
        try:
            self.preempt_end = scrape_metrics(self.engine.http_url)[1]
            time.sleep(0.5)  # connector and cache stats reach /metrics with the next engine stats update
            self.tier_end = scrape_tier_counters(self.engine.http_url)
        except OSError:
            pass
        self.client.close()

    def tier_delta(self) -> dict[str, int]:
        """Bytes moved between tiers and prompt tokens served from a lower tier during the run."""
        d = {k: self.tier_end.get(k, 0.0) - self.tier_start.get(k, 0.0) for k in self.tier_end}
        lower = sum(v for k, v in d.items() if k.startswith("cached:") and k not in ("cached:device", "cached:local"))
        return {"tier_bytes": int(d.get("tier_bytes", 0.0)), "tier_cached_tokens": int(lower),
                "by_source": {k.split(":", 1)[1]: int(v) for k, v in d.items() if k.startswith("cached:") and v}}

    @property
    def peak_in_use_blocks(self) -> int:
        vals = [u for _, u in self.usage_samples if not math.isnan(u)]
        return int(round(max(vals) * self.usable)) if vals else 0

    @property
    def preemptions(self) -> int:
        if math.isnan(self.preempt_start) or math.isnan(self.preempt_end):
            return 0
        return int(self.preempt_end - self.preempt_start)

