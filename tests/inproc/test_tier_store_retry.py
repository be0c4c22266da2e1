"""A Demote's injected store when the host tier has no evictable chunk (engine_integration.tiers.
operations, `_store_missing`), against vLLM's real CPUOffloadingManager (no engine, no model).

Every host chunk can be pinned at once by work in flight: a request's stores until they land
(ref_cnt -1), loads and file writes while they copy. That is not a full tier; the room comes back.
A Demote that meets it waits (the operation stays DEFERRED) and stores once the room is back.
Only a tier that stays pinned with no work in flight for HOST_FULL_GRACE_S fails the operation,
RESOURCE_EXHAUSTED. (CI saw the first case as a spurious rejection: a Demote sent right after
the requests whose blocks it selected, while their own host stores were still landing.)

Prefetch's promotions follow the same rule (a promotion answers MISS when the host tier has no
evictable chunk); those tests replace control.Prefetch with one promotion round whose outcome
the test sets, since a real promotion needs the connector's worker.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest

from engine_integration.tiers import operations
from engine_integration.tiers.control import HostState, StoreOp, TierControl
from engine_integration.tiers.operations import Failure, TierOp, TierOperations
from kvhint_server.model import Action, Reason, Tier
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager


def key(i: int) -> Any:
    return make_offload_key(i.to_bytes(32, "big"), 0)


class HostOnlyControl:
    """The slice of TierControl that `_store_missing` uses, over a real CPUOffloadingManager.
    `force_store` asks the manager for room exactly as TierControl.force_store does and lands
    the store at once (the copy itself is not under test)."""

    host_work_in_flight = TierControl.host_work_in_flight
    host_used = TierControl.host_used
    host_capacity = TierControl.host_capacity
    file_tiers: list[Any] = []

    def host_lacks(self, d: int, **sources: bool) -> list[int]:
        return []  # one group: a block on the host has every copy

    def __init__(self, chunks: int) -> None:
        self.manager = self.primary = CPUOffloadingManager(num_chunks=chunks, cache_policy="lru")
        self._ops: dict[int, Any] = {}
        self.calls = 0
        self._ids = itertools.count()

    def force_store(self, hashes: list[int], keep: list[int] = ()) -> StoreOp:  # type: ignore[assignment]
        self.calls += 1
        op = StoreOp(op_id=f"store-{next(self._ids)}", hashes=[], skipped_ready=[], not_in_g1=[])
        kept = [key(h) for h in keep if self.manager.lookup(key(h), None).name == "HIT"]  # type: ignore[arg-type]
        ctx = ReqContext(req_id=op.op_id)
        self.manager.on_new_request(ctx)
        out = self.manager.prepare_store([key(h) for h in hashes] + kept, ctx)
        if out is None:
            self.manager.on_request_finished(ctx)
            op.failed, op.done = "host tier has no evictable chunk", True
            return op
        self.manager.complete_store(out.keys_to_store, ctx)
        self.manager.on_request_finished(ctx)
        op.hashes, op.done = list(hashes), True
        op._keys = [k for k in out.keys_to_store if k in {key(h) for h in hashes}]
        return op

    # A request of the connector's own, with its store in flight or its chunks being read.
    def begin_store(self, *ids: int) -> tuple[ReqContext, list[Any]]:
        ctx = ReqContext(req_id=f"req-{next(self._ids)}")
        self.manager.on_new_request(ctx)
        out = self.manager.prepare_store([key(i) for i in ids], ctx)
        assert out is not None
        return ctx, list(out.keys_to_store)

    def land(self, ctx: ReqContext, keys: list[Any]) -> None:
        self.manager.complete_store(keys, ctx)
        self.manager.on_request_finished(ctx)

    def begin_load(self, *ids: int) -> ReqContext:
        """A request's load of landed chunks: it pins them until `end_load`, with nothing in
        flight that `host_work_in_flight` can see."""
        ctx = ReqContext(req_id=f"reader-{next(self._ids)}")
        self.manager.on_new_request(ctx)
        self.manager.prepare_load([key(i) for i in ids], ctx)
        return ctx

    def end_load(self, ctx: ReqContext, *ids: int) -> None:
        self.manager.complete_load([key(i) for i in ids], ctx)
        self.manager.on_request_finished(ctx)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(operations.time, "monotonic", c)
    return c


def ops_over(ctl: HostOnlyControl) -> TierOperations:
    core = SimpleNamespace(config=SimpleNamespace(auth_token=""))
    return TierOperations(core, ctl, book=None, feed=None, settings=None,  # type: ignore[arg-type]
                          bytes_per_block=1, demote_first=lambda exts: [], wake=lambda: None)


def demote_op() -> TierOp:
    return TierOp("op-1", Action.DEMOTE, Tier.HOST, (b"x",), [b"d"], deadline=1e9)


def test_a_store_waits_while_the_host_tier_is_pinned_by_stores_in_flight(clock: Clock) -> None:
    ctl = HostOnlyControl(chunks=2)
    ops, op = ops_over(ctl), demote_op()
    pending = ctl.begin_store(1, 2)  # every chunk: a store not landed yet
    assert ctl.host_work_in_flight()
    for _ in range(5):  # many steps, and far past the grace: the work in flight is still visible
        assert ops._store_missing(op, [3], []) is None
        clock.now += operations.HOST_FULL_GRACE_S
    assert ctl.calls == 5 and op.store is None and op.stored_copies == 0
    ctl.land(*pending)
    assert not ctl.host_work_in_flight()
    assert ops._store_missing(op, [3], []) is None
    assert op.store is not None and op.store.hashes == [3] and op.stored_copies == 1
    assert op.full_since is None


def test_a_tier_pinned_with_no_work_in_flight_fails_after_the_grace(clock: Clock) -> None:
    ctl = HostOnlyControl(chunks=2)
    ops, op = ops_over(ctl), demote_op()
    ctl.land(*ctl.begin_store(1, 2))
    ctl.begin_load(1, 2)  # a load pins both, invisibly to the op
    assert not ctl.host_work_in_flight()
    assert ops._store_missing(op, [3], []) is None  # the grace starts
    clock.now += operations.HOST_FULL_GRACE_S * 0.9
    assert ops._store_missing(op, [3], []) is None
    clock.now += operations.HOST_FULL_GRACE_S * 0.2
    failure = ops._store_missing(op, [3], [])
    assert isinstance(failure, Failure) and failure.reason is Reason.RESOURCE_EXHAUSTED
    assert "host tier is full" in failure.message and "2 of 2 chunks in use" in failure.message


def test_a_load_that_finishes_inside_the_grace_lets_the_store_through(clock: Clock) -> None:
    ctl = HostOnlyControl(chunks=2)
    ops, op = ops_over(ctl), demote_op()
    ctl.land(*ctl.begin_store(1, 2))
    reader = ctl.begin_load(1, 2)
    assert ops._store_missing(op, [3], []) is None
    clock.now += operations.HOST_FULL_GRACE_S / 2
    ctl.end_load(reader, 1, 2)
    assert ops._store_missing(op, [3], []) is None
    assert op.store is not None and op.store.hashes == [3]
    assert ctl.manager.lookup(key(3), reader).name == "HIT"


def test_a_demote_of_the_whole_tier_waits_for_room_instead_of_evicting_its_own_copies(clock: Clock) -> None:
    """A Demote that selects as many blocks as the host tier holds, two already copied there,
    while a request's store of another block is still landing (CI saw this one as a flaky
    FAILED "host tier keeps evicting the copies"). The only evictable chunks are the
    operation's own copies; the store waits for the request's chunk instead of evicting them."""
    ctl = HostOnlyControl(chunks=4)
    ops = ops_over(ctl)
    op = TierOp("op-1", Action.DEMOTE, Tier.HOST, (b"a", b"b", b"c", b"d"), [1, 2, 3, 4], deadline=1e9)  # type: ignore[list-item]
    ctl.land(*ctl.begin_store(1, 2))
    other = ctl.begin_store(5)  # not the operation's: lands a few steps later
    reader = ReqContext(req_id="probe")

    def missing() -> list[int]:
        return [d for d in (1, 2, 3, 4) if ctl.manager.lookup(key(d), reader).name == "MISS"]

    for step in range(8):
        if step == 4:
            ctl.land(*other)
        todo = missing()
        if not todo:
            break
        assert ops._store_missing(op, todo, [d for d in (1, 2, 3, 4) if d not in todo]) is None, f"step {step}"
        assert ctl.manager.lookup(key(1), reader).name == "HIT" and ctl.manager.lookup(key(2), reader).name == "HIT"
    assert missing() == []
    assert ctl.manager.lookup(key(5), reader).name == "MISS"  # the request's copy made the room
    assert op.stored_copies == 2 and op.store_tries == 1


# ---------------------------------------------------------------- Prefetch's promotions


class PromotingControl:
    """What Prefetch's progress reads of TierControl: blocks on file only, a host tier that
    takes the digests in `room` when a promotion round runs, and visible work in flight."""

    file_tiers = [object()]

    def __init__(self) -> None:
        self.host: set[bytes] = set()
        self.room: set[bytes] = set()
        self.in_flight = False
        self.manager = self.primary = SimpleNamespace()
        self.rounds = 0
        self.touched: list[tuple[int, list[bytes]]] = []  # (promotion rounds run before, digests)

    def g1_has(self, d: bytes) -> bool:
        return False

    def host_state(self, d: bytes) -> HostState:
        return HostState.READY if d in self.host else HostState.ABSENT

    def file_has(self, d: bytes) -> bool:
        return True

    def touch_host(self, digests: list[bytes]) -> None:
        # As TierControl.touch_host: only the copies the host tier holds are touched.
        self.touched.append((self.rounds, [d for d in digests if d in self.host]))

    def host_lacks(self, d: bytes, **sources: bool) -> list[int]:
        return []  # one group: a block on the host has every copy

    def host_work_in_flight(self) -> bool:
        return self.in_flight

    def host_used(self) -> int:
        return 2

    def host_capacity(self) -> int:
        return 2


class OneRoundPrefetch:
    """control.Prefetch's interface: one promotion round, finished at once; a digest is a hit
    when the host tier has room for it (a MISS otherwise, as vLLM answers with no evictable chunk)."""

    def __init__(self, ctl: PromotingControl, digests: list[bytes]) -> None:
        ctl.rounds += 1
        self.hits = [d for d in digests if d in ctl.room]
        self.promoted_blocks = [d for d in self.hits if d not in ctl.host]
        self.promoted_copies = len(self.promoted_blocks)  # one group
        ctl.host.update(self.hits)
        self.closed = True

    def poll(self) -> bool:
        return True


class Operations:
    """OperationRegistry's side: what each operation completed with."""

    def __init__(self) -> None:
        self.done: dict[str, dict[str, Any]] = {}

    def complete(self, op_id: str, **kw: Any) -> None:
        self.done[op_id] = kw


