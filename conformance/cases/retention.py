"""Retention effect, observed the way a user sees it: `cached_tokens` when a session resumes
after cache pressure (filler prompts without a session, sized from GetCapabilities)."""

from __future__ import annotations

import concurrent.futures
import math
import time
from collections.abc import Sequence

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_client.openai_traffic import Completion

from .. import hints as H
from ..model import CaseSkipped, Registry, check
from ..target import CaseContext
from .outcomes import wait_operation

PRESSURE = ("pressure",)


def hit(ctx: CaseContext, prompt: list[int], session: str) -> int:
    return ctx.complete(prompt, session).cached_tokens


def kept(ctx: CaseContext, prompts: dict[str, list[int]], order: Sequence[str]) -> dict[str, int]:
    """How much of each session's prefix the device kept through pressure, in tokens, compared
    with ctx.full_hit. Without lower tiers: the hit of a repeat, in `order` (a repeat is
    pressure of its own). With lower tiers a repeat may be served from them, so the device is
    asked instead (QueryResidency, every session before any repeat): full_hit when all the
    session prompt's blocks are on the device, fewer tokens otherwise."""
    if not ctx.lower_tiers:
        return {n: hit(ctx, prompts[n], ctx.sid(n)) for n in order}
    out = {}
    for n in order:
        on_device = sum(1 for b in ctx.residency(H.session_selector(ctx.sid(n))) if pb.TIER_DEVICE in b.tiers)
        out[n] = ctx.full_hit if on_device >= ctx.plan.session_resident else min(on_device * ctx.plan.block_size, ctx.full_hit - 1)
    return out


def kept_through_pressure(ctx: CaseContext, label: str, kept: list[int], session: str, control: list[int]) -> None:
    """Apply pressure; the hinted session must keep its whole prefix, the unhinted control must lose it."""
    ctx.pressure(label)
    got = hit(ctx, kept, session)
    check(got == ctx.full_hit, f"the {label} session hit {got} of {ctx.full_hit} tokens after pressure")
    lost = hit(ctx, control, ctx.sid("control"))
    check(lost == 0, f"the unhinted control session still hit {lost} tokens: the pressure did not evict it")


def honouring_tier(ctx: CaseContext) -> pb.TierInfo:
    """The first lower tier that advertises TierInfo.honours_retention; skips the case without one
    (honouring retention is optional: a tier that keeps its own order says so)."""
    for tier in ctx.caps.tiers:
        if tier.tier != pb.TIER_DEVICE and tier.honours_retention:
            return tier
    raise CaseSkipped("no lower tier advertises honours_retention")


