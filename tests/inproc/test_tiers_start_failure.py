"""A tier operation whose start raises (engine_integration.tiers.operations.TierOperations.start):
the executor answers the hint REJECTED OPERATION_FAILED and discards its operation
(kvhint_server/executor.py, `_tier_action`; EngineAdapter.start_tier_task: "the hint is then
REJECTED ... and the operation is discarded unseen"). Nothing it started may go on behind that
answer: no copy made later under its operation id, no transfer published, no device block or
host chunk left pinned, and the engine free to go idle. vLLM's real OffloadingConnector,
in-process (tier_support)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from pool_support import session, tokens
from tier_support import BLOCK, apply, drive, hashes_of, run, tiered

from engine_integration.tiers import operations
from kvhint.v1 import kvhint_pb2 as pb
from kvhint_server.events import OperationCompleted, TierTransferCompleted
from kvhint_server.model import HintResult, Outcome, Reason

A = tokens(1, 10 * BLOCK)
PRESSURE = tokens(7, 8 * BLOCK + 1)  # 8 blocks: the 16-chunk host tier evicts 2 of A's copies


def _published(s: Any, after: int) -> list[Any]:
    s.kvhint_core.settle()
    return [e.payload for e in s.kvhint_core.bus.read_after(after, 1_000_000)]


def _rejected_and_left_nothing(s: Any, result: HintResult, after: int) -> None:
    assert result.outcome is Outcome.REJECTED and result.reason is Reason.OPERATION_FAILED, result
    drive(s, steps=50)
    assert not s.has_requests(), "the failed start left work that keeps the engine stepping"
    published = _published(s, after)
    assert not [p for p in published if isinstance(p, (TierTransferCompleted, OperationCompleted))], published


def test_a_prefetch_whose_first_file_probe_raises_is_rejected_and_stops(tmp_path: Path) -> None:
    with tiered(hybrid=False, file_root=str(tmp_path)) as s:
        run(s, "a", A, "A")
        assert s.reset_prefix_cache(reset_connector=True)  # device and host copies gone: files only
        drive(s)
        ctl = s.kvhint_adapter.tiers.ctl
        assert ctl.host_used() == 0
        real, calls = ctl.manager.lookup, []

        def lookup(key, ctx):  # type: ignore[no-untyped-def]
            calls.append(key)
            if len(calls) == 1:
                raise OSError("file tier probe failed")
            return real(key, ctx)

        ctl.manager.lookup = lookup
        after = s.kvhint_core.bus.last_sequence
        (result,) = apply(s, pb.Hint(selector=session("A"), prefetch=pb.PrefetchAction()))
        _rejected_and_left_nothing(s, result, after)
        assert ctl.host_used() == 0, "a rejected Prefetch went on staging copies"


def test_a_demote_whose_store_injection_raises_is_rejected_and_unpins(monkeypatch: pytest.MonkeyPatch) -> None:
    with tiered(hybrid=False) as s:
        run(s, "a", A, "A")
        run(s, "p", PRESSURE, "P")
        ctl = s.kvhint_adapter.tiers.ctl
        # The private job counter force_store relies on (README: "relies on private names") is gone.
        monkeypatch.delattr(type(ctl.cs), "_generate_job_id")
        after = s.kvhint_core.bus.last_sequence
        (result,) = apply(s, pb.Hint(selector=session("A"), demote=pb.DemoteAction()))
        _rejected_and_left_nothing(s, result, after)
        assert not ctl.demote_check(hashes_of(A)).pending, "the failed store's host chunks stay reserved, never written"
        assert s.reset_prefix_cache(), "device blocks of the failed store stay pinned"



def test_a_demote_to_disk_that_raises_after_its_store_was_injected_drops_the_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The start injects a store for the blocks only the device holds, then writes the host's
    copies to the file tier, which raises (a stand-in for any error after the injection). The
    store has not gone to the workers yet: it is dropped with the operation, so the rejected
    Demote copies nothing and pins nothing."""
    with tiered(hybrid=False, file_root=str(tmp_path)) as s:
        run(s, "a", A, "A")
        run(s, "p", PRESSURE, "P")
        ctl = s.kvhint_adapter.tiers.ctl
        device_only = ctl.demote_check(hashes_of(A)).missing
        assert device_only  # the pressure evicted some of A's host copies
        for tier in ctl.file_tiers:  # every file goes: the host copies need writing again
            shutil.rmtree(os.path.dirname(tier.file_mapper.base_path))

        def cascade(self, digests):  # type: ignore[no-untyped-def]
            raise OSError("file tier write failed")

        monkeypatch.setattr(operations.TierOperations, "_force_cascade", cascade)
        after = s.kvhint_core.bus.last_sequence
        (result,) = apply(s, pb.Hint(selector=session("A"), demote=pb.DemoteAction(target_tier=pb.TIER_DISK)))
        _rejected_and_left_nothing(s, result, after)
        assert ctl.demote_check(device_only).missing == device_only, "the rejected Demote's store copied blocks"
        assert s.reset_prefix_cache(), "device blocks of the dropped store stay pinned"
