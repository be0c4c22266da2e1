"""Requirements of the target that the suite cannot negotiate. These cases fail when the target
is not set up so that the rest of the suite can test it (see README "Requirements")."""

from __future__ import annotations

from ..model import CaseFailed, Registry
from ..target import CaseContext


# The `requirements/*` case that checks each need (conformance.runner.select runs it whenever a
# selected case has the need, so a filtered run cannot pass by skipping everything).
CASE_OF_NEED = {"traffic": "token-id-prompts", "cached-tokens": "cached-tokens-reported", "pressure": "pressure-feasible"}


def register(reg: Registry) -> None:
    for need, name, statement in (
        ("traffic", "token-id-prompts",
         "The target's OpenAI-compatible /v1/completions endpoint MUST accept prompts given as token ids with an "
         "X-Session-ID header and report usage.prompt_tokens."),
        ("cached-tokens", "cached-tokens-reported",
         "The endpoint MUST report usage.prompt_tokens_details.cached_tokens, and a repeated prompt MUST hit its full "
         "blocks in the prefix cache."),
        ("pressure", "pressure-feasible",
         "The device pool (plus any bounded lower tier) MUST be small enough that --max-pressure-prompts session-sized "
         "prompts overflow it, and no lower tier of unknown capacity may keep evicted blocks."),
    ):
        assert CASE_OF_NEED[need] == name
        _requirement(reg, need, name, statement)


def _requirement(reg: Registry, need: str, name: str, statement: str) -> None:
    @reg.case("requirements", name, statement)
    def requirement(ctx: CaseContext) -> None:
        ok, reason = ctx.target.need(need)
        if not ok:
            raise CaseFailed(f"requirement not met: {reason}")
        if need == "pressure":
            ctx.note(ctx.plan.summary())