def prefetching(monkeypatch: pytest.MonkeyPatch, digests: list[bytes],
                host: tuple[bytes, ...] = ()) -> tuple[TierOperations, PromotingControl, Operations, TierOp]:
    monkeypatch.setattr(operations, "Prefetch", OneRoundPrefetch)
    ctl, registry = PromotingControl(), Operations()
    ctl.host.update(host)
    core = SimpleNamespace(config=SimpleNamespace(auth_token=""), operations=registry, on_transfer=lambda *a: None)
    feed = SimpleNamespace(file_has=lambda ext, d: True)
    ops = TierOperations(core, ctl, book=None, feed=feed, settings=None,  # type: ignore[arg-type]
                         bytes_per_block=1, demote_first=lambda exts: [], wake=lambda: None)
    op = TierOp("pf-1", Action.PREFETCH, Tier.HOST, tuple(b"e" + d for d in digests), list(digests), deadline=1e9)
    ops._ops[op.op_id] = op
    assert ops._progress(op, starting=True) is None  # the first round
    return ops, ctl, registry, op


def test_a_prefetch_waits_for_host_room_while_tier_work_is_in_flight(clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    ops, ctl, registry, op = prefetching(monkeypatch, [b"a"])
    ctl.in_flight = True
    for _ in range(5):
        clock.now += operations.HOST_FULL_GRACE_S
        ops.on_step()
    assert not registry.done and ctl.rounds == 6  # a new round each step, none given up
    ctl.in_flight, ctl.room = False, {b"a"}
    ops.on_step()  # the work landed: this round promotes
    ops.on_step()
    assert registry.done["pf-1"]["ok"] and registry.done["pf-1"]["blocks"] == {Tier.HOST: 1}


def test_a_prefetch_with_no_room_and_nothing_in_flight_fails_after_the_grace(clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    ops, ctl, registry, op = prefetching(monkeypatch, [b"a"])
    ops.on_step()
    clock.now += operations.HOST_FULL_GRACE_S * 0.9
    ops.on_step()
    assert not registry.done
    clock.now += operations.HOST_FULL_GRACE_S * 0.2
    ops.on_step()
    done = registry.done["pf-1"]
    assert not done["ok"] and done["reason"] is Reason.RESOURCE_EXHAUSTED
    assert "1 of 1 blocks could not be staged: the host tier is full" in done["message"]


def test_a_round_that_promotes_something_starts_a_new_wait(clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    ops, ctl, registry, op = prefetching(monkeypatch, [b"a", b"b"])
    ops.on_step()  # the first round missed both: the wait starts
    clock.now += operations.HOST_FULL_GRACE_S * 0.9
    ctl.room = {b"a"}
    ops.on_step()  # the second round promotes a; b starts a wait of its own
    ctl.room = set()
    clock.now += operations.HOST_FULL_GRACE_S * 0.6  # 1.5 graces after the first miss
    ops.on_step()
    assert not registry.done and ctl.rounds == 4
    ctl.room = {b"b"}
    ops.on_step()
    ops.on_step()
    assert registry.done["pf-1"]["ok"] and registry.done["pf-1"]["blocks"] == {Tier.HOST: 2}


def test_a_prefetch_puts_the_selections_host_copies_first_before_it_promotes_the_rest(clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """The promotions make room by evicting the least-recent host chunks: the selected blocks
    already on the host tier are touched before the first round, so they are not that room."""
    ops, ctl, registry, op = prefetching(monkeypatch, [b"a", b"b", b"c"], host=(b"b",))
    assert ctl.touched[0] == (0, [b"b"])  # before any promotion round
    assert ctl.rounds == 1
    ctl.room = {b"a", b"c"}
    ops.on_step()
    ops.on_step()
    assert registry.done["pf-1"]["ok"] and registry.done["pf-1"]["blocks"] == {Tier.HOST: 3}


class _WithFileTier(HostOnlyControl):
    """The same control on an engine that also has a file tier (the store's cascade to it is
    vLLM's own, after the host copy landed)."""

    host_state = TierControl.host_state
    file_tiers = [object()]
    group_ids = required_group_ids = (0,)

    def __init__(self, chunks: int, in_g1: set[int]) -> None:
        super().__init__(chunks)
        self._probe = SimpleNamespace(req_id="probe")
        self.in_g1 = in_g1

    def key(self, d: int, g: int = 0) -> Any:
        return key(d)

    def g1_has(self, d: int) -> bool:
        return d in self.in_g1

    def touch_host(self, digests: Any) -> None:
        pass


def test_a_host_tier_demote_reports_the_bytes_it_moved_also_when_a_file_tier_is_configured() -> None:
    """Three 1000-byte blocks copied device -> host are 3000 bytes, in the DEVICE -> HOST transfer
    and the operation's bytes_moved, whether or not vLLM then cascades them to a file tier (it
    counted the cascade too: 6000)."""
    sent: list[Any] = []
    core = SimpleNamespace(
        config=SimpleNamespace(auth_token=""),
        on_transfer=lambda exts, src, dst, nbytes, op_id: sent.append((src, dst, nbytes)),
        operations=SimpleNamespace(running=lambda *a: None,
                                   complete=lambda op_id, **kw: sent.append(("complete", kw["blocks"], kw["bytes_moved"]))),
    )
    ctl = _WithFileTier(chunks=8, in_g1={1, 2, 3})
    ops = TierOperations(core, ctl, book=SimpleNamespace(mark_demoted=lambda exts: None), feed=None,  # type: ignore[arg-type]
                         settings=None, bytes_per_block=1000, demote_first=lambda exts: [], wake=lambda: None)
    op = TierOp("op-1", Action.DEMOTE, Tier.HOST, (b"a", b"b", b"c"), [1, 2, 3], deadline=1e9)  # type: ignore[list-item]
    ops._ops[op.op_id] = op
    ops._progress(op, starting=True)  # the store lands at once in this control
    ops.on_step()
    assert sent == [(Tier.DEVICE, Tier.HOST, 3000), ("complete", {Tier.HOST: 3}, 3000)]
