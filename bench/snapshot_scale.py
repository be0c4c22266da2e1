"""Snapshots and membership at scale: N sessions sharing one system prompt.

Engine-neutral: the real KvHintCore (index, event bus, snapshot cursor, wire
conversion) over a minimal in-process adapter (a dict for the device tier),
driven on this thread the way an engine drives it: `core.run_pending()` once
per step. For N = 1k, 10k and 50k sessions, each of which hit a 4-block
shared prefix and stored 2 blocks of its own (6 member blocks per session,
2N + 4 device blocks), it measures

  * join: engine-thread time per session to record the prefix hit and its own
    blocks (`core.on_stored`, events included), median (the mean, in raw.json,
    also carries the cyclic GC, whose full collections grow with the heap):
    flat in N means membership of the shared blocks costs O(1) per session;
  * memory: bytes allocated by the core for the N sessions (tracemalloc, a
    separate pass), in total and per session;
  * snapshot stall: a START_SNAPSHOT subscription's snapshot taken the way
    watch.py takes it (`SnapshotCursor` slices through `core.submit_slice`),
    one new session storing a block between steps (so events interleave);
    the max and median engine-thread time of the steps that carried a slice,
    the number of steps, and the total;
  * one-shot: the same snapshot in a single engine task (no slicing), i.e.
    what the stall would be without slicing;
  * serialization: turning every piece into SnapshotChunk bytes (the gRPC
    loop's work, off the engine thread);
  * ListSessions: one page of 100 on the engine thread.

  python -m bench.snapshot_scale                # ~1-2 min
  python -m bench.snapshot_scale --sessions 1000 --out /tmp/s.md   # quick

Raw numbers go to bench/results/snapshot_scale/raw.json, the table to
bench/results/snapshot_scale/results.md (regenerate the table alone with
--report-only). Target (issue 14): at 10k sessions at most ~10 ms of engine
time per step during a snapshot.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import tracemalloc
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_server import KvHintCore, ServerConfig, wire
from kvhint_server.adapter import DeviceOnlyTiers, EvictReport
from kvhint_server.core import SLICE_BUDGET_S
from kvhint_server.model import BlockState, EngineInfo, RequestCoords, Tier, TierInfo
from kvhint_server.snapshot import SnapshotCursor

from bench.report import write_markdown

OUT = Path("bench/results/snapshot_scale")
SHARED = 4  # blocks of the common system prompt
OWN = 2  # blocks each session stores after it
BLOCK_SIZE = 16
_DEVICE_BIT = Tier.DEVICE.bit


def _hash(*parts: object) -> bytes:
    return ("/".join(map(str, parts))).encode().ljust(32, b".")[:32]


class DictEngine(DeviceOnlyTiers):
    """The smallest EngineAdapter: a device tier in a dict, engine thread = caller."""

    def __init__(self, num_blocks: int) -> None:
        self.device: dict[bytes, bool] = {}
        self._info = EngineInfo(
            engine="bench", engine_version="0", block_size=BLOCK_SIZE, num_device_blocks=num_blocks,
            block_hash_encoding="sha256", tiers=(TierInfo(Tier.DEVICE, "GPU", num_blocks),), actions=(),
        )

    def info(self) -> EngineInfo:
        return self._info

    def request_wakeup(self) -> None:
        pass

    def lookup(self, hashes: Sequence[bytes]) -> dict[bytes, BlockState]:
        device, bit = self.device, _DEVICE_BIT
        return {h: BlockState(h, bit, in_use=device[h]) for h in hashes if h in device}

    def device_blocks(self) -> Iterable[BlockState]:
        return [BlockState(h, Tier.DEVICE.bit, in_use=u) for h, u in self.device.items()]

    def device_groups(self, hashes: Sequence[bytes]) -> dict[bytes, int]:
        return {h: 1 for h in hashes if h in self.device}  # one KV-cache group

    def refile(self, hashes: Iterable[bytes]) -> None:
        pass

    def demote_first(self, hashes: Iterable[bytes]) -> int:
        return 0

    def evict(self, hashes: Sequence[bytes]) -> EvictReport:
        return EvictReport((), tuple(hashes))


def _store(core: KvHintCore, engine: DictEngine, hashes: list[bytes], session: str, first: int, parent: bytes | None, hit: bool) -> None:
    for h in hashes:
        engine.device[h] = False
    core.on_stored(hashes, first_position=first, parent=parent, tier=Tier.DEVICE, medium="GPU",
                   coords=RequestCoords(session_id=session), prefix_hit=hit)


def _session(core: KvHintCore, engine: DictEngine, i: int, shared: list[bytes]) -> None:
    """Session i: a prefix hit on the shared prompt, then its own blocks."""
    name = f"agent-{i:06d}"
    _store(core, engine, shared, name, 0, None, hit=True)
    _store(core, engine, [_hash("own", i, k) for k in range(OWN)], name, SHARED, shared[-1], hit=False)


def _populated(n: int) -> tuple[KvHintCore, DictEngine, list[bytes], list[float]]:
    core = KvHintCore(ServerConfig(event_replay_window=100_000))
    engine = DictEngine(2 * n + SHARED + 1024)
    core.attach(engine)
    shared = [_hash("system", k) for k in range(SHARED)]
    _store(core, engine, shared, "agent-first", 0, None, hit=False)
    joins = []
    for i in range(n):
        t0 = time.perf_counter()
        _session(core, engine, i, shared)
        joins.append(time.perf_counter() - t0)
    return core, engine, shared, joins


def _memory(n: int) -> int:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    core, _engine, _shared, _ = _populated(n)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del core
    return after - before


def _serialize(epoch: str, sequence: int, chunks: list[tuple[str, list]]) -> int:
    size = 0
    for session_id, views in chunks:
        msg = pb.WatchEventsResponse(epoch=epoch, sequence=sequence, snapshot_chunk=pb.SnapshotChunk(
            session_id=session_id, blocks=[wire.block_info(v, BLOCK_SIZE) for v in views]))
        size += len(msg.SerializeToString())
    return size


def measure(n: int) -> dict[str, object]:
    core, engine, shared, joins = _populated(n)
    queries = core.queries
    gc.collect()  # the population's garbage is not the snapshot's cost
    # Sliced snapshot, as watch.py takes it; one new session stores a block between steps.
    cursor = SnapshotCursor(queries)
    begin = core.submit(cursor.begin)
    t0, c0 = time.perf_counter(), time.thread_time()
    core.run_pending()
    begin_s, begin_cpu = time.perf_counter() - t0, time.thread_time() - c0
    start = begin.result(0)
    steps: list[float] = []
    cpu: list[float] = []
    serialize_s = 0.0
    wire_bytes = 0
    extra = 0
    pieces = 0
    while not cursor.done:
        future = core.submit_slice(cursor.step)
        t0, c0 = time.perf_counter(), time.thread_time()
        core.run_pending()
        steps.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        piece = future.result(0)
        pieces += 1
        t0 = time.perf_counter()
        wire_bytes += _serialize(core.bus.epoch, piece.sequence, piece.chunks)
        serialize_s += time.perf_counter() - t0
        _store(core, engine, [_hash("late", extra)], f"late-{extra}", 0, None, hit=False)
        extra += 1
    # The same snapshot in one engine task (what slicing avoids).
    whole = SnapshotCursor(queries)
    whole.begin()
    t0, c0 = time.perf_counter(), time.thread_time()
    whole.step(float("inf"))
    one_shot_s, one_shot_cpu = time.perf_counter() - t0, time.thread_time() - c0
    assert whole.done
    c0 = time.thread_time()
    page = queries.sessions("", None, 100)
    list_cpu = time.thread_time() - c0
    assert len(page.sessions) == 100
    node = core.index.node(shared[0])
    assert node is not None and len(node.sessions) == n + 1 + 0  # every session joined the shared prefix
    result = {
        "sessions": n,
        "device_blocks": len(engine.device),
        "join_us_mean": statistics.fmean(joins) * 1e6,
        "join_us_p50": statistics.median(joins) * 1e6,
        "join_us_first_1000": statistics.fmean(joins[:1000]) * 1e6,
        "join_us_last_1000": statistics.fmean(joins[-1000:]) * 1e6,
        "snapshot_begin_ms": begin_s * 1e3,
        "snapshot_steps": len(steps),
        "snapshot_pieces": pieces,
        "snapshot_step_max_ms": max(steps) * 1e3,
        "snapshot_step_p50_ms": statistics.median(steps) * 1e3,
        "snapshot_step_cpu_max_ms": max(cpu) * 1e3,
        "snapshot_step_cpu_p99_ms": sorted(cpu)[min(len(cpu) - 1, int(len(cpu) * 0.99))] * 1e3,
        "snapshot_step_cpu_p50_ms": statistics.median(cpu) * 1e3,
        "snapshot_begin_cpu_ms": begin_cpu * 1e3,
        "snapshot_engine_total_ms": (begin_s + sum(steps)) * 1e3,
        "snapshot_engine_cpu_total_ms": (begin_cpu + sum(cpu)) * 1e3,
        "events_during_snapshot": extra,
        "snapshot_num_blocks": start.num_blocks,
        "snapshot_num_sessions": start.num_sessions,
        "one_shot_snapshot_ms": one_shot_s * 1e3,
        "one_shot_snapshot_cpu_ms": one_shot_cpu * 1e3,
        "serialize_ms": serialize_s * 1e3,
        "snapshot_wire_mb": wire_bytes / 1e6,
        "list_sessions_page100_cpu_ms": list_cpu * 1e3,
        "slice_budget_ms": SLICE_BUDGET_S * 1e3,
    }
    del core, engine, queries
    gc.collect()
    result["memory_mb"] = _memory(n) / 1e6
    result["memory_bytes_per_session"] = result["memory_mb"] * 1e6 / n  # type: ignore[operator]
    return result


COLUMNS = [
    ("sessions", "sessions", "{:,}"),
    ("device_blocks", "device blocks", "{:,}"),
    ("join_us_p50", "join per session, p50 (us)", "{:.1f}"),
    ("snapshot_step_cpu_max_ms", "snapshot: engine CPU ms/step, max", "{:.2f}"),
    ("snapshot_step_cpu_p99_ms", "p99", "{:.2f}"),
    ("snapshot_step_cpu_p50_ms", "p50", "{:.2f}"),
    ("snapshot_step_max_ms", "wall ms/step, max", "{:.2f}"),
    ("snapshot_begin_cpu_ms", "begin CPU (ms)", "{:.2f}"),
    ("snapshot_steps", "steps", "{:,}"),
    ("snapshot_engine_cpu_total_ms", "engine CPU total (ms)", "{:.0f}"),
    ("one_shot_snapshot_cpu_ms", "unsliced: one step, CPU (ms)", "{:.0f}"),
    ("serialize_ms", "serialize, off-thread (ms)", "{:.0f}"),
    ("snapshot_wire_mb", "wire (MB)", "{:.1f}"),
    ("list_sessions_page100_cpu_ms", "ListSessions page of 100, CPU (ms)", "{:.2f}"),
    ("memory_mb", "core memory (MB)", "{:.1f}"),
    ("memory_bytes_per_session", "bytes/session", "{:,.0f}"),
]


def report(raw: dict[str, object], out: Path, argv: list[str] | None) -> str:
    rows = raw["results"]  # type: ignore[index]
    body = [
        "",
        f"Each session hit a {SHARED}-block shared prefix and stored {OWN} blocks of its own. The snapshot is taken",
        f"in slices ({raw['slice_budget_ms']} ms of engine time per step for all slices), one new session storing a",
        "block between steps; `unsliced` is the same snapshot in one engine task. Serialization runs on the gRPC loop,",
        "not the engine thread. Engine CPU per step is the engine thread's CPU time (`time.thread_time`) in the steps",
        "that carried a slice; wall time also counts the time other processes held the CPU (this machine has 2 cores",
        "shared with other jobs). Raw data: `raw.json` (same folder).",
        "",
        "| " + " | ".join(title for _, title, _ in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for row in rows:  # type: ignore[union-attr]
        body.append("| " + " | ".join(fmt.format(row[key]) for key, _, fmt in COLUMNS) + " |")
    return write_markdown(out, "Snapshots and membership at scale", "bench.snapshot_scale", argv, body)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, nargs="+", default=[1_000, 10_000, 50_000])
    p.add_argument("--out", default=str(OUT / "results.md"))
    p.add_argument("--report-only", action="store_true", help="regenerate the table from raw.json")
    args = p.parse_args(argv)
    out = Path(args.out)
    raw_path = out.parent / "raw.json"
    if args.report_only:
        raw = json.loads(raw_path.read_text())
    else:
        results = []
        for n in args.sessions:
            t0 = time.perf_counter()
            results.append(measure(n))
            print(f"{n} sessions: {time.perf_counter() - t0:.1f}s", flush=True)
        raw = {"slice_budget_ms": SLICE_BUDGET_S * 1e3, "results": results}
        raw_path.parent.mkdir(parents=True, exist_ok=True)
        raw_path.write_text(json.dumps(raw, indent=1) + "\n")
    report(raw, out, argv)


if __name__ == "__main__":
    main()
