"""Wire validation and bounds (validation.py) over arbitrary kvhint.v1 messages.

An independent oracle, written from the proto comments, lists every reason a
hint may be rejected for; the validator must reject exactly the hints the
oracle finds a problem with, with one of those reasons, and must never fail a
whole request for a per-hint problem.
"""

from __future__ import annotations

import functools

import grpc
import pytest
from google.protobuf import duration_pb2
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kvhint_unit_support import error_info, local_engine_info

from kvhint.v1 import kvhint_pb2 as pb
from kvhint_server.config import ServerConfig
from kvhint_server.errors import RpcError
from kvhint_server.model import (
    Action,
    ActionSupport,
    EngineInfo,
    HintResult,
    HintSpec,
    Outcome,
    Reason,
    SelectorKind,
    Tier,
    TierInfo,
)
from kvhint_server.validation import hint_fingerprint, parse_apply_request, parse_query_selector


def items_of(request, config, info):
    """Each hint's validated spec or rejection, in request order."""
    return [p.item for p in parse_apply_request(request, config, info)]

CONFIG = ServerConfig(
    max_ttl_s=600.0,
    max_hints_per_batch=6,
    max_id_length=16,
    max_hint_id_length=12,
    max_block_hashes_per_selector=4,
    max_block_hashes_per_batch=10,
)
LOCAL = local_engine_info()
# A second engine: everything supported except some selector/range combinations; Retain (not Pin)
# honours expected_reuse_in.
FULL = EngineInfo(
    engine="fake",
    engine_version="0",
    block_size=16,
    num_device_blocks=100,
    block_hash_encoding="sha256",
    tiers=(TierInfo(Tier.DEVICE, "GPU"), TierInfo(Tier.HOST, "CPU")),
    actions=(
        ActionSupport(Action.RETAIN, True, (SelectorKind.SESSION, SelectorKind.CONTINUATION, SelectorKind.BLOCK_HASHES), True,
                      supports_expected_reuse=True),
        ActionSupport(Action.PIN, True, (SelectorKind.SESSION, SelectorKind.CONTINUATION), False),
        ActionSupport(Action.RELEASE, True, (SelectorKind.SESSION,), True),
        ActionSupport(Action.EVICT, True, (SelectorKind.BLOCK_HASHES, SelectorKind.SESSION), False),
        ActionSupport(Action.DEMOTE, True, (SelectorKind.SESSION, SelectorKind.CONTINUATION), True),
        ActionSupport(Action.PREFETCH, True, (SelectorKind.SESSION,), False),
        ActionSupport(Action.SHARE, True, (SelectorKind.SESSION, SelectorKind.BLOCK_HASHES), False),
    ),
    share_destinations=("peer-1:50151",),
)
ACTION_OF = {
    "retain": Action.RETAIN, "pin": Action.PIN, "release": Action.RELEASE, "evict": Action.EVICT,
    "demote": Action.DEMOTE, "prefetch": Action.PREFETCH, "share": Action.SHARE,
}
KIND_OF = {"session": SelectorKind.SESSION, "continuation": SelectorKind.CONTINUATION, "block_hashes": SelectorKind.BLOCK_HASHES}
DURATION_MAX_S = 315_576_000_000

# --------------------------------------------------------------------------- strategies

# Each generated hint is clean, or has a few deliberately broken parts.
PARTS = ["hint_id", "selector", "target", "id", "hashes", "range", "action", "ttl", "reuse", "destination", "tier"]


