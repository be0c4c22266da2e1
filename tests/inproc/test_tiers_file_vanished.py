"""The file tier (G3) emits no removal events and KvHint keeps the blocks it saw written there
(engine_integration/tiers/hashes.py, `HashBook.on_disk`) so that lookups cost no stat. Files
can still go underneath it: another engine sharing the root removes an ephemeral tier at its
shutdown (`file_ephemeral`), an operator cleans the directory. An operation that needs the
file copy probes it at its start (feed.ResidencyFeed.file_has): a Demote to the disk tier
writes the file again instead of SUCCEEDING over nothing, a Prefetch fails as "on no lower
tier", and either publishes BlocksRemoved(TIER_DISK) for the copies the index had there, so
later lookups and hints no longer see them. vLLM's real OffloadingConnector and fs tier,
in-process (tier_support)."""

from __future__ import annotations

import glob
import shutil
from pathlib import Path
from typing import Any

from pool_support import session, tokens
from tier_support import BLOCK, apply, drive, hashes_of, operation, run, tiered

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_server.events import BlocksRemoved, BlocksStored
from kvhint_server.model import Outcome, Reason, RemovalCause, Tier

A = tokens(1, 10 * BLOCK)


def _published(s: Any, after: int) -> list[Any]:
    s.kvhint_core.settle()
    return [e.payload for e in s.kvhint_core.bus.read_after(after, 1_000_000)]


def _wire(s: Any, prompt: list[int]) -> list[bytes]:
    return [s.kvhint_adapter.external(d) for d in hashes_of(prompt)]


def _on_disk(s: Any, prompt: list[int]) -> int:
    """Blocks of `prompt` the engine reports on the disk tier (a residency lookup)."""
    return sum(1 for st in s.kvhint_adapter.lookup(_wire(s, prompt)).values() if st.tiers & Tier.DISK.bit)


def _files(s: Any, prompt: list[int]) -> int:
    ctl = s.kvhint_adapter.tiers.ctl
    return sum(ctl.file_has(d) for d in hashes_of(prompt))


def _remove_files(s: Any) -> None:
    """Every file of the tier goes (as another engine's ephemeral shutdown removes them)."""
    for tier in s.kvhint_adapter.tiers.ctl.file_tiers:
        for path in glob.glob(tier.file_mapper.base_path + "*"):
            shutil.rmtree(path)


def _disk_removals(published: list[Any]) -> set[bytes]:
    return {h for p in published if isinstance(p, BlocksRemoved) and p.tier is Tier.DISK for h in p.block_hashes}


def test_a_demote_to_disk_after_the_files_went_writes_them_again(tmp_path: Path) -> None:
    with tiered(hybrid=False, file_root=str(tmp_path)) as s:
        run(s, "a", A, "A")
        assert _files(s, A) == 10 and _on_disk(s, A) == 10
        _remove_files(s)
        assert _files(s, A) == 0
        after = s.kvhint_core.bus.last_sequence
        op = operation(s, pb.Hint(selector=session("A"), demote=pb.DemoteAction(target_tier=pb.TIER_DISK)))
        assert op.state.name == "SUCCEEDED", (op.state, op.message)
        assert _files(s, A) == 10, "the Demote to the disk tier SUCCEEDED with no file there"
        published = _published(s, after)
        wire = set(_wire(s, A))
        assert _disk_removals(published) == wire  # the copies that went, reported once
        removed = next(p for p in published if isinstance(p, BlocksRemoved) and p.tier is Tier.DISK)
        assert removed.cause is RemovalCause.EVICTED and removed.medium == "STORAGE" and not removed.last_copy
        restored = {h for p in published if isinstance(p, BlocksStored) and p.tier is Tier.DISK for h in p.block_hashes}
        assert restored == wire and _on_disk(s, A) == 10


def test_a_prefetch_after_the_files_went_reports_them_gone(tmp_path: Path) -> None:
    with tiered(hybrid=False, file_root=str(tmp_path)) as s:
        run(s, "a", A, "A")
        assert s.reset_prefix_cache(reset_connector=True)  # device and host copies gone: files only
        drive(s)
        assert _on_disk(s, A) == 10
        _remove_files(s)
        after = s.kvhint_core.bus.last_sequence
        op = operation(s, pb.Hint(selector=session("A"), prefetch=pb.PrefetchAction()))
        assert op.state.name == "FAILED" and op.reason is Reason.OPERATION_FAILED, (op.state, op.message)
        assert "on no lower tier" in op.message
        published = _published(s, after)
        removed = [p for p in published if isinstance(p, BlocksRemoved) and p.tier is Tier.DISK]
        assert _disk_removals(published) == set(_wire(s, A)), "the disk copies that went were never reported removed"
        assert all(p.last_copy for p in removed)  # no other tier holds them
        assert _on_disk(s, A) == 0
        (again,) = apply(s, pb.Hint(selector=session("A"), prefetch=pb.PrefetchAction()))
        assert again.outcome is Outcome.MISSING, again

