"""Expected reuse (RetainAction/PinAction.expected_reuse_in): wire parsing, the
ledger's per-block expectation, and the eviction order of ProtectedFreeBlocks.

The order property is checked against an independent reference written from
the proto comment: within a (class, priority), blocks with no expectation or a
passed one go first in filing (LRU) order, then the furthest expected reuse
first; priorities ascend; pins go last. With no expectation anywhere the order
is the stock one (priorities ascending, LRU within each).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from google.protobuf import duration_pb2
from hypothesis import given, settings
from hypothesis import strategies as st
from kvhint_unit_support import local_engine_info

from engine_integration.protected import ProtectedFreeBlocks
from kvhint.v1 import kvhint_pb2 as pb
from kvhint_server.config import ServerConfig
from kvhint_server.model import Action, EngineInfo, HintResult, HintSpec, Reason, RetentionClass
from kvhint_server.retention import RetentionLedger
from kvhint_server.validation import parse_hint
from kvhint_server.wire import capabilities

CONFIG = ServerConfig(max_ttl_s=600.0)


def _duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return d


def _info(supported: bool) -> EngineInfo:
    """The unit tests' local engine, with or without expected-reuse support on RETAIN and PIN."""
    info = local_engine_info()
    actions = tuple(
        replace(a, supports_expected_reuse=supported and a.action in (Action.RETAIN, Action.PIN)) for a in info.actions
    )
    return replace(info, actions=actions)


def _hint(action: str, ttl: float, reuse: float | None) -> pb.Hint:
    msg = pb.RetainAction(ttl=_duration(ttl)) if action == "retain" else pb.PinAction(ttl=_duration(ttl))
    if reuse is not None:
        msg.expected_reuse_in.CopyFrom(_duration(reuse))
    return pb.Hint(hint_id="h", selector=pb.Selector(session=pb.SessionSelector(session_id="s")), **{action: msg})


# --------------------------------------------------------------------------- wire


def test_expected_reuse_is_parsed_and_clamped_to_the_ttl() -> None:
    info = _info(True)
    for action in ("retain", "pin"):
        spec = parse_hint(_hint(action, 60, 12.5), CONFIG, info)
        assert isinstance(spec, HintSpec) and spec.expected_reuse_s == 12.5
        clamped = parse_hint(_hint(action, 60, 3600), CONFIG, info)
        assert isinstance(clamped, HintSpec) and clamped.expected_reuse_s == 60
        # The ttl itself is capped at max_ttl first, and the expectation follows it.
        capped = parse_hint(_hint(action, 10_000, 5_000), CONFIG, info)
        assert isinstance(capped, HintSpec) and capped.expected_reuse_s == CONFIG.max_ttl_s
        unset = parse_hint(_hint(action, 60, None), CONFIG, info)
        assert isinstance(unset, HintSpec) and unset.expected_reuse_s is None


def test_negative_expected_reuse_is_rejected() -> None:
    result = parse_hint(_hint("retain", 60, -1), CONFIG, _info(True))
    assert isinstance(result, HintResult) and result.reason is Reason.INVALID_HINT


def test_engine_without_support_rejects_an_expectation_but_not_a_plain_hint() -> None:
    info = _info(False)
    result = parse_hint(_hint("pin", 60, 5), CONFIG, info)
    assert isinstance(result, HintResult) and result.reason is Reason.UNSUPPORTED
    assert isinstance(parse_hint(_hint("pin", 60, None), CONFIG, info), HintSpec)


def test_capabilities_advertise_support_per_action() -> None:
    caps = capabilities(_info(True), CONFIG, "e", 10)
    flags = {a.action: a.supports_expected_reuse for a in caps.actions}
    assert flags[pb.ACTION_RETAIN] and flags[pb.ACTION_PIN]
    assert not flags[pb.ACTION_RELEASE] and not flags[pb.ACTION_EVICT]


# --------------------------------------------------------------------------- ledger


def _grant(ledger: RetentionLedger, owner: str, h: bytes, *, reuse_at=None, deadline=100.0, pinned=False, priority=0):
    ledger.grant(owner, [h], pinned=pinned, priority=priority, deadline=deadline, expires_at=deadline, reuse_at=reuse_at)


def test_block_uses_the_earliest_expectation_of_its_unexpired_grants() -> None:
    ledger = RetentionLedger(pin_budget_blocks=10)
    h = b"\x01"
    _grant(ledger, "s:a", h, reuse_at=50.0)
    assert ledger.view(h, 0.0).reuse_at == 50.0
    _grant(ledger, "s:b", h, reuse_at=20.0, deadline=30.0)
    _grant(ledger, "s:c", h)  # no expectation: does not contribute
    assert ledger.view(h, 0.0).reuse_at == 20.0
    # s:b's grant expires: its expectation goes with it.
    assert ledger.view(h, 30.0).reuse_at == 50.0
    # Re-granting without an expectation clears the owner's expectation.
    _grant(ledger, "s:a", h)
    assert ledger.view(h, 31.0).reuse_at is None
    assert ledger.view(h, 31.0).cls is RetentionClass.RETAINED