def _utf8_of_length(n: int, char: str) -> str:
    """A string of exactly `n` UTF-8 bytes, mostly `char`: fewer characters than bytes when
    `char` is multi-byte, so a check that counts characters instead of bytes is caught."""
    width = len(char.encode())
    return char * (n // width) + "a" * (n % width)


@functools.cache
def ids_near(limit: int, over: bool = True) -> st.SearchStrategy[str]:
    """Ids of limit - 1, limit (or limit + 1) UTF-8 bytes: the boundary a length check must get right."""
    sizes = [limit - 1, limit, limit + 1] if over else [limit - 1, limit]
    return st.builds(_utf8_of_length, st.sampled_from(sizes), st.sampled_from("aé€𝄞"))


@functools.cache
def good_id(limit: int) -> st.SearchStrategy[str]:
    short = st.text(alphabet="abcdefghij-_:0123456789", min_size=1, max_size=8)
    return st.one_of(short, short, ids_near(limit, over=False))


@functools.cache
def bad_id(limit: int) -> st.SearchStrategy[str]:
    return st.one_of(
        st.just(""),
        ids_near(limit),
        st.text(alphabet="é€𝄞a", min_size=3, max_size=limit),  # multi-byte: the byte length matters
        st.text(min_size=limit - 3, max_size=30),
    )


def _durations(pairs: list[tuple[int, int]]) -> st.SearchStrategy[duration_pb2.Duration]:
    return st.sampled_from(pairs).map(lambda sn: duration_pb2.Duration(seconds=sn[0], nanos=sn[1]))


CAP_S = int(CONFIG.max_ttl_s)
# Well-formed and positive; the cap (600 s) and one nanosecond either side of it are drawn often.
good_duration = st.one_of(
    st.builds(duration_pb2.Duration, seconds=st.integers(0, 2000), nanos=st.integers(1, 999_999_999)),
    st.builds(duration_pb2.Duration, seconds=st.integers(1, 2000)),
    _durations([(CAP_S, 0), (CAP_S, 1), (CAP_S - 1, 999_999_999), (0, 1), (DURATION_MAX_S, 999_999_999)]),
)
# Anything: zero, negative, mixed signs, nanos or seconds out of google.protobuf.Duration's range.
bad_duration = st.one_of(
    st.builds(
        duration_pb2.Duration,
        seconds=st.one_of(
            st.integers(-5, 5), st.integers(-(2**63), 2**63 - 1),
            st.sampled_from([DURATION_MAX_S, DURATION_MAX_S + 1, -DURATION_MAX_S - 1]),
        ),
        nanos=st.one_of(st.just(0), st.integers(-999_999_999, 999_999_999), st.integers(-(2**31), 2**31 - 1)),
    ),
    _durations([(0, 0), (0, -1), (-1, 0), (1, -1), (-1, 1), (0, 1_000_000_000), (5, -1_000_000_000),
                (DURATION_MAX_S + 1, 0), (-DURATION_MAX_S - 1, 0)]),
)
# expected_reuse_in: zero is a valid expectation, and values above the granted ttl are clamped.
good_reuse = st.one_of(st.just(duration_pb2.Duration()), good_duration)
good_hash = st.one_of(st.binary(min_size=1, max_size=64), st.integers(0, 255).map(lambda b: bytes([b]) * 64))  # 64: the limit
any_hash = st.one_of(good_hash, st.just(b""), st.binary(min_size=65, max_size=70))


@st.composite
def selectors(draw: st.DrawFn, broken: frozenset[str] = frozenset()) -> pb.Selector:
    sel = pb.Selector()
    target = draw(st.sampled_from(["session", "continuation", "block_hashes"]))
    if "target" in broken and draw(st.booleans()):
        target = None
    ident = draw(bad_id(CONFIG.max_id_length) if "id" in broken else good_id(CONFIG.max_id_length))
    if target == "session":
        sel.session.session_id = ident
        sel.session.include_children = draw(st.booleans())
    elif target == "continuation":
        sel.continuation.continuation_id = ident
    elif target == "block_hashes":
        if "hashes" in broken:
            sel.block_hashes.block_hashes.extend(draw(st.lists(any_hash, max_size=6)))
            sel.block_hashes.SetInParent()
        else:
            sel.block_hashes.block_hashes.extend(draw(st.lists(good_hash, min_size=1, max_size=6)))
    # A clean selector narrows only a target that may be narrowed (a range on block_hashes is broken).
    if "range" in broken or (target != "block_hashes" and draw(st.integers(0, 4)) == 0):
        sel.range.start = draw(st.integers(0, 5))
        choice = draw(st.integers(0, 2))
        if choice == 0:
            sel.range.end = draw(st.integers(0, 6) if "range" in broken else st.integers(sel.range.start + 1, 9))
        elif choice == 1:
            sel.range.SetInParent()
    return sel


def _set_reuse(draw: st.DrawFn, msg: pb.RetainAction | pb.PinAction, broken: frozenset[str]) -> None:
    if "reuse" in broken:
        if draw(st.booleans()):
            msg.expected_reuse_in.CopyFrom(draw(bad_duration))
    elif draw(st.integers(0, 3)) == 0:
        msg.expected_reuse_in.CopyFrom(draw(good_reuse))


@st.composite
def hints(draw: st.DrawFn) -> pb.Hint:
    broken = frozenset(draw(st.one_of(st.just(set()), st.sets(st.sampled_from(PARTS), min_size=1, max_size=3))))
    limit = CONFIG.max_hint_id_length
    hint = pb.Hint(hint_id=draw(st.one_of(st.just(""), good_id(limit), bad_id(limit)) if "hint_id" in broken
                                else st.one_of(st.just(""), good_id(limit))))
    hint.max_blocks = draw(st.one_of(st.just(0), st.integers(0, 2**32 - 1)))
    if not ("selector" in broken and draw(st.booleans())):
        hint.selector.CopyFrom(draw(selectors(broken)))
    if "action" in broken and draw(st.booleans()):
        return hint
    ttl = bad_duration if "ttl" in broken else good_duration
    action = draw(st.sampled_from(list(ACTION_OF)))
    if action == "retain":
        hint.retain.priority = draw(st.integers(-(2**31), 2**31 - 1))
        if "ttl" in broken and draw(st.booleans()):
            hint.retain.SetInParent()  # no ttl
        else:
            hint.retain.ttl.CopyFrom(draw(ttl))
        _set_reuse(draw, hint.retain, broken)
    elif action == "pin":
        if "ttl" in broken and draw(st.booleans()):
            hint.pin.SetInParent()
        else:
            hint.pin.ttl.CopyFrom(draw(ttl))
        _set_reuse(draw, hint.pin, broken)
    elif action == "release":
        hint.release.SetInParent()
    elif action == "evict":
        hint.evict.SetInParent()
    elif action == "demote":
        hint.demote.target_tier = draw(st.sampled_from([-1, 0, 1, 2, 3, 4, 5, 99]) if "tier" in broken else st.sampled_from([0, 2]))
    elif action == "prefetch":
        hint.prefetch.SetInParent()
        if draw(st.booleans()):
            hint.prefetch.deadline.CopyFrom(draw(ttl))
    elif action == "share":
        dest = st.one_of(st.just(""), good_id(CONFIG.max_id_length), ids_near(CONFIG.max_id_length))
        hint.share.destination = draw(dest if "destination" in broken else st.just("peer-1:50151"))
    return hint


@st.composite
def batches(draw: st.DrawFn) -> list[pb.Hint]:
    """1..max_hints_per_batch hints (empty now and then); sometimes padded past the limit, with
    empty hints, as their content does not matter then (generating real ones costs time)."""
    batch = draw(st.lists(hints(), max_size=CONFIG.max_hints_per_batch))
    if draw(st.integers(0, 9)) == 9:
        batch += [pb.Hint()] * (CONFIG.max_hints_per_batch + 1 - len(batch) + draw(st.integers(0, 1)))
    return batch


# --------------------------------------------------------------------------- oracle


def _duration_problem(d: duration_pb2.Duration) -> bool:
    if not -999_999_999 <= d.nanos <= 999_999_999:
        return True
    return (d.seconds > 0 and d.nanos < 0) or (d.seconds < 0 and d.nanos > 0)


def _secs(d: duration_pb2.Duration) -> float:
    return d.seconds + d.nanos / 1e9


def _bad_id(value: str, limit: int) -> bool:
    return not value or len(value.encode()) > limit


def selector_faults(sel: pb.Selector) -> set[str]:
    """The path of every field at fault in a selector ("selector" for the selector itself), as a
    query's INVALID_ARGUMENT names them; empty: the selector is valid."""
    faults: set[str] = set()
    target = sel.WhichOneof("target")
    if target is None:
        faults.add("selector")
    if sel.HasField("range"):
        if target == "block_hashes":
            faults.add("selector.range")  # malformed to set it for a block_hashes target
        if sel.range.HasField("end") and sel.range.end <= sel.range.start:
            faults.add("selector.range.end")
    if target == "session" and _bad_id(sel.session.session_id, CONFIG.max_id_length):
        faults.add("selector.session.session_id")
    if target == "continuation" and _bad_id(sel.continuation.continuation_id, CONFIG.max_id_length):
        faults.add("selector.continuation.continuation_id")
    if target == "block_hashes":
        hs = sel.block_hashes.block_hashes
        if not hs or len(hs) > CONFIG.max_block_hashes_per_selector:
            faults.add("selector.block_hashes.block_hashes")
        faults.update(f"selector.block_hashes.block_hashes[{i}]" for i, x in enumerate(hs) if not 1 <= len(x) <= 64)
    return faults


def oracle(hint: pb.Hint, info: EngineInfo) -> set[Reason]:
    """Every reason this hint could be rejected for (empty: it is valid)."""
    problems: set[Reason] = set()
    if len(hint.hint_id.encode()) > CONFIG.max_hint_id_length:
        problems.add(Reason.INVALID_HINT)
    which = hint.WhichOneof("action")
    if which is None:
        problems.add(Reason.INVALID_HINT)
    kind = None
    sel = hint.selector
    if not hint.HasField("selector") or selector_faults(sel):
        problems.add(Reason.INVALID_HINT)
    if hint.HasField("selector") and sel.WhichOneof("target") is not None:
        kind = KIND_OF[sel.WhichOneof("target")]
    if which is not None and kind is not None:
        action = ACTION_OF[which]
        entry = next(a for a in info.actions if a.action is action)
        if not entry.supported or kind not in entry.selectors:
            problems.add(Reason.UNSUPPORTED)
        has_range = sel.HasField("range") and (sel.range.start > 0 or sel.range.HasField("end"))
        if has_range and not entry.supports_range:
            problems.add(Reason.UNSUPPORTED)
    if which in ("retain", "pin"):
        msg = getattr(hint, which)
        if not msg.HasField("ttl") or _duration_problem(msg.ttl) or _secs(msg.ttl) <= 0:
            problems.add(Reason.INVALID_HINT)
        if msg.HasField("expected_reuse_in"):
            if _duration_problem(msg.expected_reuse_in) or _secs(msg.expected_reuse_in) < 0:
                problems.add(Reason.INVALID_HINT)  # negative or malformed
            if not next(a for a in info.actions if a.action is ACTION_OF[which]).supports_expected_reuse:
                problems.add(Reason.UNSUPPORTED)  # set at all, where the engine does not honour it
    elif which == "prefetch" and hint.prefetch.HasField("deadline"):
        if _duration_problem(hint.prefetch.deadline) or _secs(hint.prefetch.deadline) <= 0:
            problems.add(Reason.INVALID_HINT)
    elif which == "share":
        dest = hint.share.destination
        if _bad_id(dest, CONFIG.max_id_length):
            problems.add(Reason.INVALID_HINT)
        elif dest not in info.share_destinations:
            problems.add(Reason.UNKNOWN_DESTINATION)
    elif which == "demote" and hint.demote.target_tier:
        lower = {int(t.tier) for t in info.tiers if t.tier is not Tier.DEVICE}
        if hint.demote.target_tier not in {int(t) for t in Tier} - {int(Tier.DEVICE)}:
            problems.add(Reason.INVALID_HINT)  # the device, or no tier at all: a wrong hint
        elif hint.demote.target_tier not in lower:
            problems.add(Reason.UNSUPPORTED)  # a tier this engine does not have
    return problems


def _may_also_reject(hint: pb.Hint) -> bool:
    """Durations outside google.protobuf.Duration's range are malformed; a
    validator may reject them (INVALID_HINT) or treat them as very long ones."""
    which = hint.WhichOneof("action")
    durations = []
    if which in ("retain", "pin"):
        msg = getattr(hint, which)
        durations = [d for name, d in (("ttl", msg.ttl), ("expected_reuse_in", msg.expected_reuse_in)) if msg.HasField(name)]
    elif which == "prefetch" and hint.prefetch.HasField("deadline"):
        durations = [hint.prefetch.deadline]
    return any(abs(d.seconds) > DURATION_MAX_S for d in durations)


def _without_id(hint: pb.Hint) -> pb.Hint:
    copy = pb.Hint()
    copy.CopyFrom(hint)
    copy.hint_id = ""
    return copy


# --------------------------------------------------------------------------- properties


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(), info=st.sampled_from([LOCAL, FULL]))
def test_every_hint_gets_a_spec_or_a_reasoned_rejection(batch, info):
    request = pb.ApplyHintsRequest(hints=batch)
    hashes = sum(len(h.selector.block_hashes.block_hashes) for h in batch if h.selector.WhichOneof("target") == "block_hashes")
    if not batch or len(batch) > CONFIG.max_hints_per_batch or hashes > CONFIG.max_block_hashes_per_batch:
        with pytest.raises(RpcError) as exc:
            parse_apply_request(request, CONFIG, info)
        assert exc.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert exc.value.field == "hints"
        assert exc.value.reason is (Reason.TOO_MANY_HINTS if batch else Reason.MALFORMED_REQUEST)
        return
    parsed = parse_apply_request(request, CONFIG, info)  # never raises for per-hint problems
    assert [p.wire for p in parsed] == list(batch) and all((p.spec is None) != (p.rejection is None) for p in parsed)
    items = [p.item for p in parsed]
    assert len(items) == len(batch)
    for hint, item in zip(batch, items):
        problems = oracle(hint, info)
        assert item.hint_id == hint.hint_id
        if isinstance(item, HintResult):
            assert item.outcome is Outcome.REJECTED
            assert item.reason is not Reason.UNSPECIFIED and item.message
            assert item.reason in problems or (_may_also_reject(hint) and item.reason is Reason.INVALID_HINT), (
                f"rejected with {item.reason.name}, oracle says {sorted(p.name for p in problems)}"
            )
            continue
        assert isinstance(item, HintSpec)
        assert not problems, f"accepted a hint with problems {sorted(p.name for p in problems)}: {hint}"
        _check_spec(hint, item)


