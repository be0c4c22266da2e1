"""Shared helpers for tests/unit: a fake engine adapter and a real KvHintServer.

The fake engine implements the EngineAdapter protocol (kvhint_server/adapter.py)
with a dict for the device tier and a set for the host tier. It owns an
"engine thread" that loops `core.run_pending()`; every scripted residency
change (stores, removals, clears) is submitted to that thread, so all core
mutations happen on one thread, as in the real engine. Adapter methods that
the protocol says run on the engine thread record a violation otherwise.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from kvhint.v1 import kvhint_pb2 as pb
from kvhint.v1 import kvhint_pb2_grpc
from kvhint_server import KvHintCore, KvHintServer, ServerConfig
from kvhint_server.adapter import EvictReport, TierRefusal, TierTask
from kvhint_server.model import (
    Action,
    ActionSupport,
    BlockState,
    EngineInfo,
    RemovalCause,
    RequestCoords,
    SelectorKind,
    Tier,
    TierInfo,
)

T = TypeVar("T")
ALL_SELECTORS = (SelectorKind.SESSION, SelectorKind.CONTINUATION, SelectorKind.BLOCK_HASHES)
LOCAL = (Action.RETAIN, Action.PIN, Action.RELEASE, Action.EVICT)
REMOTE = (Action.DEMOTE, Action.PREFETCH, Action.SHARE)


def local_engine_info(num_device_blocks: int = 11, block_size: int = 16) -> EngineInfo:
    """Retain/Pin/Release/Evict on every selector (with ranges); no Demote/Prefetch/Share."""
    return EngineInfo(
        engine="fake",
        engine_version="0",
        block_size=block_size,
        num_device_blocks=num_device_blocks,
        block_hash_encoding="sha256",
        tiers=(TierInfo(Tier.DEVICE, "GPU", num_device_blocks),),
        actions=tuple(ActionSupport(a, True, ALL_SELECTORS, supports_range=True) for a in LOCAL)
        + tuple(ActionSupport(a, False, notes="no lower tier") for a in REMOTE),
    )


def tiered_engine_info(num_device_blocks: int = 11, block_size: int = 16) -> EngineInfo:
    """Every action supported; a host tier and a shared disk tier; one Share peer."""
    return EngineInfo(
        engine="fake",
        engine_version="0",
        block_size=block_size,
        num_device_blocks=num_device_blocks,
        block_hash_encoding="sha256",
        tiers=(TierInfo(Tier.DEVICE, "GPU", num_device_blocks), TierInfo(Tier.HOST, "CPU", 64), TierInfo(Tier.DISK, "STORAGE", 0, True)),
        actions=tuple(ActionSupport(a, True, ALL_SELECTORS, supports_range=True) for a in LOCAL + REMOTE),
        share_destinations=("peer-b",),
    )


def h(i: int) -> bytes:
    """A 32-byte block hash."""
    return i.to_bytes(4, "big") * 8


class FakeEngine:
    """EngineAdapter with an engine thread."""

    def __init__(self, core: KvHintCore, info: EngineInfo) -> None:
        self.core = core
        self._info = info
        self.device: dict[bytes, bool] = {}  # hash -> in use
        self.host: set[bytes] = set()
        # Device blocks whose copies only some KV-cache groups hold (group bitmask; device_groups).
        self.groups_held: dict[bytes, int] = {}
        self.refiled: list[bytes] = []
        self.demoted_first: list[bytes] = []
        self.tier_tasks: list[TierTask] = []
        self.refuse_tier_tasks: TierRefusal | None = None
        self.violations: list[str] = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)

    # ---- engine thread
    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self.thread.join(5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.002)
            self._wake.clear()
            self.core.run_pending()

    def _engine_only(self, what: str) -> None:
        if threading.current_thread() is not self.thread:
            self.violations.append(f"{what} called on {threading.current_thread().name}")

    def run(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        """Run `fn` on the engine thread and wait for it."""
        return self.core.submit(fn).result(timeout=timeout)

    # ---- EngineAdapter
    def info(self) -> EngineInfo:
        return self._info

    def request_wakeup(self) -> None:
        self._wake.set()

    def lookup(self, hashes: Sequence[bytes]) -> dict[bytes, BlockState]:
        self._engine_only("lookup")
        out = {}
        for x in hashes:
            mask = (Tier.DEVICE.bit if x in self.device else 0) | (Tier.HOST.bit if x in self.host else 0)
            if mask:
                out[x] = BlockState(x, mask, in_use=self.device.get(x, False))
        return out

    def device_groups(self, hashes: Sequence[bytes]) -> dict[bytes, int]:
        """Every group of `info` for a device block, unless `groups_held` says otherwise."""
        self._engine_only("device_groups")
        every = sum(1 << g.group_id for g in self._info.kv_cache_groups) or 1
        return {x: self.groups_held.get(x, every) for x in hashes if x in self.device and self.groups_held.get(x, every)}

    def device_blocks(self) -> Iterable[BlockState]:
        self._engine_only("device_blocks")
        return [BlockState(x, Tier.DEVICE.bit, in_use=u) for x, u in self.device.items()]

    def refile(self, hashes: Iterable[bytes]) -> None:
        self._engine_only("refile")
        self.refiled.extend(hashes)

    def demote_first(self, hashes: Iterable[bytes]) -> list[bytes]:
        self._engine_only("demote_first")
        moved = [x for x in hashes if x in self.device and not self.device[x]]
        self.demoted_first.extend(moved)
        return moved

    def evict(self, hashes: Sequence[bytes]) -> EvictReport:
        self._engine_only("evict")
        evicted, in_use = [], []
        for x in hashes:
            if x not in self.device:
                continue
            if self.device[x]:
                in_use.append(x)
                continue
            del self.device[x]
            evicted.append(x)
        if evicted:
            self.core.on_removed(
                evicted, tier=Tier.DEVICE, medium="GPU", cause=RemovalCause.EVICT_HINT, remaining_tiers=self._remaining
            )
        return EvictReport(tuple(evicted), tuple(in_use))

    def start_tier_task(self, task: TierTask) -> TierRefusal | None:
        self._engine_only("start_tier_task")
        if self.refuse_tier_tasks is not None:
            return self.refuse_tier_tasks
        self.tier_tasks.append(task)
        return None

    def _remaining(self, x: bytes) -> int:
        return (Tier.DEVICE.bit if x in self.device else 0) | (Tier.HOST.bit if x in self.host else 0)

    # ---- scripted engine activity (any thread; applied on the engine thread)
    def store(
        self,
        hashes: Sequence[bytes],
        *,
        session: str | None = None,
        continuation: str | None = None,
        parent_session: str | None = None,
        first_position: int = 0,
        parent: bytes | None = None,
        in_use: bool = False,
        prefix_hit: bool = False,
        tier: Tier = Tier.DEVICE,
    ) -> None:
        coords = RequestCoords(session, continuation, parent_session)

        def do() -> None:
            for x in hashes:
                if tier is Tier.DEVICE:
                    self.device[x] = in_use
                else:
                    self.host.add(x)
            self.core.on_stored(
                list(hashes),
                first_position=first_position,
                parent=parent,
                tier=tier,
                medium="GPU" if tier is Tier.DEVICE else "CPU",
                coords=coords if (session or continuation or tier is Tier.DEVICE) else None,
                prefix_hit=prefix_hit,
            )

        self.run(do)

    def remove(self, hashes: Sequence[bytes], tier: Tier = Tier.DEVICE, cause: RemovalCause = RemovalCause.EVICTED) -> None:
        def do() -> None:
            for x in hashes:
                if tier is Tier.DEVICE:
                    self.device.pop(x, None)
                else:
                    self.host.discard(x)
            self.core.on_removed(
                list(hashes), tier=tier, medium="GPU" if tier is Tier.DEVICE else "CPU", cause=cause,
                remaining_tiers=self._remaining,
            )

        self.run(do)

    def set_in_use(self, hashes: Sequence[bytes], in_use: bool = True) -> None:
        def do() -> None:
            for x in hashes:
                self.device[x] = in_use

        self.run(do)


class Harness:
    """A real KvHintServer on 127.0.0.1 (port 0) over a FakeEngine."""

    def __init__(
        self, info: EngineInfo | None = None, monotonic: Callable[[], float] = time.monotonic, **overrides: Any
    ) -> None:
        self.config = ServerConfig(address="127.0.0.1:0", **overrides)
        self.core = KvHintCore(self.config, monotonic=monotonic)
        self.engine = FakeEngine(self.core, info or local_engine_info())
        self.core.attach(self.engine)
        self.engine.start()
        self.server = KvHintServer(self.core, self.config)
        self.port = self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = kvhint_pb2_grpc.KvHintServiceStub(self.channel)

    @property
    def bus(self):
        return self.core.bus

    def close(self) -> None:
        self.channel.close()
        self.server.stop(grace=0.2)
        self.engine.stop()

    def raw(self, method: str) -> grpc.UnaryUnaryMultiCallable:
        return self.channel.unary_unary(f"/kvhint.v1.KvHintService/{method}")

    def apply(self, *hints: pb.Hint, timeout: float = 10.0) -> pb.ApplyHintsResponse:
        return self.stub.ApplyHints(pb.ApplyHintsRequest(hints=list(hints)), timeout=timeout)

    def wait_subscribers(self, n: int, timeout: float = 5.0) -> None:
        hub = self.server.servicer.hub
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if hub is not None and hub.subscribers >= n:
                return
            time.sleep(0.005)
        raise AssertionError(f"expected {n} WatchEvents subscribers, have {hub.subscribers if hub else 0}")


def gate_engine_steps(harness: "Harness") -> threading.Event:
    """The fake engine's step boundaries wait on the returned event (set: steps run). Clear it to
    hold the engine in a long "forward pass" with tasks queued; set it to let them run."""
    running = threading.Event()
    running.set()
    real = harness.core.run_pending

    def run_pending() -> None:
        running.wait()
        real()

    harness.core.run_pending = run_pending  # type: ignore[method-assign]
    return running


class FakeClock:
    """A monotonic clock that only moves when told to."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def error_info(err: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    if status is None:
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info
    return None


# ---- hint builders


def session_sel(session_id: str, include_children: bool = False, **range_: int) -> pb.Selector:
    sel = pb.Selector(session=pb.SessionSelector(session_id=session_id, include_children=include_children))
    if range_:
        sel.range.CopyFrom(pb.BlockRange(**range_))
    return sel


def retain(session_id: str, ttl_s: float, priority: int = 0, hint_id: str = "", **kw: Any) -> pb.Hint:
    from google.protobuf import duration_pb2

    d = duration_pb2.Duration()
    d.FromNanoseconds(int(ttl_s * 1e9))
    return pb.Hint(hint_id=hint_id, selector=session_sel(session_id), retain=pb.RetainAction(priority=priority, ttl=d), **kw)


def pin(session_id: str, ttl_s: float, hint_id: str = "", **kw: Any) -> pb.Hint:
    from google.protobuf import duration_pb2

    d = duration_pb2.Duration()
    d.FromNanoseconds(int(ttl_s * 1e9))
    return pb.Hint(hint_id=hint_id, selector=session_sel(session_id), pin=pb.PinAction(ttl=d), **kw)
