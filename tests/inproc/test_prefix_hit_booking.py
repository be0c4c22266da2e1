"""Prefix hits are booked when a request takes the blocks, not when vLLM looks it up.

vLLM's scheduler looks a waiting request up (`KVCacheManager.get_computed_blocks`) every step
it considers it, also in the steps it cannot admit it (allocate_slots returns None under memory
pressure). A hit booked at the lookup published a BlocksStored(prefix_hit) and refreshed the
index every such step, and made a session a member of blocks it never used, which it stayed
after an abort before admission. Real Scheduler/KVCacheManager/BlockPool (engine_integration.inproc).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from layout_support import apply
from pool_support import retain
from vllm.v1.request import RequestStatus

from engine_integration import inproc
from kvhint.v1 import kvhint_pb2 as pb
from kvhint_server.events import BlocksStored
from kvhint_server.model import Outcome, Tier

BS = 16
SHARED = list(range(100, 100 + 4 * BS))  # a 4-block prefix, cached by `base`


def _watch(scheduler: Any) -> list[tuple[bool, str, str, int]]:
    """BlocksStored events as published: (prefix_hit, session, continuation, blocks)."""
    seen: list[tuple[bool, str, str, int]] = []
    bus = scheduler.kvhint_core.bus
    publish = bus.publish

    def tap(event: Any, **kwargs: Any) -> Any:
        if isinstance(event, BlocksStored):
            c = event.coordinates
            seen.append((event.prefix_hit, c.session_id, c.continuation_id, len(event.block_hashes)))
        return publish(event, **kwargs)

    bus.publish = tap
    return seen


def _under_pressure(scheduler: Any) -> None:
    """`base` (session B) caches SHARED and finishes; `hog` then holds 15 of the 23 usable blocks
    for 40 steps."""
    scheduler.add_request(inproc.make_request("base", SHARED + [1], session_id="B", max_tokens=1, block_size=BS))
    inproc.run_until_idle(scheduler)
    scheduler.add_request(inproc.make_request("hog", list(range(5000, 5000 + 15 * BS)), max_tokens=40, block_size=BS))
    inproc.step(scheduler)


def _waiting(request_id: str, session: str | None, continuation: str | None) -> Any:
    """SHARED + 6 blocks of its own: 10 blocks, more than the pool has free beside `hog`."""
    request = inproc.make_request(request_id, SHARED + list(range(9000, 9000 + 6 * BS)), session_id=session,
                                  max_tokens=1, block_size=BS)
    if continuation is not None:
        request.sampling_params.extra_args = {"continuation_id": continuation}
    return request


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("session", [None, "S"], ids=["continuation only", "session"])
def test_a_request_waiting_for_memory_reports_its_hit_once_when_admitted(async_scheduling: bool, session: str | None) -> None:
    with inproc.running_scheduler(num_blocks=24, block_size=BS, max_num_seqs=4, async_scheduling=async_scheduling) as s:
        core = s.kvhint_core
        seen = _watch(s)
        _under_pressure(s)
        seen.clear()
        s.add_request(_waiting("w", session, "cont-1" if session is None else None))
        for _ in range(12):  # `hog` still runs: `w` is looked up every step, never admitted
            assert "w" not in inproc.step(s).prefix_hits
        core.settle()
        coords = (session or "", "" if session else "cont-1")
        assert [e for e in seen if (e[1], e[2]) == coords] == [], "nothing of w's before w is admitted"
        hits: dict[str, int] = {}
        while inproc.busy(s):
            hits.update(inproc.step(s).prefix_hits)
        core.settle()
        assert hits["w"] == 4 * BS
        # One hit for the four shared blocks, reported before w's own six blocks, as at admission.
        assert [e for e in seen if (e[1], e[2]) == coords] == [(True, *coords, 4), (False, *coords, 6)]


def test_a_session_aborted_before_admission_joins_nothing() -> None:
    with inproc.running_scheduler(num_blocks=24, block_size=BS, max_num_seqs=4) as s:
        core = s.kvhint_core
        seen = _watch(s)
        _under_pressure(s)
        w = _waiting("w", "S", None)
        s.add_request(w)
        for _ in range(5):
            inproc.step(s)
        s.finish_requests("w", RequestStatus.FINISHED_ABORTED)  # the client gave up before admission
        inproc.step(s)
        core.settle()
        ext = s.kvhint_adapter.external
        shared = [ext(h) for h in w.block_hashes[:4]]
        assert all(core.index.node(h).has_member("B") for h in shared), "the shared prefix is still resident"
        assert not any(core.index.node(h).has_member("S") for h in shared), "S never used these blocks"
        assert "S" not in core.index.sessions, "S holds nothing"
        assert not any(e[0] for e in seen), "no prefix hit was reported"
        assert getattr(s.kvhint_adapter, "pending_hit", None) is None, "nothing of w is kept"


# ---------------------------------------------------------------- property


arrivals_st = st.lists(
    st.tuples(
        st.integers(0, 3),  # step it arrives at
        st.integers(0, 4),  # shared blocks in its prompt (0: no hit)
        st.integers(1, 12),  # blocks of its own
        st.one_of(st.none(), st.integers(0, 8)),  # abort this many steps after arriving (None: never)
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrivals=arrivals_st, num_blocks=st.integers(14, 40), async_scheduling=st.booleans())
def test_prefix_hits_are_reported_once_per_admission_with_a_hit(
    arrivals: list[tuple[int, int, int, int | None]], num_blocks: int, async_scheduling: bool
) -> None:
    """Whatever the memory pressure and the aborts, a request's prefix hit is reported exactly
    when it was admitted with a hit (once: max_tokens=1 leaves nothing to preempt), and a
    request never admitted reports none."""
    with inproc.running_scheduler(num_blocks=num_blocks, block_size=BS, max_num_seqs=4, async_scheduling=async_scheduling) as s:
        core = s.kvhint_core
        seen = _watch(s)
        s.add_request(inproc.make_request("base", SHARED + [1], max_tokens=1, block_size=BS))
        inproc.run_until_idle(s)
        requests = {}
        for i, (_, shared, own, _) in enumerate(arrivals):
            tail = [20_000 + 1_000 * i + t for t in range(own * BS)]
            request = inproc.make_request(f"r{i}", SHARED[: shared * BS] + tail, max_tokens=1, block_size=BS)
            request.sampling_params.extra_args = {"continuation_id": f"c{i}"}
            requests[f"r{i}"] = request
        admitted_hits: dict[str, int] = {}
        for step in range(200):
            for i, (at, _, _, abort_after) in enumerate(arrivals):
                rid = f"r{i}"
                if step == at:
                    s.add_request(requests[rid])
                if abort_after is not None and step == at + abort_after and rid not in admitted_hits:
                    s.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            result = inproc.step(s)
            admitted_hits.update(result.prefix_hits)
            assert getattr(s.kvhint_adapter, "pending_hit", None) is None, "no lookup is kept past its step"
            if step > 12 and not inproc.busy(s):
                break
        core.settle()
        reported = Counter(e[2] for e in seen if e[0])
        expected = Counter({f"c{r[1:]}": 1 for r, hit in admitted_hits.items() if r != "base" and hit >= BS})
        assert reported == expected


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_member_sessions_hit_records_the_continuation_it_carries(async_scheduling: bool) -> None:
    """A request of session B that names a continuation and hits B's own blocks (B is already a
    member) records the continuation where the hit ends, as a request without a session does:
    this one stores no full block of its own (3 tokens after the hit, 2 generated), so the hit
    is the only place the continuation can lie. It was dropped with the hit, and a Retain of
    the continuation came back MISSING."""
    with inproc.running_scheduler(num_blocks=24, block_size=BS, async_scheduling=async_scheduling) as s:
        s.add_request(inproc.make_request("base", SHARED + [1], session_id="B", max_tokens=1, block_size=BS))
        inproc.run_until_idle(s)
        turn = inproc.make_request("turn", SHARED + [7, 8, 9], session_id="B", max_tokens=2, block_size=BS)
        turn.sampling_params.extra_args = {"continuation_id": "B/turn-2"}
        s.add_request(turn)
        hits: dict[str, int] = {}
        while inproc.busy(s):
            hits.update(inproc.step(s).prefix_hits)
        assert hits["turn"] == 4 * BS
        selector = pb.Selector(continuation=pb.ContinuationSelector(continuation_id="B/turn-2"))
        [result] = apply(s, retain(selector))
        assert (result.outcome, result.affected) == (Outcome.ACCEPTED, {Tier.DEVICE: 4})