def _check_spec(hint: pb.Hint, spec: HintSpec) -> None:
    which = hint.WhichOneof("action")
    assert spec.action is ACTION_OF[which]
    assert spec.max_blocks == hint.max_blocks
    sel, target = hint.selector, hint.selector.WhichOneof("target")
    assert spec.selector.kind is KIND_OF[target]
    if target == "session":
        assert spec.selector.session_id == sel.session.session_id
        assert spec.selector.include_children == sel.session.include_children
    elif target == "continuation":
        assert spec.selector.continuation_id == sel.continuation.continuation_id
    else:
        assert spec.selector.block_hashes == tuple(dict.fromkeys(sel.block_hashes.block_hashes))  # duplicates ignored
    if sel.HasField("range"):
        assert spec.selector.range_start == sel.range.start
        assert spec.selector.range_end == (sel.range.end if sel.range.HasField("end") else None)
    if which in ("retain", "pin"):
        requested = _secs(getattr(hint, which).ttl)
        assert spec.requested_ttl_s == requested  # preserved, even above the cap
        assert spec.ttl_s == min(requested, CONFIG.max_ttl_s)  # granted at the cap
        assert spec.priority == (hint.retain.priority if which == "retain" else 0)
        msg = getattr(hint, which)
        # Clamped to the granted (capped) ttl, not the requested one; zero is a valid expectation.
        assert spec.expected_reuse_s == (
            min(_secs(msg.expected_reuse_in), spec.ttl_s) if msg.HasField("expected_reuse_in") else None
        )
    else:
        assert spec.ttl_s is None and spec.requested_ttl_s is None and spec.expected_reuse_s is None
    if which == "prefetch":
        if hint.prefetch.HasField("deadline"):
            assert spec.deadline_s == min(_secs(hint.prefetch.deadline), CONFIG.max_ttl_s)
        else:
            assert spec.deadline_s is None
    if which == "share":
        assert spec.destination == hint.share.destination
    if which == "demote":
        assert spec.target_tier == (Tier(hint.demote.target_tier) if hint.demote.target_tier else None)


