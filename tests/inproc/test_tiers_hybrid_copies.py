"""KV tiers on a hybrid model act on every group's copies (the proto's KvCacheGroup): a block is
on a tier while its full-attention copy is there, but a resume from that tier also reads the
window tail at its prefix end. So Demote copies the window tails the host tier lacks, and
Prefetch stages the ones a file holds; bytes_moved counts every copy. vLLM's real
OffloadingConnector and CPUOffloadingManager, in-process (tier_support)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pool_support import session, tokens
from tier_support import BLOCK, apply, copies, device_copies, drive, host_copies, host_hit, operation, run, tiered
from vllm.v1.kv_offload.base import LookupResult, ReqContext

from engine_integration.tiers import operations
from kvhint.v1 import kvhint_pb2 as pb
from kvhint_server.model import Reason, Tier

ORDERS = pytest.mark.parametrize("window_first", [False, True], ids=["full-first", "window-first"])
A = tokens(1, 10 * BLOCK)
RESUME = A + tokens(99, 20)
PRESSURE = tokens(7, 49)  # a prompt whose host stores evict a few of A's copies (a 16-chunk host)


def unpressured_host_hit(window_first: bool) -> int:
    with tiered(window_first=window_first) as s:
        run(s, "a", A, "A")
        return host_hit(s, RESUME)


@ORDERS
def test_a_demote_copies_the_window_tails_the_host_tier_lacks(window_first: bool) -> None:
    expected = unpressured_host_hit(window_first)
    assert expected >= 8 * BLOCK
    full, window = (1, 0) if window_first else (0, 1)
    with tiered(window_first=window_first) as s:
        run(s, "a", A, "A")
        run(s, "p", PRESSURE, "P")
        before = host_copies(s, A)
        op = operation(s, pb.Hint(selector=session("A"), demote=pb.DemoteAction()))
        assert op.state.name == "SUCCEEDED" and op.blocks == {Tier.HOST: 10}
        after = host_copies(s, A)
        assert set(after[full]) == set(range(10)), (before, after)
        assert set(after[window]) == set(device_copies(s, A)[window]), f"window tails left on the device only: {before} -> {after}"
        # bytes_moved counts every copy made, each group's (a copy is one block id's bytes)
        assert op.bytes_moved == (copies(after) - copies(before)) * s.kvhint_adapter.tiers.ops.bytes_per_block > 0
        assert s.reset_prefix_cache()  # the device copies go (pause, sleep)
        assert host_hit(s, RESUME) == expected


@ORDERS
@pytest.mark.parametrize("policy", ["lru", "kvhint"])
def test_a_prefetch_stages_the_window_tails_a_file_holds(window_first: bool, policy: str, tmp_path: Path) -> None:
    expected = unpressured_host_hit(window_first)
    full = 1 if window_first else 0
    with tiered(window_first=window_first, policy=policy, file_root=str(tmp_path)) as s:
        run(s, "a", A, "A")
        run(s, "p", PRESSURE, "P")
        assert s.reset_prefix_cache()
        s.kvhint_core.settle()
        before = host_copies(s, A)
        op = operation(s, pb.Hint(selector=session("A"), prefetch=pb.PrefetchAction()))
        assert op.state.name == "SUCCEEDED" and op.blocks == {Tier.HOST: 10}
        after = host_copies(s, A)
        assert set(after[full]) == set(range(10)), (before, after)
        assert host_hit(s, RESUME) == expected, f"staged without its window tails: {before} -> {after}"
        assert op.bytes_moved == (copies(after) - copies(before)) * s.kvhint_adapter.tiers.ops.bytes_per_block > 0



def test_a_prefetch_whose_window_copies_find_no_room_fails_after_the_grace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every host chunk is pinned by a request's load (no tier work in flight to wait for), and the
    session's full-attention copies are on the host while its window tails are on files only:
    no round can promote anything. The Prefetch fails RESOURCE_EXHAUSTED once the grace has
    passed ("never a hang", README: KV tiers), as a dense one does; it counted the blocks whose
    full-attention copy was already there as progress every round and kept the engine
    stepping until its deadline (60 s by default)."""
    monkeypatch.setattr(operations, "HOST_FULL_GRACE_S", 0.05)
    with tiered(file_root=str(tmp_path)) as s:
        run(s, "a", A, "A")
        run(s, "p", PRESSURE, "P")
        assert s.reset_prefix_cache()
        s.kvhint_core.settle()
        ctl = s.kvhint_adapter.tiers.ctl
        assert ctl.host_used() == ctl.host_capacity()
        landed = [k for k in list(ctl.primary._policy.chunks) if ctl.primary.lookup(k, ctl._probe) is LookupResult.HIT]
        reader = ReqContext(req_id="reader")
        ctl.primary.on_new_request(reader)
        ctl.primary.prepare_load(landed, reader)  # a resume's load of every host copy
        assert not ctl.host_work_in_flight()
        (result,) = apply(s, pb.Hint(selector=session("A"), prefetch=pb.PrefetchAction()))
        drive(s)  # 300 steps, over 0.6 s: more than ten graces
        op = s.kvhint_core.operations.get(result.operation_id)
        assert op.state.name == "FAILED" and op.reason is Reason.RESOURCE_EXHAUSTED, (op.state, op.message)
        assert "the host tier is full" in op.message
