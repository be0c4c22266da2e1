"""KV tiers on the hybrid model (Gemma 2: a 128-token sliding-window group and a full-attention
group, 80 G1 blocks of 32 tokens, a 128-block host tier that honours retention
(`host-eviction=kvhint`) and a file tier shared with a second engine, its Share peer): presence
on a lower tier is defined as on the device, by the full-attention copies (the window group
holds tails only, on every tier), so QueryResidency reports the copies vLLM's connector made,
Demote copies and succeeds, Prefetch stages file copies in host memory, the resumes hit, a
retained session keeps every group's host copy through host pressure, and Share makes the
session a host hit on the peer. With no hint in effect the host tier's order is vLLM's LRU (the
tests other than the retention one send none that outlives them).

Before this, the tier runtime required every group's copy: the host tier looked like it held
4 of a 720-token session's 22 prompt blocks (only the window tail has a window copy), and
Demote was REJECTED ("19 of 23 blocks left every tier before a copy was made")."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import test_tiers as tiers_tests
from engine_support import release, retain, session_sel, tokens

from engine_integration.served import EngineSpec, ServedEngine, free_port
from kvhint.v1 import kvhint_pb2 as pb

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def hybrid_pair(hybrid_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tiers_tests.Pair]:
    """Engine A (the tests' engine) and engine B, its Share peer: both serve the hybrid model
    and share one file tier."""
    root = tmp_path_factory.mktemp("kvtier-hybrid") / "fs"
    port_a, port_b = free_port(), free_port()

    def served(port: int, tiers: str, name: str) -> ServedEngine:
        log = tmp_path_factory.getbasetemp() / f"engine-hybrid-tiers-{name}.log"
        return ServedEngine(EngineSpec(model=hybrid_model, grpc_port=port, env={"VLLM_SERVER_DEV_MODE": "1"},
                                       extra_args=["--kvhint-tiers", tiers]), log)

    yield from tiers_tests.serve_pair(
        served(port_a, f"host=128,file={root},ephemeral,host-eviction=kvhint,peer=b=127.0.0.1:{port_b},timeout=20", "a"),
        served(port_b, f"host=64,file={root},ephemeral,peer=a=127.0.0.1:{port_a}", "b"),
        root, set())


@pytest.fixture(scope="module")
def tiered(hybrid_pair: tiers_tests.Pair) -> tiers_tests.TierEngine:
    return hybrid_pair.a


def test_host_copies_count_by_the_full_attention_group(tiered: tiers_tests.TierEngine) -> None:
    tiered.reset()
    tiered.complete(tokens("th-natural"), "th-natural")  # 720 tokens: 22 full blocks
    tiers_tests._wait_tier(tiered, "th-natural", 22, pb.TIER_HOST)
    assert len(tiered.session_tiers("th-natural")) == 22


def test_demote_then_resume_reloads_the_prefix_from_the_host_tier(tiered: tiers_tests.TierEngine) -> None:
    tiered.reset()
    # Reference: the hit of the same resume with nothing evicted (vLLM caches the window
    # tail where the prompt ended, so the decode block is not part of it).
    ref_prompt = tokens("th-ref")
    ref_first = tiered.complete(ref_prompt, "th-ref", max_tokens=24)
    reference = tiered.complete(ref_prompt + list(ref_first.token_ids), "th-ref", max_tokens=8).cached_tokens
    assert reference >= 22 * 32
    tiered.reset()

    prompt = tokens("th-demote")
    first = tiered.complete(prompt, "th-demote", max_tokens=24)  # 744 tokens: 23 full blocks
    (result,) = tiered.apply(tiers_tests.demote("th-demote"))
    assert result.outcome == pb.OUTCOME_DEFERRED and result.operation_id, result
    op, _ = tiered.wait_op(result.operation_id)
    assert op.state == pb.Operation.STATE_SUCCEEDED, op
    assert {c.tier: c.blocks for c in op.blocks} == {pb.TIER_HOST: 23}

    for i in range(2):  # more than the 80-block pool holds beside the session
        tiered.complete(tokens(f"th-filler-{i}"))
    after = tiered.session_tiers("th-demote")
    assert len(after) == 23 and all(pb.TIER_DEVICE not in t and pb.TIER_HOST in t for t in after), after

    before = tiered.metrics()
    again = tiered.complete(prompt + list(first.token_ids), "th-demote", max_tokens=8)
    assert again.cached_tokens == reference
    assert tiered.cached_by_source(before, reference, "host")["host"] == reference


def test_prefetch_warms_the_host_tier_from_files_and_the_resume_is_a_host_hit(tiered: tiers_tests.TierEngine) -> None:
    tiered.reset()
    warm = tokens("th-warm")
    first = tiered.complete(warm, "th-warm", max_tokens=8)
    tiers_tests._wait_disk(tiered, "th-warm", 22)
    # Each 720-token prompt stores 22 full-attention and 4 window chunks: six of them push the
    # session out of G1 (80 blocks) and out of the 128-chunk host tier.
    tiered.fill("th-pf", n=6)
    t = tiered.session_tiers("th-warm")
    assert len(t) == 22 and all(x == {pb.TIER_DISK} for x in t), t

    (result,) = tiered.apply(tiers_tests.prefetch("th-warm"))
    assert result.outcome == pb.OUTCOME_DEFERRED, result
    op, _ = tiered.wait_op(result.operation_id)
    assert op.state == pb.Operation.STATE_SUCCEEDED, op
    assert {c.tier: c.blocks for c in op.blocks} == {pb.TIER_HOST: 22}
    assert all(x == {pb.TIER_HOST, pb.TIER_DISK} for x in tiered.session_tiers("th-warm"))

    before = tiered.metrics()
    again = tiered.complete(warm, "th-warm", max_tokens=8)
    assert again.cached_tokens == tiers_tests.FULL and again.token_ids == first.token_ids
    assert tiered.cached_by_source(before, tiers_tests.FULL, "host")["host"] == tiers_tests.FULL


def test_a_retained_session_keeps_its_host_copies_through_host_pressure(tiered: tiers_tests.TierEngine) -> None:
    """The host policy ranks every group's copy (vLLM's offload key is the block hash + the group
    id) as its logical block: the retained session's window-tail copies stay with its
    full-attention copies, so the resume is a host hit of the whole prefix. Six newer 26-chunk
    prompts go through the 128-chunk host tier, which an LRU host would answer by dropping both
    older sessions (it does: with vLLM's LRU host this test fails on the first assertion).
    G1 is then emptied, so the resume reads the host tier: had the window-tail copies gone, it
    would load them from the file tier or recompute."""
    tiered.reset()
    keep, control = tokens("th-keep"), tokens("th-control")
    first = tiered.complete(keep, "th-keep", max_tokens=8)
    tiered.complete(control, "th-control", max_tokens=8)
    for session in ("th-keep", "th-control"):
        tiers_tests._wait_tier(tiered, session, 22, pb.TIER_HOST)
        tiers_tests._wait_disk(tiered, session, 22)
    (result,) = tiered.apply(retain("th-keep", priority=1, ttl=120))
    assert result.outcome == pb.OUTCOME_ACCEPTED, result
    for i in range(6):
        tiered.complete(tokens(f"th-keep-pressure-{i}"), f"th-keep-p{i}")
        tiers_tests._wait_disk(tiered, f"th-keep-p{i}", 22)
    tiered.reset(external=False)  # G1 only (Retain kept the session there): the resume must come from below
    kept = tiered.session_tiers("th-keep")
    lost = [i for i, t in enumerate(kept) if pb.TIER_HOST not in t]
    assert len(kept) == 22 and not lost, f"blocks {lost} of the retained session lost their host copy"
    assert not any(pb.TIER_DEVICE in t for t in kept)
    assert not any(pb.TIER_HOST in t for t in tiered.session_tiers("th-control"))  # the unhinted one went
    before = tiered.metrics()
    again = tiered.complete(keep, "th-keep", max_tokens=8)
    assert again.cached_tokens == tiers_tests.FULL and again.token_ids == first.token_ids
    assert tiered.cached_by_source(before, tiers_tests.FULL, "host")["host"] == tiers_tests.FULL
    (done,) = tiered.apply(release("th-keep"))
    assert done.outcome == pb.OUTCOME_ACCEPTED, done


def test_share_makes_a_session_only_a_computed_a_host_hit_on_the_peer(hybrid_pair: tiers_tests.Pair) -> None:
    """Share on the hybrid model: A's file tier receives every group's copy of the session (the
    cascade copies each group's host copy), B's Prefetch stages them in its host tier, and B's
    resume of the session is a 704-token host hit with A's tokens."""
    a, b = hybrid_pair.a, hybrid_pair.b
    a.reset()
    b.reset()
    prompt = tokens("th-share")
    first = a.complete(prompt, "th-share", max_tokens=8)
    hashes = [blk.block_hash for blk in a.residency(session_sel("th-share"))]
    assert len(hashes) == 22
    by_hash = pb.Selector(block_hashes=pb.BlockHashSelector(block_hashes=hashes))
    assert not any(set(blk.tiers) & {pb.TIER_DEVICE, pb.TIER_HOST} for blk in b.residency(by_hash))

    (result,) = a.apply(tiers_tests.share("th-share", "b"))
    assert result.outcome == pb.OUTCOME_DEFERRED, result
    op, _ = a.wait_op(result.operation_id)
    assert op.state == pb.Operation.STATE_SUCCEEDED, op
    assert {c.tier: c.blocks for c in op.blocks} == {pb.TIER_DISK: 22, pb.TIER_REMOTE: 22}
    on_b = b.residency(by_hash)
    assert len(on_b) == 22 and all(pb.TIER_HOST in blk.tiers for blk in on_b)

    before = b.metrics()
    again = b.complete(prompt, "th-share", max_tokens=8)
    assert again.cached_tokens == tiers_tests.FULL and again.token_ids == first.token_ids
    assert b.cached_by_source(before, tiers_tests.FULL, "host")["host"] == tiers_tests.FULL