# --------------------------------------------------------------------------- one fault at a time

# The hints above mostly carry several problems or none, so the check a problem needs is rarely the
# one that decides: a validator that skipped it would still reject the hint for another (before
# this section, a malformed Duration, an unknown or empty Share destination or a Prefetch deadline
# of 0 decided a handful of 2,500 hints per run or none). Below, a hint valid for the engine gets
# exactly one fault, one test per fault, and must be rejected with exactly that fault's reason;
# valid hints at their documented bounds are checked on their own.

FIELD_OF = {action: field for field, action in ACTION_OF.items()}
_MALFORMED = _durations([(1, -1), (-1, 1), (0, 1_000_000_000), (0, -1_000_000_000), (5, -1_000_000_000)])
_NOT_POSITIVE = _durations([(0, 0), (0, -1), (-1, 0), (-3, -500)])


def _set_target(draw: st.DrawFn, sel: pb.Selector, kind: SelectorKind) -> None:
    if kind is SelectorKind.SESSION:
        sel.session.session_id = draw(good_id(CONFIG.max_id_length))
        sel.session.include_children = draw(st.booleans())
    elif kind is SelectorKind.CONTINUATION:
        sel.continuation.continuation_id = draw(good_id(CONFIG.max_id_length))
    else:
        sel.block_hashes.block_hashes.extend(draw(st.lists(good_hash, min_size=1, max_size=CONFIG.max_block_hashes_per_selector)))


