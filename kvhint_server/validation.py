"""Wire validation and bounds: kvhint.v1 messages -> validated domain values.

Request-level problems raise RpcError (INVALID_ARGUMENT + ErrorInfo). A
problem with one hint becomes that hint's REJECTED result; the rest of the
batch proceeds. TTLs above the cap are granted at the cap (the executor
reports CLIPPED/TTL_CAPPED).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf import duration_pb2

from kvhint.v1 import kvhint_pb2 as pb

from .config import ServerConfig
from .errors import excerpt, invalid_argument
from .model import Action, EngineInfo, HintResult, HintSpec, Reason, Selector, SelectorKind, Tier, parse_enum

MAX_BLOCK_HASH_BYTES = 64
_ACTION_OF_FIELD = {
    "retain": Action.RETAIN,
    "pin": Action.PIN,
    "release": Action.RELEASE,
    "evict": Action.EVICT,
    "demote": Action.DEMOTE,
    "prefetch": Action.PREFETCH,
    "share": Action.SHARE,
}
_KIND_OF_FIELD = {
    "session": SelectorKind.SESSION,
    "continuation": SelectorKind.CONTINUATION,
    "block_hashes": SelectorKind.BLOCK_HASHES,
}


class HintInvalid(Exception):
    """A hint (or a query's selector) that cannot be applied. `field`: the path of the field at
    fault, relative to the message parse_* was given ("" when it is the message itself)."""

    def __init__(self, reason: Reason, message: str, field: str = "") -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.field = field


# google.protobuf.Duration's valid range: +-10,000 years.
MAX_DURATION_SECONDS = 315_576_000_000


def duration_seconds(d: duration_pb2.Duration) -> float:
    """Seconds of a Duration; invalid encodings raise HintInvalid."""
    if (
        not -999_999_999 <= d.nanos <= 999_999_999
        or not -MAX_DURATION_SECONDS <= d.seconds <= MAX_DURATION_SECONDS
        or (d.seconds > 0 and d.nanos < 0)
        or (d.seconds < 0 and d.nanos > 0)
    ):
        raise HintInvalid(Reason.INVALID_HINT, "malformed google.protobuf.Duration (see its documented range)")
    return d.seconds + d.nanos / 1e9


def _id_problem(value: str, what: str, limit: int, required: bool = True) -> str | None:
    """Why `value` is not a valid id of at most `limit` UTF-8 bytes (None: it is)."""
    if not value:
        return f"{what} must not be empty" if required else None
    if len(value.encode("utf-8")) > limit:
        return f"{what} is longer than {limit} bytes"
    return None


def _check_id(value: str, what: str, limit: int, field: str = "") -> str:
    problem = _id_problem(value, what, limit)
    if problem:
        raise HintInvalid(Reason.INVALID_HINT, problem, field)
    return value


def check_request_id(value: str, field: str, limit: int, required: bool = True) -> str:
    """A request-level id (GetOperation.operation_id, a session prefix, a
    filter's session id): INVALID_ARGUMENT naming `field` when it is empty
    (if required) or longer than `limit` UTF-8 bytes."""
    problem = _id_problem(value, field, limit, required)
    if problem:
        raise invalid_argument(problem, field)
    return value


def parse_selector(sel: pb.Selector, config: ServerConfig) -> Selector:
    """A wire Selector -> Selector; problems raise HintInvalid."""
    target = sel.WhichOneof("target")
    if target is None:
        raise HintInvalid(Reason.INVALID_HINT, "selector has no target (session, continuation or block_hashes)")
    kind = _KIND_OF_FIELD[target]
    range_start, range_end = 0, None
    if sel.HasField("range"):
        if kind is SelectorKind.BLOCK_HASHES:
            raise HintInvalid(Reason.INVALID_HINT, "range cannot narrow a block_hashes selector", "range")
        range_start = sel.range.start
        if sel.range.HasField("end"):
            range_end = sel.range.end
            if range_end <= range_start:
                raise HintInvalid(Reason.INVALID_HINT, f"range end {range_end} must be greater than start {range_start}", "range.end")
    if kind is SelectorKind.SESSION:
        return Selector(
            kind,
            session_id=_check_id(sel.session.session_id, "session_id", config.max_id_length, "session.session_id"),
            include_children=sel.session.include_children,
            range_start=range_start,
            range_end=range_end,
        )
    if kind is SelectorKind.CONTINUATION:
        return Selector(
            kind,
            continuation_id=_check_id(sel.continuation.continuation_id, "continuation_id", config.max_id_length,
                                      "continuation.continuation_id"),
            range_start=range_start,
            range_end=range_end,
        )
    hashes = list(sel.block_hashes.block_hashes)
    if not hashes:
        raise HintInvalid(Reason.INVALID_HINT, "block_hashes selector needs at least one hash", "block_hashes.block_hashes")
    if len(hashes) > config.max_block_hashes_per_selector:
        raise HintInvalid(
            Reason.INVALID_HINT, f"{len(hashes)} block hashes exceed the limit of {config.max_block_hashes_per_selector}",
            "block_hashes.block_hashes",
        )
    for i, h in enumerate(hashes):
        if not 1 <= len(h) <= MAX_BLOCK_HASH_BYTES:
            raise HintInvalid(Reason.INVALID_HINT, f"block hash of {len(h)} bytes; expected 1..{MAX_BLOCK_HASH_BYTES}",
                              f"block_hashes.block_hashes[{i}]")
    return Selector(kind, block_hashes=tuple(dict.fromkeys(hashes)))


def hint_fingerprint(hint: pb.Hint) -> bytes:
    """A hint's canonical content, which its hint_id is bound to: the Hint
    without its id, serialized deterministically (valid or not)."""
    content = pb.Hint()
    content.CopyFrom(hint)
    content.hint_id = ""
    return content.SerializeToString(deterministic=True)


def hint_id_bindable(hint_id: str, config: ServerConfig) -> bool:
    """Whether an id takes part in idempotency: non-empty and within
    max_hint_id_length (an over-long id is rejected and never remembered)."""
    return bool(hint_id) and len(hint_id.encode("utf-8")) <= config.max_hint_id_length


@dataclass(frozen=True, slots=True)
class ParsedHint:
    """One hint of a batch: the wire message as received (published in its
    HintApplied event, and fingerprinted for its hint_id) and exactly one of
    its validated spec or its rejection."""

    wire: pb.Hint
    spec: HintSpec | None
    rejection: HintResult | None

    @property
    def hint_id(self) -> str:
        return self.wire.hint_id

    @property
    def item(self) -> HintSpec | HintResult:
        return self.spec if self.spec is not None else self.rejection  # type: ignore[return-value]


def parse_hints(hints: Sequence[pb.Hint], config: ServerConfig, info: EngineInfo) -> list[ParsedHint]:
    """Every hint of a batch, parsed; per-hint problems become rejections, never exceptions."""
    out = []
    for hint in hints:
        item = parse_hint(hint, config, info)
        out.append(ParsedHint(hint, item, None) if isinstance(item, HintSpec) else ParsedHint(hint, None, item))
    return out


def parse_hint(hint: pb.Hint, config: ServerConfig, info: EngineInfo) -> HintSpec | HintResult:
    """A wire Hint -> HintSpec, or a REJECTED result."""
    hint_id = hint.hint_id
    try:
        if len(hint_id.encode("utf-8")) > config.max_hint_id_length:
            raise HintInvalid(Reason.INVALID_HINT, f"hint_id is longer than {config.max_hint_id_length} bytes")
        field = hint.WhichOneof("action")
        if field is None:
            raise HintInvalid(Reason.INVALID_HINT, "hint has no action")
        action = _ACTION_OF_FIELD[field]
        if not hint.HasField("selector"):
            raise HintInvalid(Reason.INVALID_HINT, "hint has no selector")
        selector = parse_selector(hint.selector, config)
        support = info.supports(action, selector.kind)
        if support is None:
            raise HintInvalid(
                Reason.UNSUPPORTED, f"{action.name} with a {selector.kind.name.lower()} selector is not supported"
            )
        if selector.has_range and not support.supports_range:
            raise HintInvalid(Reason.UNSUPPORTED, f"{action.name} does not support a block range")
        spec = _bounds(hint, action, selector, config, info)
        if spec.expected_reuse_s is not None and not support.supports_expected_reuse:
            raise HintInvalid(Reason.UNSUPPORTED, f"{action.name} does not support expected_reuse_in")
    except HintInvalid as exc:
        return HintResult.rejected(hint_id, exc.reason, exc.message)
    return spec


def _bounds(hint: pb.Hint, action: Action, selector: Selector, config: ServerConfig, info: EngineInfo) -> HintSpec:
    ttl_s = requested = deadline_s = requested_ns = None
    priority = 0
    destination = ""
    target_tier: Tier | None = None
    expected_reuse_s: float | None = None
    if action in (Action.RETAIN, Action.PIN):
        msg = hint.retain if action is Action.RETAIN else hint.pin
        if not msg.HasField("ttl"):
            raise HintInvalid(Reason.INVALID_HINT, f"{action.name} needs a ttl")
        requested = duration_seconds(msg.ttl)
        requested_ns = msg.ttl.seconds * 1_000_000_000 + msg.ttl.nanos  # (validated just above)
        if requested <= 0:
            raise HintInvalid(Reason.INVALID_HINT, f"{action.name} ttl must be positive")
        ttl_s = min(requested, config.max_ttl_s)
        if action is Action.RETAIN:
            priority = hint.retain.priority
        expected_reuse_s = _expected_reuse(msg, ttl_s)
    elif action is Action.PREFETCH and hint.prefetch.HasField("deadline"):
        requested = duration_seconds(hint.prefetch.deadline)
        if requested <= 0:
            raise HintInvalid(Reason.INVALID_HINT, "PREFETCH deadline must be positive")
        deadline_s = min(requested, config.max_ttl_s)
    elif action is Action.SHARE:
        destination = _check_id(hint.share.destination, "destination", config.max_id_length)
        if destination not in info.share_destinations:
            raise HintInvalid(Reason.UNKNOWN_DESTINATION, f"destination {excerpt(destination)} is not a configured peer")
    elif action is Action.DEMOTE and hint.demote.target_tier:
        target_tier = parse_enum(Tier, hint.demote.target_tier)
        lower = {t.tier for t in info.tiers if t.tier is not Tier.DEVICE}
        if target_tier is None or target_tier is Tier.DEVICE:  # not a lower tier in any engine: the hint is wrong
            raise HintInvalid(
                Reason.INVALID_HINT, f"target_tier {hint.demote.target_tier} is not a lower tier", "demote.target_tier"
            )
        if target_tier not in lower:  # a lower tier this engine does not have
            raise HintInvalid(Reason.UNSUPPORTED, f"no configured lower tier {target_tier.name}", "demote.target_tier")
    return HintSpec(
        hint_id=hint.hint_id,
        selector=selector,
        action=action,
        max_blocks=hint.max_blocks,
        priority=priority,
        ttl_s=ttl_s,
        requested_ttl_s=requested if action in (Action.RETAIN, Action.PIN) else None,
        requested_ttl_ns=requested_ns,
        destination=destination,
        target_tier=target_tier,
        deadline_s=deadline_s,
        expected_reuse_s=expected_reuse_s,
        fingerprint=hint_fingerprint(hint),
    )


def _expected_reuse(msg: pb.RetainAction | pb.PinAction, ttl_s: float) -> float | None:
    """Seconds of `msg.expected_reuse_in` clamped to the granted ttl; None when unset."""
    if not msg.HasField("expected_reuse_in"):
        return None
    seconds = duration_seconds(msg.expected_reuse_in)
    if seconds < 0:
        raise HintInvalid(Reason.INVALID_HINT, "expected_reuse_in must not be negative")
    return min(seconds, ttl_s)


#: Block hashes of a block_hashes selector that cost one rate-limit token (apply_cost).
HASHES_PER_TOKEN = 64


def _selector_hashes(hint: pb.Hint) -> int:
    selector = hint.selector
    return len(selector.block_hashes.block_hashes) if selector.WhichOneof("target") == "block_hashes" else 0


def check_apply_batch_size(request: pb.ApplyHintsRequest, config: ServerConfig) -> None:
    """INVALID_ARGUMENT for an empty batch or one over max_hints_per_batch or
    max_block_hashes_per_batch (checked before the batch is charged to the caller's rate limit:
    a batch refused as a whole costs nothing)."""
    n = len(request.hints)
    if n == 0:
        raise invalid_argument("ApplyHintsRequest.hints is empty", "hints")
    if n > config.max_hints_per_batch:
        raise invalid_argument(
            f"{n} hints exceed max_hints_per_batch={config.max_hints_per_batch}", "hints", Reason.TOO_MANY_HINTS
        )
    hashes = sum(_selector_hashes(hint) for hint in request.hints)
    if hashes > config.max_block_hashes_per_batch:
        raise invalid_argument(
            f"{hashes} block hashes over the batch's selectors exceed max_block_hashes_per_batch="
            f"{config.max_block_hashes_per_batch}; split the batch", "hints", Reason.TOO_MANY_HINTS,
        )


def apply_cost(request: pb.ApplyHintsRequest) -> int:
    """An ApplyHints batch's rate-limit tokens: one per hint, except that a hint with a
    block_hashes selector costs one per HASHES_PER_TOKEN of its hashes (at least one), as its
    engine work grows with them."""
    return sum(max(1, -(-_selector_hashes(hint) // HASHES_PER_TOKEN)) for hint in request.hints)


def parse_apply_request(request: pb.ApplyHintsRequest, config: ServerConfig, info: EngineInfo) -> list[ParsedHint]:
    check_apply_batch_size(request, config)
    return parse_hints(request.hints, config, info)


def parse_query_selector(request_selector: pb.Selector, has_selector: bool, config: ServerConfig) -> Selector:
    if not has_selector:
        raise invalid_argument("selector is required", "selector")
    try:
        return parse_selector(request_selector, config)
    except HintInvalid as exc:
        raise invalid_argument(exc.message, f"selector.{exc.field}" if exc.field else "selector") from exc


def parse_query_tiers(values: list[int] | object) -> list[Tier]:
    """QueryResidencyRequest.tiers -> Tiers; an unknown value is INVALID_ARGUMENT."""
    tiers = []
    for i, t in enumerate(values):  # type: ignore[call-overload]
        tier = parse_enum(Tier, t)
        if tier is None:
            raise invalid_argument(f"unknown tier {t}", f"tiers[{i}]")
        tiers.append(tier)
    return tiers


#: Session ids one WatchEvents filter may list.
MAX_FILTER_SESSIONS = 4096


def validate_watch_request(request: pb.WatchEventsRequest, config: ServerConfig) -> None:
    """Request-level checks of WatchEvents (INVALID_ARGUMENT with the field path)."""
    if request.start not in pb.WatchEventsRequest.Start.values():
        raise invalid_argument(f"unknown start {request.start}", "start")
    resuming = request.start == pb.WatchEventsRequest.START_RESUME
    if resuming and not request.resume_epoch:
        raise invalid_argument("START_RESUME needs resume_epoch", "resume_epoch")
    check_request_id(request.resume_epoch, "resume_epoch", config.max_id_length, required=False)
    flt = request.filter
    if len(flt.session_ids) > MAX_FILTER_SESSIONS:
        raise invalid_argument(f"{len(flt.session_ids)} session ids exceed the limit of {MAX_FILTER_SESSIONS}", "filter.session_ids")
    for i, session_id in enumerate(flt.session_ids):
        check_request_id(session_id, f"filter.session_ids[{i}]", config.max_id_length)
    for i, t in enumerate(flt.tiers):
        if parse_enum(Tier, t) is None:
            raise invalid_argument(f"unknown tier {t}", f"filter.tiers[{i}]")
    kinds = pb.EventKind.values()
    for i, k in enumerate(flt.kinds):
        if k not in kinds:
            raise invalid_argument(f"unknown event kind {k}", f"filter.kinds[{i}]")
    if request.HasField("heartbeat_interval"):
        try:
            duration_seconds(request.heartbeat_interval)
        except HintInvalid as exc:
            raise invalid_argument(exc.message, "heartbeat_interval") from exc
