"""Selectors: continuation chains, identity vs content, child sessions and ranges."""

from __future__ import annotations

from kvhint.v1 import kvhint_pb2 as pb

from .. import hints as H
from ..model import CaseSkipped, Registry, check
from ..target import CaseContext


def register(reg: Registry) -> None:
    @reg.case(
        "selectors", "continuation-resolves-prefix-chain",
        "A continuation selector MUST resolve to the prefix chain ending where that continuation's request ended: "
        "an earlier turn's continuation MUST select exactly the leading blocks of a later turn's chain.",
        requires=("selector:continuation",),
        needs=("traffic",),
    )
    def continuation(ctx: CaseContext) -> None:
        bs = ctx.plan.block_size
        turn1 = ctx.tokens("turn1", 3 * bs)
        turn2 = turn1 + ctx.tokens("turn2", 3 * bs + 5)
        session = ctx.sid("chat")
        ctx.complete(turn1 + [ctx.target.options.token_low], session, continuation_id=ctx.cid("t1"))
        ctx.complete(turn2, session, continuation_id=ctx.cid("t2"))
        first = ctx.residency(H.continuation_selector(ctx.cid("t1")))
        second = ctx.residency(H.continuation_selector(ctx.cid("t2")))
        check(len(first) == 3, f"the first turn's continuation selects {len(first)} blocks, expected 3")
        check(len(second) == 6, f"the second turn's continuation selects {len(second)} blocks, expected 6")
        check([b.block_hash for b in first] == [b.block_hash for b in second[:3]],
              "the first turn's chain is not the leading part of the second turn's chain")
        check([b.position for b in second] == list(range(6)), f"positions {[b.position for b in second]}")

    @reg.case(
        "selectors", "identical-content-shared-across-sessions",
        "Session identity MUST NOT enter cache identity: identical content sent under another session MUST hit the "
        "cache in full, and both sessions MUST resolve to the same blocks.",
        needs=("cached-tokens",),
    )
    def shared(ctx: CaseContext) -> None:
        prompt = ctx.small_prompt("same", 4)
        ctx.complete(prompt, ctx.sid("a"))
        other = ctx.complete(prompt, ctx.sid("b"))
        check(other.cached_tokens == 4 * ctx.plan.block_size,
              f"the same prompt under another session hit {other.cached_tokens} tokens, expected {4 * ctx.plan.block_size}")
        a = ctx.device_hashes(H.session_selector(ctx.sid("a")))
        b = ctx.device_hashes(H.session_selector(ctx.sid("b")))
        check(a == b and len(a) == 4, f"sessions resolve to different blocks ({len(a)} vs {len(b)}, equal={a == b})")

    @reg.case(
        "selectors", "include-children-selects-child-sessions",
        "A session selector with include_children MUST also select the blocks of sessions whose requests named it "
        "as parent_session_id; without it, only the session's own blocks.",
        needs=("traffic",),
    )
    def children(ctx: CaseContext) -> None:
        bs = ctx.plan.block_size
        parent_prompt = ctx.tokens("parent", 3 * bs + 3)
        parent, child = ctx.sid("parent"), ctx.sid("child")
        ctx.complete(parent_prompt, parent)
        ctx.complete(parent_prompt[: 3 * bs] + ctx.tokens("child", 3 * bs + 3), child, parent_session_id=parent)
        alone = ctx.residency(H.session_selector(parent))
        both = ctx.residency(H.session_selector(parent, include_children=True))
        check(len(alone) == 3, f"the parent alone selects {len(alone)} blocks, expected 3")
        check(len({b.block_hash for b in both}) == 6, f"with include_children the parent selects {len({b.block_hash for b in both})} blocks, expected 6")
        infos = ctx.stub.ListSessions(pb.ListSessionsRequest(session_id_prefix=child), timeout=ctx.timeout).sessions
        check(infos and infos[0].parent_session_id == parent, f"ListSessions reports parent {infos[0].parent_session_id if infos else None!r} for the child")

    @reg.case(
        "selectors", "range-narrows-positions",
        "A BlockRange on a selector MUST narrow the action to the half-open range of chain positions [start, end).",
        requires=("pin:session", "pin:range"),
        needs=("traffic",),
    )
    def narrows(ctx: CaseContext) -> None:
        session = ctx.sid("ranged")
        ctx.complete(ctx.small_prompt("ranged", 5), session)
        result = ctx.apply_one(H.hint(H.session_selector(session, range=H.block_range(1, 3)), "pin", ttl=30))
        check(result.outcome == pb.OUTCOME_ACCEPTED and H.device_blocks(result) == 2,
              f"pin of range [1, 3): {H.describe(result)}, expected ACCEPTED with 2 blocks")
        pinned = [b.position for b in ctx.residency(H.session_selector(session)) if b.retention.retention_class == pb.RetentionState.CLASS_PINNED]
        check(pinned == [1, 2], f"positions pinned: {pinned}, expected [1, 2]")
        tail = ctx.apply_one(H.hint(H.session_selector(session, range=H.block_range(3)), "pin", ttl=30))
        check(H.device_blocks(tail) == 2, f"pin of range [3, end) of 5 blocks: {H.describe(tail)}, expected 2 blocks")

    @reg.case(
        "selectors", "range-unadvertised-unsupported",
        "A hint with a BlockRange for an action whose ActionSupport.supports_range is false MUST get REJECTED with "
        "REASON_UNSUPPORTED, before its selector is resolved: never MISSING.",
    )
    def range_unsupported(ctx: CaseContext) -> None:
        have = ctx.target.capabilities
        targets = [a for a in H.ACTIONS if f"{a}:session" in have and f"{a}:range" not in have]
        if not targets:
            raise CaseSkipped("every action that takes a session selector advertises supports_range")
        destination = (list(ctx.caps.share_destinations) or ["x"])[0]
        batch = [H.hint(H.session_selector(ctx.sid("r"), range=H.block_range(0, 1)), a, ttl=5, destination=destination) for a in targets]
        for action, result in zip(targets, ctx.apply(*batch)):
            check(result.outcome == pb.OUTCOME_REJECTED and result.reason == pb.REASON_UNSUPPORTED,
                  f"{action} with a range (supports_range=false): {H.describe(result)}, expected REJECTED/UNSUPPORTED"
                  + (": a hint rejected for its form (INVALID_HINT, UNSUPPORTED) is rejected before its selector is "
                     "resolved, so it is never MISSING, whether or not the session exists"
                     if result.outcome == pb.OUTCOME_MISSING else ""))