@st.composite
def valid_hints(draw: st.DrawFn, info: EngineInfo, entry: ActionSupport, kind: SelectorKind) -> pb.Hint:
    """A hint `info` accepts, of `entry`'s action and a `kind` selector, with a range only where honoured."""
    hint = pb.Hint(hint_id=draw(st.one_of(st.just(""), good_id(CONFIG.max_hint_id_length))),
                   max_blocks=draw(st.integers(0, 2**32 - 1)))
    _set_target(draw, hint.selector, kind)
    if kind is not SelectorKind.BLOCK_HASHES and entry.supports_range and draw(st.booleans()):
        hint.selector.range.start = draw(st.integers(0, 5))
        if draw(st.booleans()):
            hint.selector.range.end = hint.selector.range.start + draw(st.integers(1, 3))
    field = FIELD_OF[entry.action]
    msg = getattr(hint, field)
    msg.SetInParent()
    if field in ("retain", "pin"):
        msg.ttl.CopyFrom(draw(good_duration))
        if field == "retain":
            msg.priority = draw(st.integers(-(2**31), 2**31 - 1))
        if entry.supports_expected_reuse and draw(st.booleans()):
            msg.expected_reuse_in.CopyFrom(draw(good_reuse))
    elif field == "prefetch" and draw(st.booleans()):
        msg.deadline.CopyFrom(draw(good_duration))
    elif field == "share":
        msg.destination = draw(st.sampled_from(info.share_destinations))
    elif field == "demote":
        msg.target_tier = draw(st.sampled_from([0] + [int(t.tier) for t in info.tiers if t.tier is not Tier.DEVICE]))
    return hint


def _faults(info: EngineInfo, entry: ActionSupport, kind: SelectorKind) -> list[str]:
    """The faults that make a valid hint of `entry`'s action and a `kind` selector invalid for exactly one reason."""
    which = FIELD_OF[entry.action]
    out = ["hint_id over", "no action", "no selector", "no target"]
    out += ["hashes empty", "hashes over", "hash length"] if kind is SelectorKind.BLOCK_HASHES else ["id empty", "id over"]
    if entry.supports_range:
        out += ["range on hashes"] if kind is SelectorKind.BLOCK_HASHES else ["range end <= start"]
    elif kind is not SelectorKind.BLOCK_HASHES:
        out.append("range unsupported")
    if any(k not in entry.selectors for k in SelectorKind):
        out.append("selector unsupported")
    if any(not a.supported and a.action is not Action.SHARE for a in info.actions):
        out.append("action unsupported")
    if which in ("retain", "pin"):
        out += ["ttl missing", "ttl not positive", "ttl malformed"]
        out += ["reuse negative", "reuse malformed"] if entry.supports_expected_reuse else ["reuse unsupported"]
    if which == "prefetch":
        out += ["deadline not positive", "deadline malformed"]
    if which == "share":
        out += ["destination empty", "destination over", "destination unknown"]
    if which == "demote":
        out.append("tier not lower")
        if {t for t in Tier if t is not Tier.DEVICE} - {t.tier for t in info.tiers}:
            out.append("tier missing")
    return out


# fault -> every (engine, action, selector kind) a valid hint of which it applies to
_BASES_OF: dict[str, list[tuple[EngineInfo, ActionSupport, SelectorKind]]] = {}
for _info in (LOCAL, FULL):
    for _entry in (a for a in _info.actions if a.supported):
        for _kind in _entry.selectors:
            for _fault in ["none", *_faults(_info, _entry, _kind)]:
                _BASES_OF.setdefault(_fault, []).append((_info, _entry, _kind))


