"""Release and Evict: their effect on the cache, seen through requests and QueryResidency."""

from __future__ import annotations

import concurrent.futures
import time

import grpc

from kvhint.v1 import kvhint_pb2 as pb

from .. import hints as H
from ..model import CaseFailed, Registry, check
from ..target import CaseContext, check_result_form
from .outcomes import resident_selection
from .retention import hit


# evict/skips-blocks-in-use: the running request's decode length. Long enough for the Evicts fired
# every 5 ms to reach the engine while it runs (its blocks fill and are cached as it decodes: 8
# blocks of 32 tokens), and for a retry to cover a client stalled on a loaded machine. Decoding up
# to max_model_len instead (about 950 tokens, twice) took 30 of the suite's 74 s on the hybrid
# preset on a 2-core CPU, where every served test engine runs the suite.
RUNNING_DECODE_TOKENS = 256


def register(reg: Registry) -> None:
    @reg.case(
        "release", "released-blocks-still-reusable",
        "RELEASE MUST NOT free blocks by itself: a released session's prefix MUST still be hit until something needs "
        "the room.",
        requires=("release:session",),
        needs=("cached-tokens",),
    )
    def reusable(ctx: CaseContext) -> None:
        prompt = ctx.session_prompt("r")
        ctx.complete(prompt, ctx.sid("r"))
        result = ctx.apply_one(H.release(ctx.sid("r")))
        check(result.outcome == pb.OUTCOME_ACCEPTED, f"release of a resident session: {H.describe(result)}, expected ACCEPTED")
        got = hit(ctx, prompt, ctx.sid("r"))
        check(got == ctx.full_hit, f"right after release the session hit {got} of {ctx.full_hit} tokens")

    @reg.case(
        "release", "released-session-evicted-first",
        "A released session's blocks MUST be the first candidates for eviction: the next allocation that needs room "
        "MUST take them before blocks of an older, unhinted session.",
        requires=("release:session",),
        needs=("pressure",),
    )
    def first(ctx: CaseContext) -> None:
        ctx.pressure("before")  # the pool holds only fillers, all older than the sessions below
        older, released = ctx.session_prompt("older"), ctx.session_prompt("released")
        ctx.complete(older, ctx.sid("older"))
        ctx.complete(released, ctx.sid("released"))
        older_hashes = ctx.device_hashes(H.session_selector(ctx.sid("older")))
        released_hashes = ctx.device_hashes(H.session_selector(ctx.sid("released")))
        result = ctx.apply_one(H.release(ctx.sid("released")))
        check(result.outcome == pb.OUTCOME_ACCEPTED, f"release: {H.describe(result)}, expected ACCEPTED")
        ctx.pressure("one", count=1)  # one session's worth of room
        on_device = set(ctx.device_hashes(H.hashes_selector(older_hashes + released_hashes)))
        gone = [h for h in released_hashes if h in on_device]
        kept = [h for h in older_hashes if h in on_device]
        check(not gone, f"{len(gone)} of the released session's {len(released_hashes)} blocks are still on the device tier "
              "after one prompt's worth of pressure")
        check(len(kept) == len(older_hashes),
              f"the older unhinted session kept {len(kept)} of {len(older_hashes)} device blocks: it was evicted before the released one")
        if not ctx.lower_tiers:  # a lower tier may serve the released prefix again
            got = hit(ctx, released, ctx.sid("released"))
            check(got == 0, f"the released session still hit {got} tokens after one prompt's worth of pressure")
        got = hit(ctx, older, ctx.sid("older"))
        check(got == ctx.full_hit, f"the older unhinted session hit {got} of {ctx.full_hit} tokens")

    @reg.case(
        "release", "session-release-ends-its-continuations-grants",
        "RELEASE of a whole session MUST also drop the retention held by its continuations that leave with it: no "
        "block MUST stay retained for a continuation that no selector resolves any more.",
        requires=("retain:continuation", "release:session"),
        needs=("traffic",),
    )
    def continuation_grants(ctx: CaseContext) -> None:
        session, continuation = ctx.sid("turns"), ctx.cid("turns")
        ctx.complete(ctx.small_prompt("turns"), session, continuation_id=continuation)
        selector = H.continuation_selector(continuation)
        hashes = ctx.device_hashes(selector)
        check(bool(hashes), "the continuation selects no device block after its request")
        result = ctx.apply_one(H.hint(selector, "retain", priority=5, ttl=60))
        check(result.outcome == pb.OUTCOME_ACCEPTED, f"retain by continuation: {H.describe(result)}, expected ACCEPTED")
        result = ctx.apply_one(H.release(session))
        check(result.outcome == pb.OUTCOME_ACCEPTED, f"release of the session: {H.describe(result)}, expected ACCEPTED")
        ordinary = (pb.RetentionState.CLASS_ORDINARY, pb.RetentionState.CLASS_UNSPECIFIED)
        held = [b for b in ctx.residency(H.hashes_selector(hashes)) if b.retention.retention_class not in ordinary]
        check(not held, f"{len(held)} of the session's {len(hashes)} blocks are still "
              f"{pb.RetentionState.Class.Name(held[0].retention.retention_class) if held else ''} after the session's "
              "release, held for its continuation")

    @reg.case(
        "evict", "frees-selected-blocks",
        "EVICT MUST free the selected cached blocks now: QueryResidency MUST stop reporting them on the device tier "
        "and a repeat of the prompt MUST NOT hit them.",
        requires=("evict:session",),
        needs=("cached-tokens",),
    )
    def frees(ctx: CaseContext) -> None:
        sel, n, prompt, session = resident_selection(ctx, "session")
        hashes = ctx.device_hashes(sel)
        result = ctx.apply_one(H.evict(session))
        check(result.outcome == pb.OUTCOME_ACCEPTED and H.device_blocks(result) == n, f"evict: {H.describe(result)}, expected ACCEPTED with {n} blocks")
        still = [b for b in ctx.residency(H.hashes_selector(hashes)) if pb.TIER_DEVICE in b.tiers]
        check(not still, f"{len(still)} evicted blocks are still reported on the device tier")
        if not ctx.lower_tiers:
            got = hit(ctx, prompt, session)
            check(got == 0, f"after evict, a repeat hit {got} tokens")

    @reg.case(
        "evict", "removes-block-from-every-session",
        "Evicting a block MUST remove it from every session it belongs to: identical content stored by two sessions "
        "MUST be gone for both after one of them is evicted.",
        requires=("evict:session",),
        needs=("cached-tokens",),
    )
    def every_session(ctx: CaseContext) -> None:
        prompt = ctx.small_prompt("shared")
        ctx.complete(prompt, ctx.sid("a"))
        ctx.complete(prompt, ctx.sid("b"))
        result = ctx.apply_one(H.evict(ctx.sid("a")))
        check(result.outcome == pb.OUTCOME_ACCEPTED, f"evict: {H.describe(result)}")
        left = ctx.device_hashes(H.session_selector(ctx.sid("b")))
        check(not left, f"session b still has {len(left)} device blocks after the shared blocks were evicted via a")
        if not ctx.lower_tiers:
            got = hit(ctx, prompt, ctx.sid("b"))
            check(got == 0, f"session b still hit {got} tokens of the evicted shared content")

    @reg.case(
        "evict", "skips-blocks-pinned-by-other-session",
        "EVICT MUST skip blocks pinned by another session and report CLIPPED with REASON_PINNED_BY_OTHER_SESSION; the "
        "pinning session MUST keep its prefix.",
        requires=("evict:session", "pin:session"),
        needs=("cached-tokens",),
    )
    def pinned_by_other(ctx: CaseContext) -> None:
        prompt = ctx.small_prompt("shared")
        n = 3
        ctx.complete(prompt, ctx.sid("owner"))
        ctx.complete(prompt, ctx.sid("other"))  # a full hit: both sessions hold the same blocks
        ctx.apply_one(H.pin(ctx.sid("owner"), ttl=60))
        result = ctx.apply_one(H.evict(ctx.sid("other")))
        check(
            result.outcome == pb.OUTCOME_CLIPPED and result.reason == pb.REASON_PINNED_BY_OTHER_SESSION,
            f"evict of blocks another session pinned: {H.describe(result)}, expected CLIPPED/PINNED_BY_OTHER_SESSION",
        )
        check(H.device_blocks(result) == 0, f"evict reports {H.device_blocks(result)} blocks evicted; all {n} are pinned by another session")
        got = hit(ctx, prompt, ctx.sid("owner"))
        check(got == n * ctx.plan.block_size, f"the pinning session hit {got} of {n * ctx.plan.block_size} tokens after the evict")

    @reg.case(
        "evict", "skips-blocks-in-use",
        "EVICT MUST skip blocks in use by a running request and report CLIPPED with REASON_BLOCKS_IN_USE; the running "
        "request MUST complete with the tokens it would have produced undisturbed.",
        requires=("evict:session",),
        needs=("traffic",),
    )
    def in_use(ctx: CaseContext) -> None:
        bs = ctx.plan.block_size
        prompt = ctx.tokens("running", 2 * bs)
        max_tokens = max(16, min(RUNNING_DECODE_TOKENS, ctx.target.options.max_model_len - len(prompt) - 8))
        extra = {"ignore_eos": True}
        first = ctx.complete(prompt, ctx.sid("reference"), max_tokens=max_tokens, extra_body=extra)
        reference = (tuple(first.token_ids), first.text)
        previous = ctx.sid("reference")
        attempts: list[str] = []
        found = False  # an Evict found the request's blocks (ACCEPTED with device blocks)
        deadline = time.monotonic() + 60
        for attempt in range(12):
            if attempt >= 3 and time.monotonic() > deadline:
                break
            ctx.apply_one(H.evict(previous))  # so the running request computes its prompt too
            session = previous = ctx.sid(f"running-{attempt}")
            # Evicts are fired without waiting for each answer: an engine busy decoding may answer late,
            # but each is applied (and its outcome fixed) at the step boundary it reached.
            pending: list[grpc.Future] = []
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                running = pool.submit(ctx.complete, prompt, session, max_tokens=max_tokens, extra_body=extra)
                while not running.done() and len(pending) < 400:
                    pending.append(ctx.stub.ApplyHints.future(pb.ApplyHintsRequest(hints=[H.evict(session)]), timeout=ctx.timeout))
                    time.sleep(0.005)
                output = running.result()
            answers: list[tuple[int, int, pb.HintResult]] = []  # (applied_at_sequence, send order, result)
            for n, future in enumerate(pending):
                try:
                    response = future.result()
                except grpc.RpcError as err:
                    raise CaseFailed(f"ApplyHints failed: {err.code().name}: {err.details()}") from err
                check_result_form(response.results[0], f"Evict #{n} of the running request's session")
                answers.append((response.applied_at_sequence, n, response.results[0]))
            evicted_in_use = accepted_while_running(answers)
            if evicted_in_use is not None:
                accepted, later = evicted_in_use
                raise CaseFailed(
                    f"evict of a running request's blocks: {H.describe(accepted)}: ACCEPTED while a request used the blocks; "
                    f"expected CLIPPED with BLOCKS_IN_USE (an Evict the target applied after it found the session's blocks "
                    f"again, {H.describe(later)}: the request was still running and storing blocks)"
                )
            results = [r for _, _, r in answers]
            seen = [H.outcome_name(r.outcome) for r in results]
            found |= any(r.outcome == pb.OUTCOME_ACCEPTED and H.device_blocks(r) for r in results)
            clipped = next((r for r in results if r.outcome == pb.OUTCOME_CLIPPED), None)
            if clipped is None:
                # No evict found the blocks in use (a loaded machine stalls the client): again.
                attempts.append("/".join(dict.fromkeys(seen)))
                continue
            check(clipped.reason == pb.REASON_BLOCKS_IN_USE,
                  f"evict of a running request's blocks: {H.describe(clipped)}, expected CLIPPED/BLOCKS_IN_USE")
            clips = [c for c in clipped.clips if c.reason == pb.REASON_BLOCKS_IN_USE]
            check(clips and clips[0].granted_blocks == H.device_blocks(clipped),
                  f"BLOCKS_IN_USE clip granted {[c.granted_blocks for c in clips]}, affected {H.device_blocks(clipped)}")
            check((tuple(output.token_ids), output.text) == reference,
                  "the running request produced different tokens than the same request undisturbed")
            return
        if found:
            raise CaseFailed(
                f"no EVICT was answered CLIPPED/BLOCKS_IN_USE while a {max_tokens}-token request ran, in {len(attempts)} "
                f"attempts (outcomes seen: {attempts}): every Evict that found the request's blocks was ACCEPTED. That is "
                "the answer once the request has ended; if the target answered it while the request used the blocks, "
                "that is the violation (expected CLIPPED with BLOCKS_IN_USE), which the suite cannot tell here because no "
                "later Evict found new blocks of the request. If the target does keep blocks in use, the client may be "
                "starved of CPU (its Evicts reached the target only after the request ended)"
            )
        raise CaseFailed(f"no EVICT was applied while a {max_tokens}-token request ran, in {len(attempts)} attempts "
                         f"(outcomes seen: {attempts}); the client may be starved of CPU")


