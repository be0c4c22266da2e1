"""Domain values -> kvhint.v1 messages. Enum values are shared with the wire."""

from __future__ import annotations

from google.protobuf import duration_pb2, timestamp_pb2

from kvhint.v1 import kvhint_pb2 as pb

from .config import ServerConfig
from .events import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    Coordinates,
    Event,
    HintApplied,
    MembershipChanged,
    OperationCompleted,
    PinBroken,
    TierTransferCompleted,
)
from .model import EngineInfo, HintResult, KvCacheGroupInfo, RetentionClass, RetentionView, Tier, tiers_of
from .operations import Operation
from .queries import BlockView, SessionView

PROTOCOL_VERSION = "kvhint.v1"


def duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(round(seconds * 1e9)))
    return d


def timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    t = timestamp_pb2.Timestamp()
    t.FromNanoseconds(int(seconds * 1e9))
    return t


def tier_counts(counts: dict[Tier, int]) -> list[pb.TierBlockCount]:
    return [pb.TierBlockCount(tier=int(t), blocks=n) for t, n in sorted(counts.items())]


def hint_result(r: HintResult) -> pb.HintResult:
    msg = pb.HintResult(
        hint_id=r.hint_id,
        outcome=int(r.outcome),
        reason=int(r.reason),
        message=r.message,
        affected_blocks=tier_counts(r.affected),
        operation_id=r.operation_id,
        replayed=r.replayed,
    )
    for c in r.clips:
        clip = msg.clips.add(reason=int(c.reason), detail=c.detail, requested_blocks=c.requested_blocks, granted_blocks=c.granted_blocks)
        if c.requested_ttl_ns is not None:
            clip.requested_ttl.FromNanoseconds(c.requested_ttl_ns)
        if c.granted_ttl_s is not None:
            clip.granted_ttl.CopyFrom(duration(c.granted_ttl_s))
    if r.effective_ttl_s is not None:
        msg.effective_ttl.CopyFrom(duration(r.effective_ttl_s))
    return msg


def retention(view: RetentionView) -> pb.RetentionState:
    msg = pb.RetentionState(retention_class=int(view.cls), priority=view.priority)
    if view.expires_at is not None and view.cls is not RetentionClass.ORDINARY:
        msg.expires_at.CopyFrom(timestamp(view.expires_at))
    return msg


def block_info(v: BlockView, block_size: int) -> pb.BlockInfo:
    msg = pb.BlockInfo(
        block_hash=v.block_hash,
        parent_block_hash=v.parent or b"",
        tiers=[int(t) for t in tiers_of(v.tiers)],
        in_use=v.in_use,
        retention=retention(v.retention),
        session_ids=list(v.sessions),
    )
    if v.position is not None:
        msg.position = v.position
        msg.prefix_tokens = (v.position + 1) * block_size
    return msg


def session_info(v: SessionView) -> pb.SessionInfo:
    msg = pb.SessionInfo(
        session_id=v.session_id,
        parent_session_id=v.parent or "",
        frontier_hashes=list(v.frontiers),
        blocks=tier_counts(v.counts),
        retention=retention(v.retention),
        continuation_ids=list(v.continuations),
    )
    if v.last_active:
        msg.last_active.CopyFrom(timestamp(v.last_active))
    return msg


def operation(op: Operation) -> pb.Operation:
    msg = pb.Operation(
        operation_id=op.operation_id,
        hint_id=op.hint_id,
        action=int(op.action),
        state=int(op.state),
        reason=int(op.reason),
        message=op.message,
        blocks=tier_counts(op.blocks),
        bytes_moved=op.bytes_moved,
        destination=op.destination,
    )
    msg.created_at.CopyFrom(timestamp(op.created_at))
    if op.completed_at is not None:
        msg.completed_at.CopyFrom(timestamp(op.completed_at))
    return msg