def _inject(draw: st.DrawFn, hint: pb.Hint, info: EngineInfo, fault: str) -> Reason:
    """Applies `fault` to `hint`; returns the reason it must be rejected for."""
    which, sel = hint.WhichOneof("action"), hint.selector
    msg = getattr(hint, which)
    entry = next(a for a in info.actions if a.action is ACTION_OF[which])
    over_id = st.builds(_utf8_of_length, st.just(CONFIG.max_id_length + 1), st.sampled_from("aé€𝄞"))
    if fault == "hint_id over":
        hint.hint_id = _utf8_of_length(CONFIG.max_hint_id_length + 1, draw(st.sampled_from("aé€𝄞")))
    elif fault == "no action":
        hint.ClearField(which)
    elif fault == "no selector":
        hint.ClearField("selector")
    elif fault == "no target":
        sel.ClearField(sel.WhichOneof("target"))
    elif fault in ("id empty", "id over"):
        ident = "" if fault == "id empty" else draw(over_id)
        if sel.HasField("session"):
            sel.session.session_id = ident
        else:
            sel.continuation.continuation_id = ident
    elif fault == "hashes empty":
        sel.ClearField("block_hashes")
        sel.block_hashes.SetInParent()
    elif fault == "hashes over":
        sel.block_hashes.block_hashes.extend([b"\x01"] * (CONFIG.max_block_hashes_per_selector + 1 - len(sel.block_hashes.block_hashes)))
    elif fault == "hash length":
        hashes = sel.block_hashes.block_hashes
        hashes[draw(st.integers(0, len(hashes) - 1))] = draw(st.sampled_from([b"", b"\x02" * 65]))
    elif fault == "range on hashes":
        sel.range.SetInParent()
        if draw(st.booleans()):
            sel.range.start = draw(st.integers(0, 5))
    elif fault == "range end <= start":
        sel.range.start = draw(st.integers(0, 5))
        sel.range.end = sel.range.start - draw(st.integers(0, sel.range.start))
    elif fault == "range unsupported":
        sel.range.start = draw(st.integers(1, 5)) if draw(st.booleans()) else 0
        if sel.range.start == 0 or draw(st.booleans()):
            sel.range.end = sel.range.start + draw(st.integers(1, 3))
        return Reason.UNSUPPORTED
    elif fault == "selector unsupported":
        sel.Clear()
        _set_target(draw, sel, draw(st.sampled_from([k for k in SelectorKind if k not in entry.selectors])))
        return Reason.UNSUPPORTED
    elif fault == "action unsupported":
        # (Not a Share: an engine without Share has no destinations, so any would be unknown too.)
        action = draw(st.sampled_from([a.action for a in info.actions if not a.supported and a.action is not Action.SHARE]))
        getattr(hint, FIELD_OF[action]).SetInParent()
        return Reason.UNSUPPORTED
    elif fault == "ttl missing":
        msg.ClearField("ttl")
    elif fault in ("ttl not positive", "deadline not positive"):
        (msg.ttl if fault.startswith("ttl") else msg.deadline).CopyFrom(draw(_NOT_POSITIVE))
    elif fault in ("ttl malformed", "deadline malformed"):
        (msg.ttl if fault.startswith("ttl") else msg.deadline).CopyFrom(draw(_MALFORMED))
    elif fault == "reuse negative":
        msg.expected_reuse_in.CopyFrom(draw(_NOT_POSITIVE.filter(lambda d: d.seconds or d.nanos)))
    elif fault == "reuse malformed":
        msg.expected_reuse_in.CopyFrom(draw(_MALFORMED))
    elif fault == "reuse unsupported":
        msg.expected_reuse_in.CopyFrom(draw(good_reuse))
        return Reason.UNSUPPORTED
    elif fault == "destination empty":
        msg.destination = ""
    elif fault == "destination over":
        msg.destination = draw(over_id)
    elif fault == "destination unknown":
        msg.destination = draw(good_id(CONFIG.max_id_length))
        return Reason.UNKNOWN_DESTINATION
    elif fault == "tier not lower":
        msg.target_tier = draw(st.sampled_from([int(Tier.DEVICE), -1, 5, 99]))
    elif fault == "tier missing":
        msg.target_tier = draw(st.sampled_from(sorted({t for t in Tier if t is not Tier.DEVICE} - {t.tier for t in info.tiers})))
        return Reason.UNSUPPORTED
    else:
        raise AssertionError(fault)
    return Reason.INVALID_HINT


FAULTS = sorted(set(_BASES_OF) - {"none"})


@pytest.mark.parametrize("fault", FAULTS)
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_a_hint_with_one_fault_is_rejected_for_exactly_that_fault(fault, data):
    """Every fault, on every engine, action and selector it applies to (one test per fault, so
    each is reached on every run)."""
    info, entry, kind = data.draw(st.sampled_from(_BASES_OF[fault]))
    hint = data.draw(valid_hints(info, entry, kind))
    reason = _inject(data.draw, hint, info, fault)
    assert oracle(hint, info) == {reason}, f"the generator and the oracle disagree on {fault!r}: {hint}"
    [item] = items_of(pb.ApplyHintsRequest(hints=[hint]), CONFIG, info)
    assert isinstance(item, HintResult) and item.outcome is Outcome.REJECTED, f"{fault!r} accepted: {hint}"
    assert item.reason is reason, f"{fault!r} rejected {item.reason.name} ({item.message}), not {reason.name}"
    assert item.message and item.hint_id == hint.hint_id


def _session_hint(**kw: object) -> pb.Hint:
    return pb.Hint(selector=pb.Selector(session=pb.SessionSelector(session_id="s")), **kw)


def _secs_of(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return d


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(_BASES_OF["none"]).flatmap(lambda base: st.tuples(st.just(base[0]), valid_hints(*base))))
# Boundaries the draws above reach only now and then: expected reuse beyond the granted (capped)
# ttl, or zero; a deadline over the cap; ids and hashes of exactly their byte limits.
@example(case=(FULL, _session_hint(retain=pb.RetainAction(ttl=_secs_of(7200), expected_reuse_in=_secs_of(5000)))))
@example(case=(FULL, _session_hint(retain=pb.RetainAction(ttl=_secs_of(100), expected_reuse_in=_secs_of(0)))))
@example(case=(FULL, _session_hint(prefetch=pb.PrefetchAction(deadline=_secs_of(7200.5)))))
@example(case=(LOCAL, pb.Hint(hint_id="€" * 4, selector=pb.Selector(session=pb.SessionSelector(session_id="é" * 8)),
                              evict=pb.EvictAction())))
