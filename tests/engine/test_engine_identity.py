"""Zero effect when unused: with no hints, the KvHint scheduler behaves exactly
like stock vLLM — same generated tokens, same prefix hits, same block
admissions and evictions in the same order (vLLM's own KV events, every
KV-cache group's). Runs on the dense and on the hybrid model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from engine_pool import EnginePool, uses
from engine_support import Engine, start_engine, stop_engine, tokens
from shared_engines import POOL

from engine_integration.served import default_model

pytestmark = pytest.mark.engine


# Sessions per turn: the hybrid model needs two copies of each block while a prompt is
# prefilled, so with three sessions the 80-block pool evicts every session before it
# resumes and the workload would have no prefix hits to compare.
SESSIONS = {"dense": ("a", "b", "c"), "hybrid": ("a",)}


MODELS = {"dense": "tiny", "hybrid": "hybrid"}  # pair's parameter -> the preset
OURS = {"dense": "engine", "hybrid": "hybrid_engine"}  # pair's parameter -> the shared KvHint engine
for _param, _preset in MODELS.items():
    POOL.register(f"stock-{_preset}", lambda preset=_preset: start_engine(default_model(preset), kvhint=False, zmq=True),
                  stop_engine, uses("pair", _param))
    POOL.needs(OURS[_param], uses("pair", _param))


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request: pytest.FixtureRequest, engine_pool: EnginePool) -> Iterator[tuple[Engine, Engine, tuple[str, ...]]]:
    """(stock vLLM, the shared KvHint engine, sessions) on one model. The stock engines come from
    the pool: the one a test needs next may have been started beside an earlier engine."""
    ours = request.getfixturevalue(OURS[request.param])
    with engine_pool.engine(f"stock-{MODELS[request.param]}") as stock:
        yield stock, ours, SESSIONS[request.param]


def agentic_workload(sessions: tuple[str, ...]) -> list[tuple[list[int], str | None, int]]:
    """Sessions that grow turn by turn, anonymous traffic, and cache pressure."""
    out: list[tuple[list[int], str | None, int]] = []
    contexts = {s: tokens(f"ctx-{s}", 300) for s in sessions}
    for turn in range(4):
        for s, ctx in contexts.items():
            ctx += tokens(f"turn-{s}-{turn}", 120)
            out.append((list(ctx), f"id-{s}", 12))
        out.append((tokens(f"anon-{turn}", 600), None, 4))
    return out


def run(engine: Engine, sessions: tuple[str, ...]) -> tuple[list[tuple[int, tuple[int, ...]]], list[tuple[str, object, str | None, int | None]]]:
    engine.complete(tokens("warm-up"))  # the first ZMQ batch can race the subscription
    engine.zmq.settle()  # type: ignore[union-attr]
    mark = len(engine.zmq.batches)  # type: ignore[union-attr]
    results = []
    for prompt, session, max_tokens in agentic_workload(sessions):
        c = engine.complete(prompt, session, max_tokens=max_tokens)
        results.append((c.cached_tokens, c.token_ids))
    engine.zmq.settle()  # type: ignore[union-attr]
    events = []
    for e in engine.zmq.events_since(mark):  # type: ignore[union-attr]
        kind = type(e).__name__
        if kind in ("BlockStored", "BlockRemoved"):
            events += [(kind, h, e.medium, e.group_idx) for h in e.block_hashes]  # type: ignore[attr-defined]
    return results, events


def test_tokens_hits_and_eviction_order_match_stock_vllm(pair: tuple[Engine, Engine, tuple[str, ...]]) -> None:
    stock, ours, sessions = pair
    stock.reset_cache()
    ours.reset_cache()
    expected, expected_events = run(stock, sessions)
    got, got_events = run(ours, sessions)
    assert [tokens_ for _, tokens_ in got] == [tokens_ for _, tokens_ in expected]
    assert [cached for cached, _ in got] == [cached for cached, _ in expected]
    assert any(cached for cached, _ in got), "the workload should produce prefix hits"
    assert any(kind == "BlockRemoved" for kind, *_ in expected_events), "the workload should evict"
    assert got_events == expected_events
