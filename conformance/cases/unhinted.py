"""Zero effect on unhinted traffic: the same tokens and the same prefix hits with hints in
place and without them."""

from __future__ import annotations

from .. import hints as H
from ..model import Registry, check
from ..target import CaseContext


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
