"""A tenant's pin budget clips a Pin on an engine with a sliding-window KV-cache group: the blocks
after the last prefix end a resume can hit are dropped too (REASON_WINDOW_TAIL_MISSING), and the
budget they would have taken goes to the tenant's next Pin in the same batch, as it would in a
batch of its own (real gRPC on loopback, the fake engine; kvhint_server/window_tails.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from kvhint_unit_support import Harness, h, local_engine_info, pin, retain

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_server.model import KvCacheGroupInfo, KvCacheGroupKind

TENANTS = {"tenants": [{"name": "team-a", "session_prefix": "a/", "tokens": ["tok-a"], "pin_budget_blocks": 6}]}
A = (("authorization", "Bearer tok-a"),)
GROUPS = (
    KvCacheGroupInfo(0, KvCacheGroupKind.FULL_ATTENTION, 16),
    KvCacheGroupInfo(1, KvCacheGroupKind.SLIDING_WINDOW, 16, 32, defines_residency=False),  # a hit needs 2 window blocks
)


def run(tmp_path: Path, batched: bool) -> list[tuple[str, list[tuple[str, int, int]], int]]:
    tmp_path.mkdir()
    (tmp_path / "tenants.json").write_text(json.dumps(TENANTS))
    info = dataclasses.replace(local_engine_info(num_device_blocks=64), kv_cache_groups=GROUPS)
    hx = Harness(info, tenants_file=str(tmp_path / "tenants.json"))
    try:
        long, short = [h(100 + i) for i in range(8)], [h(200), h(201)]
        hx.engine.store(long, session="a/long")
        hx.engine.store(short, session="a/short")
        # Window copies: positions 2 and 3 of the long chain (a hit can end at position 3), both of the short one.
        hx.engine.groups_held.update({b: 0b11 if i in (2, 3) else 0b01 for i, b in enumerate(long)})
        hints = [pin("a/long", 60), pin("a/short", 60)]
        if batched:
            results = list(hx.stub.ApplyHints(pb.ApplyHintsRequest(hints=hints), metadata=A, timeout=10).results)
        else:
            results = [hx.stub.ApplyHints(pb.ApplyHintsRequest(hints=[x]), metadata=A, timeout=10).results[0] for x in hints]
        return [
            (pb.Outcome.Name(r.outcome), [(pb.Reason.Name(c.reason), c.requested_blocks, c.granted_blocks) for c in r.clips],
             sum(t.blocks for t in r.affected_blocks))
            for r in results
        ]
    finally:
        hx.close()


def test_a_tenant_budget_clip_keeps_a_resumable_prefix_and_frees_the_rest(tmp_path: Path) -> None:
    batched = run(tmp_path / "batched", batched=True)
    assert batched == [
        ("OUTCOME_CLIPPED", [("REASON_PIN_BUDGET", 8, 6), ("REASON_WINDOW_TAIL_MISSING", 6, 4)], 4),
        ("OUTCOME_ACCEPTED", [], 2),  # the 2 budget blocks the trim left
    ]
    assert run(tmp_path / "one-by-one", batched=False) == batched


def test_a_retain_the_trim_left_off_pinned_blocks_still_counts_them_against_the_pin_budget(tmp_path: Path) -> None:
    """A Retain replaces its owner's own Pin only on the blocks it is granted: the blocks the
    window-tail trim dropped stay pinned, so a Pin after it in the same batch gets only the
    budget left, as it would in a batch of its own (pin budget 8: 4 of the long session's
    blocks stay pinned, so 4 of the other session's 6 may be pinned; the batch pinned all 6)."""
    tenants = {"tenants": [{"name": "team-a", "session_prefix": "a/", "tokens": ["tok-a"], "pin_budget_blocks": 8}]}

    def run_batch(path: Path, batched: bool) -> tuple[list[tuple[str, list[tuple[str, int, int]]]], int]:
        path.mkdir()
        (path / "tenants.json").write_text(json.dumps(tenants))
        info = dataclasses.replace(local_engine_info(num_device_blocks=64), kv_cache_groups=GROUPS)
        hx = Harness(info, tenants_file=str(path / "tenants.json"))
        try:
            long, other = [h(100 + i) for i in range(8)], [h(200 + i) for i in range(6)]
            hx.engine.store(long, session="a/long")
            hx.engine.store(other, session="a/other")
            # A hit can end at position 3 of the long chain (its window copies are at 2 and 3), anywhere on the other.
            hx.engine.groups_held.update({b: 0b11 if i in (2, 3) else 0b01 for i, b in enumerate(long)})
            hx.engine.groups_held.update({b: 0b11 for b in other})
            first = hx.stub.ApplyHints(pb.ApplyHintsRequest(hints=[pin("a/long", 60)]), metadata=A, timeout=10).results[0]
            assert first.outcome == pb.OUTCOME_ACCEPTED
            hints = [retain("a/long", 60, max_blocks=6), pin("a/other", 60)]
            if batched:
                results = list(hx.stub.ApplyHints(pb.ApplyHintsRequest(hints=hints), metadata=A, timeout=10).results)
            else:
                results = [hx.stub.ApplyHints(pb.ApplyHintsRequest(hints=[x]), metadata=A, timeout=10).results[0] for x in hints]
            pinned = hx.engine.run(lambda: sum(
                1 for per in hx.core.ledger.grants.values() if any(g.pinned for g in per.values())))
            return [
                (pb.Outcome.Name(r.outcome), [(pb.Reason.Name(c.reason), c.requested_blocks, c.granted_blocks) for c in r.clips])
                for r in results
            ], pinned
        finally:
            hx.close()

    batched = run_batch(tmp_path / "batched", batched=True)
    assert batched == (
        [
            ("OUTCOME_CLIPPED", [("REASON_MAX_BLOCKS", 8, 6), ("REASON_WINDOW_TAIL_MISSING", 6, 4)]),
            ("OUTCOME_CLIPPED", [("REASON_PIN_BUDGET", 6, 4)]),
        ],
        8,
    )
    assert run_batch(tmp_path / "one-by-one", batched=False) == batched