def half_session_overflow(ctx: CaseContext) -> tuple[int, int]:
    """(blocks, tokens) of one filler prompt that, with three session prompts cached, needs every
    other free block plus about half a session: exactly one session must lose blocks."""
    plan = ctx.plan
    bs, per = plan.block_size, plan.session_blocks
    filler_blocks = plan.overflow_filler(3)
    max_blocks = (ctx.target.options.max_model_len - 1) // bs
    if filler_blocks < 2 or filler_blocks > max_blocks:
        raise CaseSkipped(f"a filler of {filler_blocks} blocks is needed (at most {max_blocks} fit max_model_len)")
    return filler_blocks, (filler_blocks - 1) * bs + max(1, bs // 2)


def pin_to_budget(ctx: CaseContext, tag: str) -> tuple[list[str], int]:
    """Store and pin sessions until the pin budget is used up. Returns the session ids and the
    device blocks the pins' results report. (A session holds Plan.session_resident blocks: fewer
    than its prompt's on a sliding-window-only engine, so more sessions fill the budget there.)"""
    plan = ctx.plan
    count = math.ceil(plan.pin_budget / plan.session_resident)
    names = [ctx.sid(f"{tag}{i}") for i in range(count)]
    for i, name in enumerate(names):
        ctx.complete(ctx.session_prompt(f"{tag}{i}"), name)
    results = ctx.apply(*(H.pin(n, ttl=120) for n in names))
    return names, sum(H.device_blocks(r) for r in results)


def overflow_prompts(ctx: CaseContext, tag: str, max_tokens: int = 16) -> list[list[int]]:
    """With the pin budget in use: long prompts that, run at the same time, need more blocks
    than the unpinned pool, though fewer than the whole pool."""
    plan = ctx.plan
    bs = plan.block_size
    each = math.ceil((plan.long_prompt_tokens + max_tokens) / bs)
    unpinned = plan.device_blocks - 1 - plan.pin_budget
    n = unpinned // each + 1
    if n * each > plan.device_blocks - 1:
        raise CaseSkipped(
            f"{n} concurrent prompts of {each} blocks exceed the unpinned pool ({unpinned} blocks) only by also "
            f"exceeding the whole pool ({plan.device_blocks} blocks); raise max_model_len or the pin budget"
        )
    return [ctx.tokens(f"{tag}-long-{i}", plan.long_prompt_tokens) for i in range(n)]


def concurrent_overflow(ctx: CaseContext, tag: str, max_tokens: int = 16) -> tuple[list[list[int]], list[Completion]]:
    """overflow_prompts, each its own request, sent from concurrent threads (so each result has
    its tokens and usage). Whether they overlap in the engine depends on the threads' timing;
    batched_overflow does not. Returns (prompts, completions)."""
    prompts = overflow_prompts(ctx, tag, max_tokens)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        outputs = list(pool.map(lambda p: ctx.complete(p, max_tokens=max_tokens), prompts))
    return prompts, outputs


def batched_overflow(ctx: CaseContext, tag: str, max_tokens: int = 16) -> list[list[int]]:
    """overflow_prompts in one request (the completions API's list of prompts): the server hands
    them to the engine together, so they run at the same time however the client is scheduled.
    Returns the prompts."""
    prompts = overflow_prompts(ctx, tag, max_tokens)
    ctx.complete_batch(prompts, max_tokens=max_tokens)
    return prompts


#: Candidates asked for at the first differing token: the other run's token must be among the
#: unpinned run's best TIE_CANDIDATES, within the tie tolerance of the best.
TIE_CANDIDATES = 5


def first_divergence_is_a_tie(ctx: CaseContext, prompt: list[int], tokens: tuple[int, ...], tie_nats: float,
                              max_tokens: int = 16) -> str | None:
    """None when `tokens` (a greedy completion of `prompt` run under other conditions) first differs
    from an unpinned greedy run at a numerical tie; otherwise what differs.

    The unpinned run is repeated with its top candidates' logprobs and token ids. Where the two
    first differ, the other run's token must be one of those candidates, no more than `tie_nats`
    below the best: batching changes float rounding, which decides between candidates that close
    (Options.tie_nats: a few ulps of the logits in the engine's compute dtype)."""
    ref = ctx.complete(prompt, max_tokens=max_tokens,
                       extra_body={"logprobs": TIE_CANDIDATES, "return_tokens_as_token_ids": True})
    d = next((k for k, (a, b) in enumerate(zip(ref.token_ids, tokens)) if a != b), None)
    if d is None:
        if len(ref.token_ids) == len(tokens):
            return None  # the unpinned run itself varies, and this time it agrees
        return f"{len(tokens)} tokens against {len(ref.token_ids)} unpinned"
    if d >= len(ref.top_logprobs) or len(ref.top_logprobs[d]) < 2 or d >= len(ref.top_token_ids):
        return f"first differs at token {d}; the engine reported no top-2 logprobs there"
    logprobs, ids = ref.top_logprobs[d], ref.top_token_ids[d]
    if tokens[d] not in ids:
        return (f"first differs at token {d}: {tokens[d]} is not among the unpinned run's {len(ids)} best candidates "
                f"{list(ids)}")
    gap = logprobs[0] - logprobs[ids.index(tokens[d])]
    if gap <= tie_nats:
        return None
    return (f"first differs at token {d}, where the unpinned run ranks token {tokens[d]} {gap:.4g} nats below its "
            f"best, more than the {tie_nats:.4g}-nat tie tolerance")


def register(reg: Registry) -> None:
    @reg.case(
        "retention", "pinned-session-survives-pressure",
        "A session pinned with PIN MUST keep its prefix cached through pressure that evicts an unhinted control "
        "session stored just before it: the pinned session's repeat MUST hit its whole prefix, and the control's "
        "MUST NOT hit.",
        requires=("pin:session",),
        needs=PRESSURE,
    )
    def pinned(ctx: CaseContext) -> None:
        control, kept = ctx.session_prompt("control"), ctx.session_prompt("pinned")
        ctx.complete(control, ctx.sid("control"))
        ctx.complete(kept, ctx.sid("pinned"))
        result = ctx.apply_one(H.pin(ctx.sid("pinned"), ttl=120))
        check(
            result.outcome == pb.OUTCOME_ACCEPTED and H.device_blocks(result) == ctx.plan.session_resident,
            f"pin of a session of {ctx.plan.session_resident} resident blocks: {H.describe(result)}",
        )
        kept_through_pressure(ctx, "pinned", kept, ctx.sid("pinned"), control)

    @reg.case(
        "retention", "retained-session-survives-pressure",
        "A session retained with RETAIN MUST keep its prefix cached through pressure that evicts an unhinted control "
        "session stored just before it, while ordinary blocks can serve the load.",
        requires=("retain:session",),
        needs=PRESSURE,
    )
    def retained(ctx: CaseContext) -> None:
        control, kept = ctx.session_prompt("control"), ctx.session_prompt("kept")
        ctx.complete(control, ctx.sid("control"))
        ctx.complete(kept, ctx.sid("kept"))
        result = ctx.apply_one(H.retain(ctx.sid("kept"), priority=5, ttl=120))
        check(result.outcome == pb.OUTCOME_ACCEPTED, f"retain: {H.describe(result)}")
        kept_through_pressure(ctx, "retained", kept, ctx.sid("kept"), control)

    @reg.case(
        "retention", "retained-session-kept-by-honouring-tier",
        "On a lower tier that advertises honours_retention, a retained session demoted off the device MUST keep a "
        "copy of every block on the device or that tier through pressure that pushes an unhinted control session "
        "stored before it out of the tier; its blocks MUST still be reported RETAINED (the grant outlives the device "
        "copy while the tier holds one), and its repeat MUST hit its whole prefix.",
        requires=("retain:session", "demote:session"),
        needs=PRESSURE,
    )
    def honoured(ctx: CaseContext) -> None:
        tier = honouring_tier(ctx)
        name = H.TIER_NAME.get(tier.tier, str(tier.tier))
        control, kept = ctx.session_prompt("control"), ctx.session_prompt("kept")
        ctx.complete(control, ctx.sid("control"))
        ctx.complete(kept, ctx.sid("kept"))
        result = ctx.apply_one(H.retain(ctx.sid("kept"), priority=5, ttl=120))
        check(result.outcome == pb.OUTCOME_ACCEPTED, f"retain: {H.describe(result)}")
        demoted = ctx.apply_one(H.hint(H.session_selector(ctx.sid("kept")), "demote", target_tier=tier.tier))
        check(demoted.outcome == pb.OUTCOME_DEFERRED and demoted.operation_id, f"demote to the {name} tier: {H.describe(demoted)}")
        op = wait_operation(ctx, demoted.operation_id)
        check(op.state == pb.Operation.STATE_SUCCEEDED, f"demote operation ended {pb.Operation.State.Name(op.state)} "
              f"({H.reason_name(op.reason)}: {op.message})")
        ctx.pressure("honoured")
        blocks = ctx.residency(H.session_selector(ctx.sid("kept")))
        check(len(blocks) == ctx.plan.session_resident,
              f"QueryResidency reports {len(blocks)} blocks of the retained session, expected {ctx.plan.session_resident}")
        lost = [b.position for b in blocks if pb.TIER_DEVICE not in b.tiers and tier.tier not in b.tiers]
        check(not lost, f"blocks at positions {lost} of the retained session have no copy on the device or the {name} tier")
        classes = sorted({pb.RetentionState.Class.Name(b.retention.retention_class) for b in blocks})
        check(classes == ["CLASS_RETAINED"], f"the retained session's blocks are reported {classes} after pressure")
        left = [b.position for b in ctx.residency(H.session_selector(ctx.sid("control"))) if tier.tier in b.tiers]
        check(not left, f"the unhinted control keeps {len(left)} blocks on the {name} tier: the pressure did not reach it")
        got = hit(ctx, kept, ctx.sid("kept"))
        check(got == ctx.full_hit, f"the retained session hit {got} of {ctx.full_hit} tokens after pressure")

    @reg.case(
        "retention", "lower-priority-evicted-first",
        "When retained blocks must be evicted, blocks of the lowest retain priority MUST go first, even when that "
        "session is the most recently used: the higher-priority sessions MUST keep their whole prefix.",
        requires=("retain:session",),
        needs=PRESSURE,
    )
    def priority(ctx: CaseContext) -> None:
        per = ctx.plan.session_blocks
        filler_blocks, filler_tokens = half_session_overflow(ctx)
        names = ("high", "mid", "low")  # oldest first: plain LRU would evict `high` first
        prompts = {n: ctx.session_prompt(n) for n in names}
        for n in names:
            ctx.complete(prompts[n], ctx.sid(n))
        ctx.apply(H.retain(ctx.sid("high"), 9, 120), H.retain(ctx.sid("mid"), 5, 120), H.retain(ctx.sid("low"), 1, 120))
        # About half a session more than the ordinary blocks: only `low` may lose blocks.
        ctx.pressure("priority", count=1, tokens=filler_tokens)
        got = kept(ctx, prompts, ("high", "mid", "low"))
        high, mid, low = got["high"], got["mid"], got["low"]
        check(low < ctx.full_hit, f"the lowest-priority session kept all {low} tokens; a {filler_blocks}-block prompt needed "
              f"~{math.ceil(per / 2)} retained blocks")
        check(high == ctx.full_hit and mid == ctx.full_hit,
              f"priority 9 hit {high}, priority 5 hit {mid} of {ctx.full_hit} tokens (priority 1 hit {low}): a higher "
              "priority lost blocks")

    @reg.case(
        "retention", "released-session-loses-protection",
        "After RELEASE, a previously pinned session MUST lose its protection: pressure MUST evict it like an "
        "unhinted session.",
        requires=("pin:session", "release:session"),
        needs=PRESSURE,
    )
    def released(ctx: CaseContext) -> None:
        prompt = ctx.session_prompt("was-pinned")
        ctx.complete(prompt, ctx.sid("was-pinned"))
        ctx.apply_one(H.pin(ctx.sid("was-pinned"), ttl=120))
        result = ctx.apply_one(H.release(ctx.sid("was-pinned")))
        check(result.outcome == pb.OUTCOME_ACCEPTED, f"release of a pinned session: {H.describe(result)}, expected ACCEPTED")
        ctx.pressure("released")
        got = hit(ctx, prompt, ctx.sid("was-pinned"))
        check(got == 0, f"the released session still hit {got} tokens after pressure")

    @reg.case(
        "retention", "expired-pin-is-ordinary",
        "A pin whose TTL has passed MUST no longer protect its blocks: QueryResidency MUST NOT report them pinned, "
        "and pressure MUST evict them.",
        requires=("pin:session",),
        needs=PRESSURE,
    )
    def expired(ctx: CaseContext) -> None:
        session = ctx.sid("short")
        prompt = ctx.session_prompt("short")
        ctx.complete(prompt, session)
        result = ctx.apply_one(H.pin(session, ttl=1))
        check(result.outcome == pb.OUTCOME_ACCEPTED, f"pin with ttl 1s: {H.describe(result)}")
        time.sleep(1.5)
        classes = {b.retention.retention_class for b in ctx.residency(H.session_selector(session))}
        check(pb.RetentionState.CLASS_PINNED not in classes, "QueryResidency reports blocks pinned 1.5s after a 1s pin")
        ctx.pressure("expired")
        got = hit(ctx, prompt, session)
        check(got == 0, f"the session whose pin expired still hit {got} tokens after pressure")

    @reg.case(
        "retention", "pins-never-fail-allocations",
        "Pins MUST NOT fail a request the engine could serve without them: with the whole pin budget in use, "
        "concurrent requests that need more than the unpinned pool MUST all complete, with the same greedy tokens "
        "as when nothing is pinned, up to a numerical tie: where the two first differ, the pinned run's token MUST "
        "be among the unpinned run's best candidates, within --tie-nats of the best (batching changes float rounding, "
        "which decides ties).",
        requires=("pin:session", "release:session"),
        needs=PRESSURE,
    )
    def never_fail(ctx: CaseContext) -> None:
        names, _pinned = pin_to_budget(ctx, "p")
        prompts, outputs = concurrent_overflow(ctx, "never-fail")
        ctx.apply(*(H.release(n) for n in names))
        for i, (prompt, out) in enumerate(zip(prompts, outputs)):
            check(out.prompt_tokens == len(prompt), f"request {i}: usage.prompt_tokens={out.prompt_tokens}")
        # Same prompts again, nothing pinned, after pressure evicted them: both runs compute the prompt.
        ctx.pressure("never-fail")
        for i, prompt in enumerate(prompts):
            again = ctx.complete(prompt, max_tokens=16)
            if (tuple(again.token_ids), again.text) == (tuple(outputs[i].token_ids), outputs[i].text):
                continue
            tie = first_divergence_is_a_tie(ctx, prompt, outputs[i].token_ids, ctx.target.options.tie_nats)
            check(tie is None, f"request {i} generated different tokens under pin pressure than without pins: {tie}")
