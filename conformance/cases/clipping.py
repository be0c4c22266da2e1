"""Clipping: the TTL cap, the pin budget and max_blocks."""

from __future__ import annotations

import time

from kvhint.v1 import kvhint_pb2 as pb

from .. import hints as H
from ..model import CaseSkipped, Registry, check
from ..target import CaseContext, check_result_form
from .outcomes import resident_selection


def _seconds(d: object) -> float:
    return d.seconds + d.nanos / 1e9  # type: ignore[attr-defined]


def _a(action: str) -> str:
    return "An" if action[0] in "aeiou" else "A"


def register(reg: Registry) -> None:
    for action in ("retain", "pin"):
        _ttl_cap(reg, action)
    for action in ("retain", "pin", "release", "evict"):
        _max_blocks(reg, action)

    @reg.case(
        "clipping", "ttl-at-cap-not-clipped",
        "A PIN whose TTL equals limits.max_ttl MUST be ACCEPTED, not CLIPPED.",
        requires=("pin:session",),
        needs=("traffic",),
    )
    def at_cap(ctx: CaseContext) -> None:
        sel, _n, _p, _s = resident_selection(ctx, "session")
        cap = _seconds(ctx.caps.limits.max_ttl)
        result = ctx.apply_one(H.hint(sel, "pin", ttl=cap))
        check(result.outcome == pb.OUTCOME_ACCEPTED, f"pin with ttl == max_ttl ({cap:g}s): {H.describe(result)}, expected ACCEPTED")
        check_result_form(result, f"pin with ttl == max_ttl ({cap:g}s)")

    @reg.case(
        "clipping", "pin-budget",
        "Pins MUST NOT exceed limits.pin_budget_blocks: a PIN that would go over the budget MUST be CLIPPED with "
        "REASON_PIN_BUDGET, pin only the blocks that fit (Clip.granted_blocks, affected_blocks; fewer only after a "
        "REASON_WINDOW_TAIL_MISSING clip), and the blocks reported pinned (QueryResidency) MUST be the blocks granted, "
        "never more than the budget.",
        requires=("pin:session",),
        needs=("traffic",),
    )
    def pin_budget(ctx: CaseContext) -> None:
        plan = ctx.plan
        budget = plan.pin_budget
        if budget == 0:
            raise CaseSkipped("pin_budget_blocks is 0")
        per = plan.session_resident  # what a pin of one session takes from the budget
        sessions = budget // per + 1
        if sessions * per > plan.device_blocks - 2:
            raise CaseSkipped(
                f"exceeding a budget of {budget} blocks takes {sessions} sessions of {per} blocks, more than the "
                f"{plan.device_blocks}-block pool holds at once"
            )
        need = plan.cached_together(sessions)
        if need > plan.device_blocks - 2:
            raise CaseSkipped(
                f"exceeding a budget of {budget} blocks takes {sessions} sessions of {per} blocks; cached together "
                f"with the last one's prefill they need {need} device blocks (over every KV-cache group), more than "
                f"the {plan.device_blocks}-block pool holds"
            )
        names = [ctx.sid(f"b{i}") for i in range(sessions)]
        for i, name in enumerate(names):
            ctx.complete(ctx.session_prompt(f"b{i}"), name)
        pinned = 0
        clipped = None
        for i, name in enumerate(names):
            result = ctx.apply_one(H.pin(name, ttl=60))
            check_result_form(result, f"pin #{i + 1} of {per} blocks")
            granted = H.device_blocks(result)
            fits = budget - pinned
            if per <= fits:
                check(
                    result.outcome == pb.OUTCOME_ACCEPTED and granted == per,
                    f"pin #{i + 1} of {per} blocks with {fits} of {budget} budget blocks left: {H.describe(result)}, "
                    "expected ACCEPTED (is something else holding pins?)",
                )
            else:
                check(
                    result.outcome == pb.OUTCOME_CLIPPED and result.reason == pb.REASON_PIN_BUDGET,
                    f"pin #{i + 1} of {per} blocks with {fits} of {budget} budget blocks left: {H.describe(result)}, "
                    "expected CLIPPED/PIN_BUDGET",
                )
                clips = [c for c in result.clips if c.reason == pb.REASON_PIN_BUDGET]
                check(clips, "CLIPPED/PIN_BUDGET without a PIN_BUDGET Clip")
                check(
                    clips[0].requested_blocks == per and clips[0].granted_blocks == fits,
                    f"PIN_BUDGET clip requested={clips[0].requested_blocks} granted={clips[0].granted_blocks}, "
                    f"expected requested={per} granted={fits}",
                )
                expected = _after_window_tail_clip(ctx, result, fits)
                check(granted == expected, f"affected_blocks reports {granted} device blocks pinned, expected {expected}")
                clipped = result
            pinned += granted
        check(clipped is not None, f"{sessions * per} blocks pinned against a budget of {budget} without a clip")
        total = 0
        for name in names:
            total += sum(
                1 for b in ctx.residency(H.session_selector(name)) if b.retention.retention_class == pb.RetentionState.CLASS_PINNED
            )
        check(total == pinned, f"QueryResidency reports {total} pinned blocks; the pins granted {pinned} (budget {budget})")

    @reg.case(
        "clipping", "clipped-pin-grants-a-resumable-prefix",
        "A PIN clipped by max_blocks MUST grant only blocks a resume can hit: after pressure that evicts an unhinted "
        "control session, a two-turn session's repeat MUST hit exactly the blocks the PIN granted (affected_blocks). "
        "On an engine with sliding-window KV-cache groups the blocks kept after the last prefix end whose window "
        "blocks the engine holds MUST be dropped with a REASON_WINDOW_TAIL_MISSING clip after the MAX_BLOCKS one.",
        requires=("pin:session",),
        needs=("pressure",),
    )
    def clipped_resumable(ctx: CaseContext) -> None:
        plan = ctx.plan
        bs, n = plan.block_size, plan.session_blocks
        if plan.resident_tail:
            raise CaseSkipped("every residency group slides: a session's resident blocks are its prompt's window tail")
        if n < 4:
            raise CaseSkipped(f"a session prompt of {n} blocks leaves no room for a turn inside a clip")
        name = ctx.sid("clipped")
        prompt, control = ctx.session_prompt("clipped"), ctx.session_prompt("control")
        ctx.complete(control, ctx.sid("control"))
        ctx.complete(prompt[: (n // 2) * bs + max(1, bs // 2)], name)  # turn 1: a prefix of turn 2
        ctx.complete(prompt, name)
        cap = n - 1
        result = ctx.apply_one(H.pin(name, ttl=120, max_blocks=cap))
        granted = H.device_blocks(result)
        check(
            result.outcome == pb.OUTCOME_CLIPPED and result.reason == pb.REASON_MAX_BLOCKS
            and result.clips[0].requested_blocks == n and result.clips[0].granted_blocks == cap,
            f"pin of {n} blocks with max_blocks={cap}: {H.describe(result)}, expected CLIPPED/MAX_BLOCKS to {cap}",
        )
        expected = _after_window_tail_clip(ctx, result, cap)
        check(granted == expected, f"affected_blocks reports {granted} device blocks pinned, expected {expected}")
        ctx.pressure("clipped")
        if ctx.lower_tiers:
            # A lower tier can serve a repeat, so the device is asked what it kept instead.
            def on_device(session: str) -> int:
                return sum(1 for b in ctx.residency(H.session_selector(session)) if pb.TIER_DEVICE in b.tiers)

            kept, lost = on_device(name), on_device(ctx.sid("control"))
            check(kept == granted, f"the device holds {kept} of the clipped session's blocks after pressure; the pin "
                                   f"granted {granted}")
            check(lost == 0, f"the device still holds {lost} blocks of the unhinted control: the pressure did not evict it")
        else:
            got = ctx.complete(prompt, name).cached_tokens
            check(got == granted * bs, f"the clipped session's repeat hit {got} tokens after pressure; the pin granted "
                                       f"{granted} blocks ({granted * bs} tokens)")
            lost = ctx.complete(control, ctx.sid("control")).cached_tokens
            check(lost == 0, f"the unhinted control session still hit {lost} tokens: the pressure did not evict it")
        ctx.apply(H.release(name))

    @reg.case(
        "clipping", "pin-budget-freed-by-release",
        "Releasing a session's pins MUST return their blocks to the pin budget: after a Release, a PIN that fits the "
        "freed budget MUST be ACCEPTED.",
        requires=("pin:session", "release:session"),
        needs=("traffic",),
    )
    def budget_freed(ctx: CaseContext) -> None:
        plan = ctx.plan
        per = plan.session_resident  # what a pin of one session takes from the budget
        sessions = plan.pin_budget // per
        if sessions < 1 or sessions * per + per > plan.device_blocks - 2 or plan.cached_together(sessions + 1) > plan.device_blocks - 2:
            raise CaseSkipped(
                f"the pin budget ({plan.pin_budget}) and pool ({plan.device_blocks}) do not allow the setup: "
                f"{sessions + 1} sessions of {per} blocks cached at once need {plan.cached_together(sessions + 1)} device blocks"
            )
        names = [ctx.sid(f"f{i}") for i in range(sessions + 1)]
        for i, name in enumerate(names):
            ctx.complete(ctx.session_prompt(f"f{i}"), name)
        for name in names[:-1]:
            ctx.apply_one(H.pin(name, ttl=60))
        full = ctx.apply_one(H.pin(names[-1], ttl=60))
        left = plan.pin_budget - sessions * per
        if left < per:
            check(full.outcome == pb.OUTCOME_CLIPPED, f"pin beyond the budget: {H.describe(full)}, expected CLIPPED")
        ctx.apply(H.release(names[-1]), H.release(names[0]))
        ctx.complete(ctx.session_prompt(f"f{sessions}"), names[-1])  # a hit: the session is known again
        again = ctx.apply_one(H.pin(names[-1], ttl=60))
        check(
            again.outcome == pb.OUTCOME_ACCEPTED and H.device_blocks(again) == per,
            f"pin after releasing {per} pinned blocks: {H.describe(again)}, expected ACCEPTED with {per} blocks",
        )


def _after_window_tail_clip(ctx: CaseContext, result: pb.HintResult, kept: int) -> int:
    """The blocks a Retain or Pin applies to after a block clip that kept `kept`: with
    sliding-window groups the kept blocks may hold no prefix end a resume can hit, and are then
    dropped too, in a WINDOW_TAIL_MISSING clip after the budget's (checked here); else `kept`."""
    tails = [c for c in result.clips if c.reason == pb.REASON_WINDOW_TAIL_MISSING]
    if not tails:
        return kept
    check(
        any(g.kind == pb.KvCacheGroup.KIND_SLIDING_WINDOW for g in ctx.caps.kv_cache_groups),
        "a WINDOW_TAIL_MISSING clip from an engine that lists no sliding-window KV-cache group",
    )
    check(
        tails[0].requested_blocks == kept and tails[0].granted_blocks < kept,
        f"WINDOW_TAIL_MISSING clip requested={tails[0].requested_blocks} granted={tails[0].granted_blocks}, "
        f"expected requested={kept} and fewer granted",
    )
    return tails[0].granted_blocks


def _ttl_cap(reg: Registry, action: str) -> None:
    @reg.case(
        "clipping", f"{action}-ttl-capped",
        f"{_a(action)} {action.upper()} whose TTL exceeds limits.max_ttl MUST be applied with the TTL capped at max_ttl and "
        "reported CLIPPED with REASON_TTL_CAPPED, effective_ttl = max_ttl and a Clip naming the requested and granted "
        "TTL; the protection QueryResidency reports MUST expire no later than max_ttl from now.",
        requires=(f"{action}:session",),
        needs=("traffic",),
    )
    def ttl_capped(ctx: CaseContext) -> None:
        sel, _n, _p, session = resident_selection(ctx, "session")
        cap = _seconds(ctx.caps.limits.max_ttl)
        asked = cap * 2 + 60
        before = time.time()
        result = ctx.apply_one(H.hint(sel, action, ttl=asked, priority=4))
        check(
            result.outcome == pb.OUTCOME_CLIPPED and result.reason == pb.REASON_TTL_CAPPED,
            f"{action} with ttl {asked:g}s over max_ttl {cap:g}s: {H.describe(result)}, expected CLIPPED/TTL_CAPPED",
        )
        check_result_form(result, f"{action} with ttl {asked:g}s over max_ttl {cap:g}s")
        check(abs(_seconds(result.effective_ttl) - cap) < 1e-3, f"effective_ttl={_seconds(result.effective_ttl):g}s, expected {cap:g}s")
        clips = [c for c in result.clips if c.reason == pb.REASON_TTL_CAPPED]
        check(clips, "CLIPPED/TTL_CAPPED without a TTL_CAPPED Clip")
        check(
            abs(_seconds(clips[0].requested_ttl) - asked) < 1e-3 and abs(_seconds(clips[0].granted_ttl) - cap) < 1e-3,
            f"TTL clip requested={_seconds(clips[0].requested_ttl):g}s granted={_seconds(clips[0].granted_ttl):g}s, "
            f"expected {asked:g}s / {cap:g}s",
        )
        blocks = ctx.residency(H.session_selector(session))
        expected_class = pb.RetentionState.CLASS_PINNED if action == "pin" else pb.RetentionState.CLASS_RETAINED
        check(
            blocks and all(b.retention.retention_class == expected_class for b in blocks),
            f"after the clipped {action}, QueryResidency classes are "
            f"{sorted({pb.RetentionState.Class.Name(b.retention.retention_class) for b in blocks})}",
        )
        endless = [b.position for b in blocks if not b.retention.HasField("expires_at")]
        check(not endless, f"after the clipped {action}, QueryResidency reports no expires_at for the blocks at positions "
                           f"{endless[:5]}: their protection has no end")
        latest = max(b.retention.expires_at.seconds for b in blocks)
        check(
            latest <= before + cap + 5,
            f"the {action} expires {latest - before:.0f}s from now; max_ttl is {cap:g}s",
        )


def _max_blocks(reg: Registry, action: str) -> None:
    head = action in ("retain", "pin")
    @reg.case(
        "clipping", f"{action}-max-blocks",
        f"{_a(action)} {action.upper()} with max_blocks smaller than its selection MUST be CLIPPED with REASON_MAX_BLOCKS "
        "(requested and granted block counts in the Clip) and apply to the "
        + ("first blocks of the chain." if head else "last blocks of the chain."),
        requires=(f"{action}:session",),
        needs=("traffic",),
    )
    def max_blocks(ctx: CaseContext) -> None:
        # Four blocks, or fewer when a sliding window's cached tail is shorter (Plan.window_tail):
        # the evict variant's repeat must be able to hit the prefix left before the evicted tail.
        tail = ctx.plan.window_tail
        sel, n, prompt, session = resident_selection(ctx, "session", blocks=max(2, min(4, tail)) if tail else 4)
        if action == "release":
            ctx.apply_one(H.hint(sel, "pin", ttl=30))
        result = ctx.apply_one(H.hint(sel, action, max_blocks=1, ttl=30, priority=2))
        check(
            result.outcome == pb.OUTCOME_CLIPPED and result.reason == pb.REASON_MAX_BLOCKS,
            f"{action} of {n} blocks with max_blocks=1: {H.describe(result)}, expected CLIPPED/MAX_BLOCKS",
        )
        check_result_form(result, f"{action} of {n} blocks with max_blocks=1")
        clips = [c for c in result.clips if c.reason == pb.REASON_MAX_BLOCKS]
        check(clips and clips[0].requested_blocks == n and clips[0].granted_blocks == 1,
              f"MAX_BLOCKS clip: {[(c.requested_blocks, c.granted_blocks) for c in clips]}, expected requested={n} granted=1")
        blocks = ctx.residency(H.session_selector(session))
        if action in ("retain", "pin"):
            protected = [b.position for b in blocks if b.retention.retention_class != pb.RetentionState.CLASS_ORDINARY
                         and b.retention.retention_class != pb.RetentionState.CLASS_UNSPECIFIED]
            check(protected == [0], f"{action} with max_blocks=1 protected positions {protected}, expected [0]")
        elif action == "release":
            pinned = [b.position for b in blocks if b.retention.retention_class == pb.RetentionState.CLASS_PINNED]
            check(pinned == list(range(n - 1)), f"release with max_blocks=1 left positions {pinned} pinned, expected {list(range(n - 1))}")
        else:
            resident = [b.position for b in blocks if pb.TIER_DEVICE in b.tiers]
            check(resident == list(range(n - 1)), f"evict with max_blocks=1 left positions {resident} resident, expected {list(range(n - 1))}")
            hit = ctx.complete(prompt, session).cached_tokens
            expected = (n - 1) * ctx.plan.block_size
            if tail and n > tail:
                # A window of one block: no shorter prefix has its window tail cached.
                check(hit < n * ctx.plan.block_size, f"after evicting the last block, a repeat hit {hit} tokens, expected fewer than {n * ctx.plan.block_size}")
            else:
                check(ctx.lower_tiers or hit == expected, f"after evicting the last block, a repeat hit {hit} tokens, expected {expected}")
