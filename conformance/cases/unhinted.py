"""Zero effect on unhinted traffic: the same tokens and the same prefix hits with hints in
place and without them, and the stock (least recently used first) eviction order under pressure."""

from __future__ import annotations

import math

from .. import hints as H
from ..model import Registry, check
from ..target import CaseContext
from .retention import half_session_overflow


def register(reg: Registry) -> None:
    @reg.case(
        "unhinted", "same-tokens-with-hints-on-and-off",
        "Hints on other sessions MUST NOT change unhinted traffic: a greedy workload without hints MUST produce the "
        "same tokens and the same cached-token counts while pins and retention are held, and after they are "
        "released and evicted, as before any hint.",
        requires=("pin:session", "retain:session", "release:session", "evict:session"),
        needs=("cached-tokens",),
    )
    def same_tokens(ctx: CaseContext) -> None:
        bs = ctx.plan.block_size
        base = ctx.tokens("base", 4 * bs + 5)
        workload = [
            (base, None),
            (base + ctx.tokens("branch-1", 2 * bs + 3), None),  # shares base's prefix
            (ctx.tokens("solo", 3 * bs + 7), None),
            (base + ctx.tokens("branch-2", bs + 9), ctx.sid("plain")),  # a session that never gets hints
        ]

        def run() -> list[tuple[tuple[tuple[int, ...], str], int]]:
            out = []
            for prompt, session in workload:
                c = ctx.complete(prompt, session, max_tokens=16)
                out.append(((tuple(c.token_ids), c.text), c.cached_tokens))
            return out

        run()  # first pass stores the workload's prefixes
        without = run()
        hinted = {n: ctx.small_prompt(n, 4) for n in ("h1", "h2", "h3")}
        for name, prompt in hinted.items():
            ctx.complete(prompt, ctx.sid(name))
        ctx.apply(H.pin(ctx.sid("h1"), ttl=60), H.retain(ctx.sid("h2"), priority=7, ttl=60), H.retain(ctx.sid("h3"), priority=-3))
        held = run()
        ctx.apply(H.release(ctx.sid("h1")), H.release(ctx.sid("h2")), H.evict(ctx.sid("h3")))
        after = run()
        for label, got in (("while hints are held", held), ("after release/evict", after)):
            for i, ((tokens, cached), (want_tokens, want_cached)) in enumerate(zip(got, without)):
                check(tokens == want_tokens, f"unhinted request {i} generated different tokens {label}")
                check(cached == want_cached, f"unhinted request {i} hit {cached} cached tokens {label}, {want_cached} without hints")

    @reg.case(
        "unhinted", "lru-order-under-pressure",
        "Without hints, eviction under pressure MUST keep the stock least-recently-used order: when a prompt needs "
        "about half a session more than the pool's other free blocks, the least recently used of three unhinted "
        "sessions MUST lose blocks of its prefix while the two used after it (one of them stored first and used "
        "again) MUST keep their whole prefix.",
        needs=("pressure",),
    )
    def lru_order(ctx: CaseContext) -> None:
        per = ctx.plan.session_blocks
        filler_blocks, filler_tokens = half_session_overflow(ctx)
        names = ("first", "second", "third")
        prompts = {n: ctx.session_prompt(n) for n in names}
        for n in names:  # stored in this order ...
            ctx.complete(prompts[n], ctx.sid(n))
        again = ctx.complete(prompts["first"], ctx.sid("first")).cached_tokens  # ... then `first` is used again
        check(again == ctx.full_hit, f"an immediate repeat hit {again} of {ctx.full_hit} tokens")
        # Recency now: second (least recent), third, first. Admission order would evict `first`.
        ctx.pressure("lru", count=1, tokens=filler_tokens)
        first, third = (ctx.complete(prompts[n], ctx.sid(n)).cached_tokens for n in ("first", "third"))
        second = ctx.complete(prompts["second"], ctx.sid("second")).cached_tokens
        check(first == ctx.full_hit and third == ctx.full_hit,
              f"the sessions used after the least recent one hit {first} (stored first, used again) and {third} of "
              f"{ctx.full_hit} tokens after a {filler_blocks}-block prompt (the least recent hit {second}): the eviction "
              "order is not least recently used first")
        if ctx.lower_tiers:  # its evicted blocks may be hit from a lower tier
            ctx.note(f"lower tiers: the least recent session hit {second} tokens; not checked")
            return
        check(second < ctx.full_hit, f"the least recently used session kept all {second} tokens although a "
                                     f"{filler_blocks}-block prompt needed ~{math.ceil(per / 2)} of its blocks")