@example(case=(LOCAL, pb.Hint(selector=pb.Selector(block_hashes=pb.BlockHashSelector(block_hashes=[bytes([i]) * 64 for i in range(4)])),
                              pin=pb.PinAction(ttl=_secs_of(CONFIG.max_ttl_s)))))
def test_a_valid_hint_is_accepted_with_its_bounds(case):
    """Ids and hashes at their byte limits, TTLs and deadlines over the cap, expectations of reuse
    (zero, or beyond the granted ttl): accepted, with the values the contract grants."""
    info, hint = case
    assert oracle(hint, info) == set()
    [item] = items_of(pb.ApplyHintsRequest(hints=[hint]), CONFIG, info)
    assert isinstance(item, HintSpec), f"a valid hint was refused ({item.reason.name}: {item.message}): {hint}"
    _check_spec(hint, item)


@settings(max_examples=200, deadline=None)
@given(sel=st.sets(st.sampled_from(["target", "id", "hashes", "range"]), max_size=2).flatmap(
    lambda broken: selectors(frozenset(broken))))
def test_a_query_selector_is_refused_naming_a_field_at_fault(sel):
    """QueryResidency's selector: INVALID_ARGUMENT naming the field at fault (the selector's own
    problems; a valid one parses to exactly what it names)."""
    faults = selector_faults(sel)
    if not faults:
        parsed = parse_query_selector(sel, True, CONFIG)
        assert parsed.kind is KIND_OF[sel.WhichOneof("target")]
        assert (parsed.range_start, parsed.range_end) == (sel.range.start, sel.range.end if sel.range.HasField("end") else None)
        return
    with pytest.raises(RpcError) as exc:
        parse_query_selector(sel, True, CONFIG)
    assert exc.value.code is grpc.StatusCode.INVALID_ARGUMENT and exc.value.reason is Reason.MALFORMED_REQUEST
    assert exc.value.field in faults, f"named {exc.value.field!r}; at fault: {sorted(faults)}"


def _content_leaves(msg, top: bool = True):
    """(message, field) of every scalar or repeated field of `msg` and of its present messages,
    recursively, set or not, but the hint's id."""
    for fd in msg.DESCRIPTOR.fields:
        if top and fd.name == "hint_id":
            continue
        if fd.message_type is None or fd.is_repeated:
            yield msg, fd
        elif msg.HasField(fd.name):
            yield from _content_leaves(getattr(msg, fd.name), False)


@st.composite
def hint_pairs(draw: st.DrawFn) -> tuple[pb.Hint, pb.Hint]:
    """Two hints: unrelated, or the second one the first with one value of its content changed
    (which two unrelated hints differ by only now and then)."""
    a = draw(hints())
    if draw(st.booleans()):
        return a, draw(hints())
    b = pb.Hint()
    b.CopyFrom(a)
    msg, fd = draw(st.sampled_from(list(_content_leaves(b))))  # max_blocks at least
    value = getattr(msg, fd.name)
    if fd.is_repeated:
        value.append(draw(good_hash))  # another (maybe repeated) hash
    elif fd.type == fd.TYPE_BOOL:
        setattr(msg, fd.name, not value)
    elif fd.type == fd.TYPE_STRING:
        setattr(msg, fd.name, value + draw(st.sampled_from("xé")))
    else:  # an integer (an enum value too): +-1 within its type
        setattr(msg, fd.name, value - 1 if value > 0 else value + 1)
    return a, b


@settings(max_examples=150, deadline=None)
@given(pair=hint_pairs(), new_id=good_id(CONFIG.max_hint_id_length))
def test_fingerprint_identifies_the_hint_without_its_id(pair, new_id):
    """Idempotency compares fingerprints: the same hint under another id must
    match, a different hint must not (valid or not: an id binds either)."""
    a, b = pair
    info = FULL
    [sa] = items_of(pb.ApplyHintsRequest(hints=[a]), CONFIG, info)
    renamed = pb.Hint()
    renamed.CopyFrom(a)
    renamed.hint_id = new_id[: CONFIG.max_hint_id_length]
    [sr] = items_of(pb.ApplyHintsRequest(hints=[renamed]), CONFIG, info)
    [sb] = items_of(pb.ApplyHintsRequest(hints=[b]), CONFIG, info)
    assert hint_fingerprint(a) == hint_fingerprint(renamed)
    assert (hint_fingerprint(a) == hint_fingerprint(b)) == (_without_id(a) == _without_id(b))
    for hint, item in ((a, sa), (renamed, sr), (b, sb)):
        if isinstance(item, HintSpec):
            assert item.fingerprint == hint_fingerprint(hint)
    if isinstance(sa, HintSpec) and isinstance(sr, HintSpec):
        assert sa.fingerprint == sr.fingerprint
    if isinstance(sa, HintSpec) and isinstance(sb, HintSpec):
        assert (sa.fingerprint == sb.fingerprint) == (_without_id(a) == _without_id(b))


