"""Raw kvhint.v1 message builders used by the cases.

The suite builds wire messages itself (not through the typed client) so it controls every
field: hints without ids, malformed selectors, out-of-range TTLs.
"""

from __future__ import annotations

from kvhint.v1 import kvhint_pb2 as pb

ACTIONS = ("retain", "pin", "release", "evict", "demote", "prefetch", "share")
SELECTORS = ("session", "continuation", "block-hashes")

ACTION_ENUM = {
    "retain": pb.ACTION_RETAIN,
    "pin": pb.ACTION_PIN,
    "release": pb.ACTION_RELEASE,
    "evict": pb.ACTION_EVICT,
    "demote": pb.ACTION_DEMOTE,
    "prefetch": pb.ACTION_PREFETCH,
    "share": pb.ACTION_SHARE,
}
ACTION_NAME = {v: k for k, v in ACTION_ENUM.items()}
SELECTOR_ENUM = {
    "session": pb.SELECTOR_KIND_SESSION,
    "continuation": pb.SELECTOR_KIND_CONTINUATION,
    "block-hashes": pb.SELECTOR_KIND_BLOCK_HASHES,
}
SELECTOR_NAME = {v: k for k, v in SELECTOR_ENUM.items()}
TIER_NAME = {pb.TIER_DEVICE: "device", pb.TIER_HOST: "host", pb.TIER_DISK: "disk", pb.TIER_REMOTE: "remote"}


def session_selector(session_id: str, **kw: object) -> pb.Selector:
    rng = kw.pop("range", None)
    sel = pb.Selector(session=pb.SessionSelector(session_id=session_id, **kw))  # type: ignore[arg-type]
    if rng is not None:
        sel.range.CopyFrom(rng)  # type: ignore[arg-type]
    return sel


def continuation_selector(continuation_id: str) -> pb.Selector:
    return pb.Selector(continuation=pb.ContinuationSelector(continuation_id=continuation_id))


def hashes_selector(hashes: list[bytes]) -> pb.Selector:
    return pb.Selector(block_hashes=pb.BlockHashSelector(block_hashes=list(hashes)))


def block_range(start: int, end: int | None = None) -> pb.BlockRange:
    r = pb.BlockRange(start=start)
    if end is not None:
        r.end = end
    return r


def hint(selector: pb.Selector, action: str, *, hint_id: str = "", max_blocks: int = 0, ttl: float = 60,
         priority: int = 0, destination: str = "", target_tier: int = 0) -> pb.Hint:
    h = pb.Hint(hint_id=hint_id, selector=selector, max_blocks=max_blocks)
    if action == "retain":
        h.retain.priority = priority
        h.retain.ttl.FromNanoseconds(int(ttl * 1e9))
    elif action == "pin":
        h.pin.ttl.FromNanoseconds(int(ttl * 1e9))
    elif action == "release":
        h.release.SetInParent()
    elif action == "evict":
        h.evict.SetInParent()
    elif action == "demote":
        h.demote.SetInParent()
        if target_tier:
            h.demote.target_tier = target_tier  # type: ignore[assignment]
    elif action == "prefetch":
        h.prefetch.SetInParent()
    elif action == "share":
        h.share.destination = destination
    else:  # pragma: no cover
        raise ValueError(action)
    return h


def pin(session_id: str, ttl: float = 60, **kw: object) -> pb.Hint:
    return hint(session_selector(session_id), "pin", ttl=ttl, **kw)  # type: ignore[arg-type]


def retain(session_id: str, priority: int = 0, ttl: float = 60, **kw: object) -> pb.Hint:
    return hint(session_selector(session_id), "retain", priority=priority, ttl=ttl, **kw)  # type: ignore[arg-type]


def release(session_id: str, **kw: object) -> pb.Hint:
    return hint(session_selector(session_id), "release", **kw)  # type: ignore[arg-type]


def evict(session_id: str, **kw: object) -> pb.Hint:
    return hint(session_selector(session_id), "evict", **kw)  # type: ignore[arg-type]


def outcome_name(value: int) -> str:
    if value not in pb.Outcome.values():
        return str(value)
    return pb.Outcome.Name(value).removeprefix("OUTCOME_")  # type: ignore[arg-type]


def reason_name(value: int) -> str:
    if value not in pb.Reason.values():
        return str(value)
    return pb.Reason.Name(value).removeprefix("REASON_")  # type: ignore[arg-type]


def describe(result: pb.HintResult) -> str:
    """One-line view of a result for failure messages."""
    text = outcome_name(result.outcome)
    if result.reason:
        text += f"/{reason_name(result.reason)}"
    device = sum(c.blocks for c in result.affected_blocks if c.tier == pb.TIER_DEVICE)
    if device:
        text += f" ({device} device blocks)"
    if result.replayed:
        text += " replayed"
    if result.message:
        text += f" {result.message!r}"
    return text


def device_blocks(result: pb.HintResult) -> int:
    return sum(c.blocks for c in result.affected_blocks if c.tier == pb.TIER_DEVICE)


def tier_counts_text(counts: object, limit: int = 6) -> str:
    """A TierBlockCount list as `[DEVICE:3, HOST:1]` (a long one cut after `limit` entries), for
    failure messages."""
    names = []
    for c in counts:  # type: ignore[attr-defined]
        tier = pb.Tier.Name(c.tier).removeprefix("TIER_") if c.tier in pb.Tier.values() else str(c.tier)
        names.append(f"{tier}:{c.blocks}")
    if len(names) > limit:
        names = names[: limit - 1] + [f"... {len(names)} entries"]
    return "[" + ", ".join(names) + "]"


def result_form_problems(result: pb.HintResult) -> list[str]:
    """What in `result` breaks the form every HintResult keeps, whatever the hint:

    * affected_blocks (TierBlockCount): at most one entry per tier, in Tier order, never
      TIER_UNSPECIFIED, tiers with no blocks left out (`blocks` is always > 0);
    * reason: REASON_UNSPECIFIED for ACCEPTED and DEFERRED (HintResult.reason).

    Empty when the result keeps it."""
    problems: list[str] = []
    tiers = [c.tier for c in result.affected_blocks]
    affected: list[str] = []
    if any(c.blocks == 0 for c in result.affected_blocks):
        affected.append("an entry with 0 blocks (TierBlockCount.blocks is always > 0: a tier with no blocks is left out)")
    if pb.TIER_UNSPECIFIED in tiers:
        affected.append("an entry for TIER_UNSPECIFIED")
    if len(set(tiers)) != len(tiers):
        affected.append("several entries for one tier (at most one entry per tier)")
    elif tiers != sorted(tiers):
        affected.append("its entries out of Tier order")
    if affected:
        problems.append(f"affected_blocks {tier_counts_text(result.affected_blocks)} has " + " and ".join(affected))
    if result.outcome in (pb.OUTCOME_ACCEPTED, pb.OUTCOME_DEFERRED) and result.reason != pb.REASON_UNSPECIFIED:
        problems.append(f"{outcome_name(result.outcome)} with reason {reason_name(result.reason)} (HintResult.reason is "
                        "REASON_UNSPECIFIED for ACCEPTED and DEFERRED)")
    return problems
