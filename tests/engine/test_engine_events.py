"""WatchEvents on a real engine: coordinates, resume, snapshot consistency, and
agreement with vLLM's own ZMQ KV events.

Tests taking `any_engine` / `any_clean` run on the dense and on the hybrid
model. There, events are per logical block: BlocksStored when the
full-attention group (the group GetCapabilities marks defines_residency)
caches a block, BlocksRemoved when its copy there goes, whatever happens to
the sliding-window copies."""

from __future__ import annotations

import time
from collections import defaultdict

import pytest
from engine_support import Engine, pin, release, session_sel, tokens
from events_support import Collector, block_hash_int, latest_sequence

from engine_integration.kv_groups import residency_view
from kvhint.v1 import kvhint_pb2 as pb

pytestmark = pytest.mark.engine

NOW = pb.WatchEventsRequest(start=pb.WatchEventsRequest.START_NOW)


def test_events_have_one_epoch_and_strictly_increasing_sequences(clean: Engine) -> None:
    epoch = clean.stub.GetCapabilities(pb.GetCapabilitiesRequest()).epoch
    watch = Collector(clean.grpc_address, NOW)
    time.sleep(0.3)
    clean.complete(tokens("seq-a"), "seq-a", continuation_id="seq-a/1")
    clean.fill("seq")
    watch.wait_sequence(latest_sequence(clean.stub))
    events = watch.events()
    watch.stop()
    assert events and {e.epoch for e in events} == {epoch}
    seqs = [e.sequence for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # unfiltered: no gaps


def test_stored_and_removed_events_carry_session_coordinates(any_clean: Engine) -> None:
    watch = Collector(any_clean.grpc_address, NOW)
    time.sleep(0.3)
    prompt = tokens("coords")
    any_clean.complete(prompt, "coords", continuation_id="coords/turn-1")
    any_clean.fill("coords")  # evicts the session
    watch.wait_sequence(latest_sequence(any_clean.stub))
    events = watch.stop()

    stored = [e.blocks_stored for e in events if e.HasField("blocks_stored") and e.blocks_stored.coordinates.session_id == "coords"]
    assert sum(len(s.block_hashes) for s in stored) == 22
    first = stored[0]
    assert first.tier == pb.TIER_DEVICE and first.medium == "GPU"
    assert first.coordinates.continuation_id == "coords/turn-1"
    assert first.first_position == 0 and first.block_size == 32 and first.prefix_tokens == 704
    session_blocks = [h for s in stored for h in s.block_hashes]

    removed = [e.blocks_removed for e in events if e.HasField("blocks_removed")]
    ours = [r for r in removed if r.coordinates.session_id == "coords"]
    removed_hashes = [h for r in ours for h in r.block_hashes]
    assert sorted(removed_hashes) == sorted(session_blocks)  # every block's removal names the session
    for r in ours:
        assert r.coordinates.continuation_id == "coords/turn-1"
        assert "coords" in r.coordinates.member_session_ids
        assert r.cause == pb.REMOVAL_CAUSE_EVICTED and r.last_copy
        position = {h: i for i, h in enumerate(session_blocks)}
        assert list(r.prefix_tokens) == [(position[h] + 1) * 32 for h in r.block_hashes]


def test_resume_inside_the_window_loses_nothing(clean: Engine) -> None:
    first = Collector(clean.grpc_address, NOW)
    time.sleep(0.3)
    clean.complete(tokens("resume-1"), "resume")
    first.wait_sequence(latest_sequence(clean.stub))
    before = first.stop()
    last = max(m.sequence for m in before)

    # While disconnected: admissions and evictions.
    clean.complete(tokens("resume-2"), "resume")
    clean.fill("resume", n=3)
    target = latest_sequence(clean.stub)

    resumed = Collector(
        clean.grpc_address,
        pb.WatchEventsRequest(start=pb.WatchEventsRequest.START_RESUME, resume_epoch=before[0].epoch, resume_after_sequence=last),
    )
    resumed.wait_sequence(target)
    after = resumed.events()
    resumed.stop()
    seqs = [m.sequence for m in after if m.sequence <= target]
    assert seqs == list(range(last + 1, target + 1))

    stored = sum(len(m.blocks_stored.block_hashes) for m in after if m.HasField("blocks_stored") and not m.blocks_stored.prefix_hit)
    removed = sum(len(m.blocks_removed.block_hashes) for m in after if m.HasField("blocks_removed"))
    assert stored == 4 * 22  # every admission while disconnected
    # 110 blocks cached in all; 79 usable blocks, one of them holding the
    # uncached partial last block of the newest request: the rest was evicted.
    assert removed == (22 + 4 * 22) - (79 - 1)


def test_resume_with_a_foreign_epoch_gets_resync(engine: Engine) -> None:
    watch = Collector(
        engine.grpc_address,
        pb.WatchEventsRequest(start=pb.WatchEventsRequest.START_RESUME, resume_epoch="not-this-epoch", resume_after_sequence=1),
    )
    assert watch.ended.wait(10)
    (msg,) = watch.messages
    assert msg.resync.cause == pb.Resync.CAUSE_EPOCH_CHANGED
    assert msg.resync.current_epoch == engine.stub.GetCapabilities(pb.GetCapabilitiesRequest()).epoch


def test_snapshot_plus_live_events_reconstruct_residency(clean: Engine) -> None:
    clean.complete(tokens("snap-a"), "snap-a")
    clean.complete(tokens("snap-b")[:400], "snap-b")
    watch = Collector(clean.grpc_address, pb.WatchEventsRequest(start=pb.WatchEventsRequest.START_SNAPSHOT))
    watch.wait_for(lambda ms: any(m.HasField("snapshot_end") for m in ms))
    # Live changes after the snapshot: a new session, a hit, and evictions.
    clean.complete(tokens("snap-c"), "snap-c")
    clean.complete(tokens("snap-b")[:400] + tokens("snap-b2", 300), "snap-b")
    clean.fill("snap", n=2)
    clean.apply(pin("snap-c", ttl=30))

    residency: dict[str, set[bytes]] = defaultdict(set)
    sessions_of: dict[bytes, set[str]] = defaultdict(set)
    target = latest_sequence(clean.stub)
    watch.wait_sequence(target)
    messages = watch.stop()
    for m in messages:
        kind = m.WhichOneof("payload")
        if kind == "snapshot_chunk" and m.snapshot_chunk.session_id:
            for b in m.snapshot_chunk.blocks:
                if pb.TIER_DEVICE in b.tiers:
                    residency[m.snapshot_chunk.session_id].add(b.block_hash)
                    sessions_of[b.block_hash].add(m.snapshot_chunk.session_id)
        elif kind == "blocks_stored" and m.blocks_stored.coordinates.session_id:
            s = m.blocks_stored.coordinates.session_id
            for h in m.blocks_stored.block_hashes:
                residency[s].add(h)
                sessions_of[h].add(s)
        elif kind == "blocks_removed":
            for h in m.blocks_removed.block_hashes:
                for s in sessions_of.pop(h, ()):
                    residency[s].discard(h)

    for session in ("snap-a", "snap-b", "snap-c"):
        response = clean.stub.QueryResidency(pb.QueryResidencyRequest(selector=session_sel(session), tiers=[pb.TIER_DEVICE]))
        if response.as_of_sequence > target:  # nothing moved since `target`: the probe itself only
            assert all(m.WhichOneof("payload") in ("hint_applied", "heartbeat") for m in messages if m.sequence > target)
        assert {b.block_hash for b in response.blocks} == residency[session], session
    clean.apply(release("snap-c"))


def residency_groups(engine: Engine) -> set[int]:
    groups = engine.stub.GetCapabilities(pb.GetCapabilitiesRequest()).kv_cache_groups
    return {g.group_id for g in groups if g.defines_residency}


def test_stored_and_removed_hashes_agree_with_vllm_zmq_events(any_clean: Engine) -> None:
    """Our device events are vLLM's BlockStored / BlockRemoved of the group that
    defines residency (the only group on the dense model), same hashes, same
    order, same medium names, except that a removal of one of two copies of a
    block is not a removal of the block (kv_groups.residency_view)."""
    engine = any_clean
    assert engine.zmq is not None
    groups = residency_groups(engine)
    assert len(groups) == 1
    engine.complete(tokens("zmq-warmup"))  # vLLM's first batch can race the subscription
    engine.zmq.settle()
    mark = len(engine.zmq.batches)
    watch = Collector(engine.grpc_address, NOW)
    time.sleep(0.3)
    engine.complete(tokens("zmq-a"), "zmq-a", max_tokens=40)  # decode blocks too
    engine.fill("zmq", n=4)
    engine.complete(tokens("zmq-a"), "zmq-a")  # recomputed after eviction: stored again
    watch.wait_sequence(latest_sequence(engine.stub))
    ours = watch.stop()
    engine.zmq.settle()
    theirs = residency_view(engine.zmq.events_since(mark), groups)

    mine = []
    for m in ours:
        if m.HasField("blocks_stored") and not m.blocks_stored.prefix_hit:
            mine += [("stored", block_hash_int(h), m.blocks_stored.medium) for h in m.blocks_stored.block_hashes]
        elif m.HasField("blocks_removed"):
            mine += [("removed", block_hash_int(h), m.blocks_removed.medium) for h in m.blocks_removed.block_hashes]
    assert len(mine) > 100
    assert mine == theirs  # same hashes, same order, same medium names


def test_session_filter_only_delivers_that_sessions_events(clean: Engine) -> None:
    watch = Collector(
        clean.grpc_address,
        pb.WatchEventsRequest(start=pb.WatchEventsRequest.START_NOW, filter=pb.EventFilter(session_ids=["only-me"])),
    )
    time.sleep(0.3)
    clean.complete(tokens("not-me"), "not-me")
    clean.complete(tokens("only-me"), "only-me")
    clean.apply(pin("only-me", ttl=10), pin("not-me", ttl=10))
    watch.wait_for(lambda ms: any(m.HasField("hint_applied") for m in ms))
    time.sleep(0.5)
    events = watch.events()
    watch.stop()
    assert events
    for m in events:
        if m.HasField("blocks_stored"):
            assert m.blocks_stored.coordinates.session_id == "only-me"
        if m.HasField("hint_applied"):
            assert m.hint_applied.hint.selector.session.session_id == "only-me"
    clean.apply(release("only-me"), release("not-me"))


def test_pin_broken_under_pressure_is_reported(clean: Engine) -> None:
    import concurrent.futures

    watch = Collector(clean.grpc_address, NOW)
    for i in range(2):
        clean.complete(tokens(f"brk-{i}"), f"brk-{i}")
    clean.apply(pin("brk-0"), pin("brk-1"))
    big = [tokens(f"brk-huge-{i}", 1000) for i in range(2)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda p: clean.complete(p, max_tokens=64), big))
    watch.wait_sequence(latest_sequence(clean.stub))
    events = watch.stop()
    broken = [m.pin_broken for m in events if m.HasField("pin_broken")]
    assert broken, "two concurrent 32-block requests exceed the unpinned pool: pins must be broken"
    assert set(broken[0].session_ids) <= {"brk-0", "brk-1"} and broken[0].shortfall_blocks > 0
    causes = {m.blocks_removed.cause for m in events if m.HasField("blocks_removed")}
    assert pb.REMOVAL_CAUSE_PIN_BROKEN in causes
    clean.apply(release("brk-0"), release("brk-1"))
