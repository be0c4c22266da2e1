"""Events and queries agree: a follower built from WatchEvents matches QueryResidency and
ListSessions, also after a Release (kvhint.proto MembershipChanged)."""

from __future__ import annotations

from google.protobuf import duration_pb2

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_client.follower import EngineTracker, ResidencyIndex

from .. import hints as H
from ..model import CaseFailed, Registry, check
from ..target import CaseContext

START = pb.WatchEventsRequest
HEARTBEAT_200MS = duration_pb2.Duration(nanos=200_000_000)
TIERS = (pb.TIER_DEVICE, pb.TIER_HOST, pb.TIER_DISK)


def follow(messages: list[pb.WatchEventsResponse]) -> ResidencyIndex:
    """The state the reference follower (kvhint_client EventFollower) builds from these messages."""
    index = ResidencyIndex()
    tracker = EngineTracker("target", "target", index)
    tracker.subscription()
    for message in messages:
        tracker.handle(message)
    if not index.is_live("target"):
        raise CaseFailed("the follower never went live: no complete snapshot on the stream")
    return index


def server_view(ctx: CaseContext, session: str) -> tuple[bool, dict[int, set[bytes]]]:
    """(listed by ListSessions, tier -> blocks from QueryResidency) for one session."""
    listed = ctx.stub.ListSessions(pb.ListSessionsRequest(session_id_prefix=session), timeout=ctx.timeout).sessions
    blocks = ctx.residency(H.session_selector(session))
    return (any(i.session_id == session for i in listed), {t: {b.block_hash for b in blocks if t in b.tiers} for t in TIERS})


def register(reg: Registry) -> None:
    @reg.case(
        "events", "follower-agrees-after-release",
        "A follower built from WatchEvents (START_SNAPSHOT, then events) MUST agree with QueryResidency and "
        "ListSessions session by session and tier by tier; after an ACCEPTED RELEASE of a whole session the stream "
        "MUST carry a MembershipChanged naming the session and the blocks it left, so the follower drops it too.",
        requires=("release:session",),
        needs=("traffic",),
    )
    def after_release(ctx: CaseContext) -> None:
        watch = ctx.watch(START(start=START.START_SNAPSHOT, heartbeat_interval=HEARTBEAT_200MS))
        watch.wait_for(lambda ms: any(m.HasField("snapshot_end") for m in ms), 20, "SnapshotEnd")
        released, kept = ctx.sid("rel"), ctx.sid("kept")
        ctx.complete(ctx.small_prompt("rel", blocks=3), released)
        ctx.complete(ctx.small_prompt("kept", blocks=3), kept)
        held = set(ctx.device_hashes(H.session_selector(released)))
        check(bool(held), "the session holds no device blocks after its request")
        result = ctx.apply_one(H.release(released))
        check(result.outcome == pb.OUTCOME_ACCEPTED, f"release of a resident session: {H.describe(result)}, expected ACCEPTED")
        target = ctx.latest_sequence()
        watch.wait_sequence(target)
        messages = watch.stop()
        follower = follow(messages)

        left = [m.membership_changed for m in messages if m.HasField("membership_changed")
                and m.membership_changed.session_id == released]
        check(bool(left), "no MembershipChanged for the released session")
        check(held <= set(left[-1].block_hashes),
              f"MembershipChanged lists {len(left[-1].block_hashes)} blocks; {len(held - set(left[-1].block_hashes))} "
              "of the session's device blocks are missing")
        for name, session in (("released", released), ("kept", kept)):
            listed, by_tier = server_view(ctx, session)
            followed = follower.sessions("target")
            check((session in followed) == listed,
                  f"{name} session: ListSessions {'lists' if listed else 'omits'} it, the follower "
                  f"{'has' if session in followed else 'lacks'} it")
            for tier in TIERS:
                mine = set(follower.session_blocks(session, "target", tier=tier))
                check(mine == by_tier[tier],
                      f"{name} session on {pb.Tier.Name(tier)}: QueryResidency reports {len(by_tier[tier])} blocks, "
                      f"the follower {len(mine)}")
        check(follower.engines_for_session(released) == [], "the follower still routes the released session to the engine")
        check(follower.engines_for_session(kept) != [], "the follower lost the session that was not released")