def test_expectation_is_clamped_to_the_grant_deadline() -> None:
    ledger = RetentionLedger(pin_budget_blocks=10)
    _grant(ledger, "s:a", b"\x02", reuse_at=500.0, deadline=40.0, pinned=True)
    view = ledger.view(b"\x02", 0.0)
    assert view.cls is RetentionClass.PINNED and view.reuse_at == 40.0


# --------------------------------------------------------------------------- eviction order


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _block(i: int) -> SimpleNamespace:
    return SimpleNamespace(block_id=i)


def _reference_order(filed: dict[int, tuple[int, RetentionClass, int, float | None]], now: float) -> list[int]:
    """Eviction order from the contract: filed = block -> (seq, class, priority, reuse_at)."""

    def key(item: tuple[int, tuple[int, RetentionClass, int, float | None]]):
        _, (seq, cls, priority, reuse_at) = item
        bucket = (cls is RetentionClass.PINNED, 0 if cls is RetentionClass.PINNED else priority)
        if reuse_at is None or reuse_at <= now:
            return (*bucket, 0, 0.0, seq)
        return (*bucket, 1, -reuse_at, seq)

    return [block for block, _ in sorted(filed.items(), key=key)]


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(0, 11),
            st.sampled_from([RetentionClass.RETAINED, RetentionClass.PINNED]),
            st.integers(-2, 2),
            st.one_of(st.none(), st.floats(0, 20, allow_nan=False)),
        ),
        st.tuples(st.just("remove"), st.integers(0, 11)),
        st.tuples(st.just("tick"), st.floats(0, 5, allow_nan=False)),
        st.tuples(st.just("take"), st.integers(1, 4)),
    ),
    max_size=60,
)


def _run(operations, with_expectations: bool) -> None:
    clock = Clock()
    protected = ProtectedFreeBlocks(clock)
    filed: dict[int, tuple[int, RetentionClass, int, float | None]] = {}
    seq = 0
    for op in operations:
        if op[0] == "add":
            _, i, cls, priority, reuse_in = op
            reuse_at = clock.now + reuse_in if with_expectations and reuse_in is not None else None
            protected.add(_block(i), cls, priority, reuse_at)
            filed[i] = (seq, cls, 0 if cls is RetentionClass.PINNED else priority, reuse_at)
            seq += 1
        elif op[0] == "remove":
            assert protected.remove(_block(op[1])) == (op[1] in filed)
            filed.pop(op[1], None)
        elif op[0] == "tick":
            clock.now += op[1]
        else:
            expected = _reference_order(filed, clock.now)[: op[1]]
            retained, pinned = protected.take_victims(op[1])
            got = [b.block_id for b in retained + pinned]
            assert got == expected
            assert all(filed[i][1] is RetentionClass.PINNED for i in (b.block_id for b in pinned))
            for i in got:
                del filed[i]
        assert protected.count == len(filed)
        assert {b.block_id for b in protected.blocks()} == set(filed)
    # Draining everything gives the full reference order.
    expected = _reference_order(filed, clock.now)
    retained, pinned = protected.take_victims(len(filed) + 1)
    assert [b.block_id for b in retained + pinned] == expected and protected.count == 0


@settings(max_examples=300, deadline=None)
@given(ops)
def test_eviction_order_follows_expected_reuse(operations) -> None:
    _run(operations, with_expectations=True)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_without_expectations_the_order_is_stock(operations) -> None:
    """No expectation anywhere: priorities ascending, LRU (filing order) within each, pins last."""
    _run(operations, with_expectations=False)


def test_stale_expectation_falls_back_to_lru_order() -> None:
    clock = Clock()
    protected = ProtectedFreeBlocks(clock)
    protected.add(_block(1), RetentionClass.RETAINED, 0, 10.0)  # due at 10
    protected.add(_block(2), RetentionClass.RETAINED, 0, None)
    protected.add(_block(3), RetentionClass.RETAINED, 0, 100.0)
    protected.add(_block(4), RetentionClass.RETAINED, 0, 50.0)
    clock.now = 5.0  # nothing is due: the plain block goes, then the furthest expectation
    assert [b.block_id for b in protected.take_victims(2)[0]] == [2, 3]
    protected.add(_block(2), RetentionClass.RETAINED, 0, None)
    clock.now = 11.0  # block 1 is overdue: it rejoins LRU order, ahead of block 2 filed later
    assert [b.block_id for b in protected.take_victims(3)[0]] == [1, 2, 4]


def test_many_lazy_removals_keep_the_heaps_bounded() -> None:
    protected = ProtectedFreeBlocks(Clock())
    protected.add(_block(99), RetentionClass.RETAINED, 0, 1e9)  # keeps the bucket alive
    for round_ in range(200):
        for i in range(10):
            protected.add(_block(i), RetentionClass.RETAINED, 0, float(round_ + i + 1))
        for i in range(10):
            protected.remove(_block(i))
    bucket_heaps = [len(b.ahead) + len(b.due) for b in protected._retained.values()]
    assert protected.count == 1 and sum(bucket_heaps) <= 2 * (2 * 1 + 32)