def test_ttl_above_cap_is_granted_at_the_cap_with_the_request_preserved():
    hint = pb.Hint(
        hint_id="x",
        selector=pb.Selector(session=pb.SessionSelector(session_id="s")),
        pin=pb.PinAction(ttl=duration_pb2.Duration(seconds=7200, nanos=500_000_000)),
    )
    [spec] = items_of(pb.ApplyHintsRequest(hints=[hint]), CONFIG, LOCAL)
    assert isinstance(spec, HintSpec)
    assert spec.ttl_s == CONFIG.max_ttl_s and spec.requested_ttl_s == 7200.5


@pytest.mark.parametrize("action", ["demote", "prefetch", "share"])
def test_unadvertised_actions_are_rejected_unsupported(action):
    hint = pb.Hint(hint_id="x", selector=pb.Selector(session=pb.SessionSelector(session_id="s")))
    getattr(hint, action).SetInParent()
    if action == "share":
        hint.share.destination = "peer-1:50151"
    [result] = items_of(pb.ApplyHintsRequest(hints=[hint]), CONFIG, LOCAL)
    assert isinstance(result, HintResult)
    assert (result.outcome, result.reason) == (Outcome.REJECTED, Reason.UNSUPPORTED)


@pytest.mark.parametrize(
    ("target_tier", "reason"),
    [(pb.TIER_DEVICE, Reason.INVALID_HINT), (99, Reason.INVALID_HINT), (pb.TIER_REMOTE, Reason.UNSUPPORTED)],
)
def test_a_demote_target_that_is_no_lower_tier_is_invalid_and_a_missing_one_unsupported(target_tier, reason):
    """TIER_DEVICE or an undefined value can never be a Demote's target (a wrong hint); a lower
    tier this engine lacks is a capability it does not have. Either names the field."""
    from kvhint_unit_support import tiered_engine_info  # device, host and disk; no remote tier

    hint = pb.Hint(hint_id="x", selector=pb.Selector(session=pb.SessionSelector(session_id="s")),
                   demote=pb.DemoteAction(target_tier=target_tier))
    [result] = items_of(pb.ApplyHintsRequest(hints=[hint]), CONFIG, tiered_engine_info())
    assert isinstance(result, HintResult)
    assert (result.outcome, result.reason) == (Outcome.REJECTED, reason)
    assert "target_tier" in result.message or "lower tier" in result.message


def test_one_bad_hint_does_not_fail_the_batch():
    good = pb.Hint(selector=pb.Selector(session=pb.SessionSelector(session_id="s")), release=pb.ReleaseAction())
    bad = pb.Hint(hint_id="bad", release=pb.ReleaseAction())  # no selector
    items = items_of(pb.ApplyHintsRequest(hints=[good, bad, good]), CONFIG, LOCAL)
    assert [type(i) for i in items] == [HintSpec, HintResult, HintSpec]
    assert items[1].reason is Reason.INVALID_HINT


# --------------------------------------------------------------------------- over the wire

UNARY = ["ApplyHints", "QueryResidency", "ListSessions", "GetOperation", "GetCapabilities"]
REQUEST_OF = {
    "ApplyHints": pb.ApplyHintsRequest,
    "QueryResidency": pb.QueryResidencyRequest,
    "ListSessions": pb.ListSessionsRequest,
    "GetOperation": pb.GetOperationRequest,
    "GetCapabilities": pb.GetCapabilitiesRequest,
}


def test_random_bytes_are_invalid_argument_and_the_server_keeps_serving(make_harness):
    harness = make_harness(max_hints_per_batch=8)
    seen_invalid = 0

    @settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(method=st.sampled_from(UNARY), raw=st.one_of(
        st.binary(max_size=64),
        # Likely undecodable: a length-delimited field 1 whose length overruns the message.
        st.binary(max_size=30).map(lambda b: b"\x0a\x7f" + b),
        # Invalid UTF-8 inside a string field (ApplyHints: hints[0].hint_id).
        st.just(b"\x0a\x04\x0a\x02\xc3\x28"),
    ))
    def run(method, raw):
        nonlocal seen_invalid
        try:
            REQUEST_OF[method].FromString(raw)
            decodable = True
        except Exception:  # noqa: BLE001 - DecodeError and friends
            decodable = False
        try:
            harness.raw(method)(raw, timeout=5)
        except grpc.RpcError as err:
            code = err.code()
            assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), (method, raw, code, err.details())
            info = error_info(err)
            assert info is not None, "failed RPC without google.rpc.ErrorInfo"
            assert info.domain == "kvhint.v1"
            if code is grpc.StatusCode.NOT_FOUND:
                assert info.reason == "REASON_NOT_FOUND"
            else:
                assert info.reason in ("REASON_MALFORMED_REQUEST", "REASON_TOO_MANY_HINTS"), info.reason
            seen_invalid += code is grpc.StatusCode.INVALID_ARGUMENT
        else:
            assert decodable, f"{method} accepted undecodable bytes {raw!r}"
        # The server keeps answering.
        caps = harness.stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=5)
        assert caps.protocol_version == "kvhint.v1"

    run()
    assert seen_invalid > 0


def test_undecodable_request_names_the_message_in_error_info(harness):
    with pytest.raises(grpc.RpcError) as exc:
        harness.raw("ApplyHints")(b"\x0a\x7f\x01", timeout=5)
    assert exc.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    info = error_info(exc.value)
    assert info is not None and info.domain == "kvhint.v1" and info.reason == "REASON_MALFORMED_REQUEST"