def accepted_while_running(answers: list[tuple[int, int, pb.HintResult]]) -> tuple[pb.HintResult, pb.HintResult] | None:
    """(an ACCEPTED Evict, a later one) proving that the ACCEPTED one evicted blocks a running request
    used, or None. `answers` are the Evicts of the running request's session as (applied_at_sequence,
    send order, result).

    In the order the target applied them (applied_at_sequence: each Evict publishes a HintApplied, so
    the sequences differ; send order breaks ties), an ACCEPTED Evict that removed device blocks and
    is followed by one that again finds device blocks of the session (CLIPPED, or ACCEPTED with
    device blocks). The session is this request's alone, so blocks were stored after the ACCEPTED
    one: the request was still running, and every session block the ACCEPTED one removed was in use
    by it (a running request holds all of its blocks). Once the request has ended an ACCEPTED Evict
    removes all of the session's device blocks and nothing stores more, and before the request
    allocates an Evict finds nothing (MISSING), so a correct target never shows this order."""
    evicted: pb.HintResult | None = None
    for _sequence, _order, result in sorted(answers, key=lambda a: (a[0], a[1])):
        found = result.outcome == pb.OUTCOME_CLIPPED or (result.outcome == pb.OUTCOME_ACCEPTED and H.device_blocks(result) > 0)
        if evicted is not None and found:
            return evicted, result
        if result.outcome == pb.OUTCOME_ACCEPTED and H.device_blocks(result) > 0:
            evicted = result
    return None
