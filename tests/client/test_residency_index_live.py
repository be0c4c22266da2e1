"""ResidencyIndex answers from live engines only unless include_stale=True, for every query, the
ones that name an engine (sessions(engine), session_blocks, tier_blocks) as much as the ones that
span engines (engines_for_session, engines_for_block, session_residency, sessions()).

A router engineer's trial saw `sessions("e2")` list 9 sessions while e2 was not live, which
engines_for_session correctly hid. Driven directly (no network)."""

from __future__ import annotations

from fake_kvhint_server import h, stored
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhint.v1 import kvhint_pb2
from kvhint_client.residency_index import EngineResidencyState, ResidencyIndex

DEVICE, HOST = kvhint_pb2.TIER_DEVICE, kvhint_pb2.TIER_HOST
ENGINES = ("e1", "e2", "e3")
SESSIONS = ("S1", "S2", "S3")
TIERS = (DEVICE, HOST)
BLOCKS = tuple(range(1, 6))


def two_engines() -> ResidencyIndex:
    index = ResidencyIndex()
    for engine, hashes in (("e1", [1, 2]), ("e2", [2, 3])):
        state = EngineResidencyState()
        state.store(DEVICE, [h(x) for x in hashes], ["S"])
        state.store(HOST, [h(9)], [f"only-{engine}"])
        index.replace(engine, state, live=True)
    return index


def test_a_disconnected_engine_answers_nothing_unless_stale_is_asked_for() -> None:
    index = two_engines()
    index.set_live("e2", False)  # its stream broke; its state is kept for the resume
    assert index.sessions("e2") == set(), "the trial's sessions(live) for a non-live engine"
    assert index.session_blocks("S", "e2") == frozenset()
    assert index.tier_blocks("e2", "device") == frozenset()
    # the same as the queries across engines say
    assert [r.engine for r in index.engines_for_session("S")] == ["e1"]
    assert index.engines_for_block(h(3)) == set() and "e2" not in index.session_residency("S")
    assert index.sessions() == {"S", "only-e1"}
    # asked for, the stale state is there
    assert index.sessions("e2", include_stale=True) == {"S", "only-e2"}
    assert index.session_blocks("S", "e2", include_stale=True) == {h(2), h(3)}
    assert index.tier_blocks("e2", "device", include_stale=True) == {h(2), h(3)}
    # live again: answered again
    index.set_live("e2", True)
    assert index.sessions("e2") == {"S", "only-e2"} and index.session_blocks("S", "e2", tier="device") == {h(2), h(3)}


def test_an_engine_not_synced_yet_or_unknown_holds_nothing() -> None:
    index = ResidencyIndex()
    index.add_engine("e1")
    index.apply_event("e1", stored("E1", 1, [1], "S"))  # fed before any snapshot made it live
    assert index.sessions("e1") == set() and index.tier_blocks("e1", DEVICE) == frozenset()
    assert index.sessions("e1", include_stale=True) == {"S"}
    for stale in (False, True):
        assert index.sessions("nowhere", include_stale=stale) == set()
        assert index.session_blocks("S", "nowhere", include_stale=stale) == frozenset()
        assert index.tier_blocks("nowhere", DEVICE, include_stale=stale) == frozenset()


# -- one rule for every query: a property -------------------------------------------------------

_state = st.dictionaries(st.sampled_from(SESSIONS),
                         st.lists(st.tuples(st.sampled_from(BLOCKS), st.sampled_from(TIERS)), min_size=1, max_size=4),
                         max_size=3)
_engine = st.sampled_from(ENGINES)
OPS = st.lists(st.one_of(
    st.tuples(st.just("replace"), _engine, _state, st.booleans()),
    st.tuples(st.just("set_live"), _engine, st.booleans()),
    st.tuples(st.just("reset"), _engine),
    st.tuples(st.just("store"), _engine, st.sampled_from(SESSIONS), st.sampled_from(BLOCKS), st.sampled_from(TIERS)),
), max_size=25)


class Model:
    """What each engine holds (stores only: nothing leaves), and whether it is live."""

    def __init__(self) -> None:
        self.held: dict[str, dict[str, set[tuple[bytes, int]]]] = {}
        self.live: dict[str, bool] = {}

    def blocks(self, engine: str, session: str, tier=None) -> set[bytes]:
        """The session's blocks (membership is per block) resident on `tier` (any tier if None)."""
        members = {b for b, _ in self.held.get(engine, {}).get(session, ())}
        return members if tier is None else members & self.tier(engine, tier)

    def tier(self, engine: str, tier: int) -> set[bytes]:
        return {b for pairs in self.held.get(engine, {}).values() for b, t in pairs if t == tier}


def apply(index: ResidencyIndex, model: Model, op: tuple) -> None:
    kind, engine = op[0], op[1]
    if kind == "replace":
        state = EngineResidencyState()
        model.held[engine] = {}
        for session, entries in op[2].items():
            for block, tier in entries:
                state.store(tier, [h(block)], [session])
                model.held[engine].setdefault(session, set()).add((h(block), tier))
        index.replace(engine, state, live=op[3])
        model.live[engine] = op[3]
    elif kind == "set_live":
        index.set_live(engine, op[2])
        model.live[engine] = op[2]
    elif kind == "reset":
        index.reset(engine)
        model.held[engine], model.live[engine] = {}, False
    else:
        session, block, tier = op[2], op[3], op[4]
        index.apply_event(engine, stored("E", 1, [block], session, tier=tier))
        model.held.setdefault(engine, {}).setdefault(session, set()).add((h(block), tier))
        model.live.setdefault(engine, False)


@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_every_query_hides_engines_that_are_not_live_unless_stale_is_asked_for(ops: list[tuple]) -> None:
    index, model = ResidencyIndex(), Model()
    for op in ops:
        apply(index, model, op)
    for stale in (False, True):
        visible = [e for e in ENGINES if stale or model.live.get(e, False)]
        for engine in ENGINES:
            shown = engine in visible
            held_sessions = {s for s, pairs in model.held.get(engine, {}).items() if pairs}
            assert index.sessions(engine, include_stale=stale) == (held_sessions if shown else set()), (engine, stale)
            for tier in TIERS:
                expected = model.tier(engine, tier) if shown else set()
                assert index.tier_blocks(engine, tier, include_stale=stale) == expected, (engine, tier, stale)
            for session in SESSIONS:
                for tier in (None, *TIERS):
                    expected = model.blocks(engine, session, tier) if shown else set()
                    assert index.session_blocks(session, engine, tier=tier, include_stale=stale) == expected
        assert index.sessions(include_stale=stale) == {s for e in visible for s in index.sessions(e, include_stale=stale)}
        for session in SESSIONS:
            holders = {e for e in visible if model.blocks(e, session)}
            assert {r.engine for r in index.engines_for_session(session, include_stale=stale)} == holders
            residency = index.session_residency(session, include_stale=stale)
            assert set(residency) == holders
            for e, by_tier in residency.items():
                assert frozenset().union(*by_tier.values()) == index.session_blocks(session, e, include_stale=stale)
        for block in BLOCKS:
            for tier in TIERS:
                expected = {e for e in visible if h(block) in model.tier(e, tier)}
                assert index.engines_for_block(h(block), tier=tier, include_stale=stale) == expected