def capabilities(info: EngineInfo, config: ServerConfig, epoch: str, pin_budget_blocks: int) -> pb.GetCapabilitiesResponse:
    return pb.GetCapabilitiesResponse(
        protocol_version=PROTOCOL_VERSION,
        engine=info.engine,
        engine_version=info.engine_version,
        block_size=info.block_size,
        num_device_blocks=info.num_device_blocks,
        block_hash_encoding=info.block_hash_encoding,
        actions=[
            pb.ActionSupport(
                action=int(a.action),
                supported=a.supported,
                selectors=[int(k) for k in a.selectors],
                supports_range=a.supports_range,
                notes=a.notes,
                supports_expected_reuse=a.supports_expected_reuse,
            )
            for a in info.actions
        ],
        tiers=[
            pb.TierInfo(tier=int(t.tier), medium=t.medium, capacity_blocks=t.capacity_blocks, shared=t.shared,
                        honours_retention=t.honours_retention)
            for t in info.tiers
        ],
        limits=pb.Limits(
            max_ttl=duration(config.max_ttl_s),
            pin_budget_blocks=pin_budget_blocks,
            pin_budget_fraction=config.pin_budget_fraction,
            max_hints_per_batch=config.max_hints_per_batch,
            max_id_length=config.max_id_length,
            max_hint_id_length=config.max_hint_id_length,
            max_block_hashes_per_selector=config.max_block_hashes_per_selector,
            max_block_hashes_per_batch=config.max_block_hashes_per_batch,
            max_page_size=config.max_page_size,
            idempotency_window=config.idempotency_window,
        ),
        epoch=epoch,
        event_replay_window=config.event_replay_window,
        share_destinations=list(info.share_destinations),
        kv_cache_groups=[kv_cache_group(g) for g in info.kv_cache_groups],
        data_parallel_rank=info.data_parallel_rank,
        data_parallel_size=info.data_parallel_size,
    )


def kv_cache_group(g: KvCacheGroupInfo) -> pb.KvCacheGroup:
    return pb.KvCacheGroup(
        group_id=g.group_id,
        kind=int(g.kind),
        block_size=g.block_size,
        sliding_window_tokens=g.sliding_window_tokens,
        defines_residency=g.defines_residency,
    )


def _coordinates(c: Coordinates) -> pb.SessionCoordinates:
    return pb.SessionCoordinates(session_id=c.session_id, continuation_id=c.continuation_id, member_session_ids=list(c.members))


def event_bytes(ev: Event, epoch: str) -> bytes:
    """The serialized WatchEventsResponse of an event, built once and shared
    by every subscriber (cached on the event)."""
    if ev.wire is not None:
        return ev.wire
    msg = pb.WatchEventsResponse(epoch=epoch, sequence=ev.sequence)
    msg.time.CopyFrom(timestamp(ev.time))
    p = ev.payload
    if isinstance(p, BlocksStored):
        block_size = p.block_size
        msg.blocks_stored.CopyFrom(
            pb.BlocksStored(
                tier=int(p.tier),
                medium=p.medium,
                block_hashes=list(p.block_hashes),
                parent_block_hash=p.parent or b"",
                first_position=p.first_position,
                block_size=block_size,
                prefix_tokens=(p.first_position + len(p.block_hashes)) * block_size,
                coordinates=_coordinates(p.coordinates),
                prefix_hit=p.prefix_hit,
            )
        )
    elif isinstance(p, BlocksRemoved):
        msg.blocks_removed.CopyFrom(
            pb.BlocksRemoved(
                tier=int(p.tier),
                medium=p.medium,
                block_hashes=list(p.block_hashes),
                coordinates=_coordinates(p.coordinates),
                prefix_tokens=list(p.prefix_tokens),
                cause=int(p.cause),
                last_copy=p.last_copy,
            )
        )
    elif isinstance(p, TierTransferCompleted):
        msg.tier_transfer_completed.CopyFrom(
            pb.TierTransferCompleted(
                from_tier=int(p.from_tier),
                to_tier=int(p.to_tier),
                block_hashes=list(p.block_hashes),
                bytes_moved=p.bytes_moved,
                operation_id=p.operation_id,
                coordinates=_coordinates(p.coordinates),
            )
        )
    elif isinstance(p, PinBroken):
        msg.pin_broken.CopyFrom(
            pb.PinBroken(block_hashes=list(p.block_hashes), session_ids=list(p.session_ids), shortfall_blocks=p.shortfall_blocks)
        )
    elif isinstance(p, HintApplied):
        msg.hint_applied.CopyFrom(pb.HintApplied(hint=p.hint, result=p.message if p.message is not None else hint_result(p.result)))
    elif isinstance(p, OperationCompleted):
        msg.operation_completed.CopyFrom(pb.OperationCompleted(operation=operation(p.operation)))
    elif isinstance(p, AllBlocksCleared):
        msg.all_blocks_cleared.CopyFrom(pb.AllBlocksCleared(tier=int(p.tier)))
    elif isinstance(p, MembershipChanged):
        msg.membership_changed.CopyFrom(
            pb.MembershipChanged(session_id=p.session_id, block_hashes=list(p.block_hashes), cause=int(p.cause))
        )
    ev.wire = msg.SerializeToString()
    return ev.wire
