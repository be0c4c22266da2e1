"""A streaming-input (resumable) request takes its chunks one after another; vLLM replaces its
sampling params with each chunk's, and a chunk's extra_args may name another continuation.
Each chunk's stored blocks carry that chunk's coordinates, with inline and deferred bookkeeping
alike (deferred reads them when it settles, which may be after the next chunk arrived; the
coordinates were also cached on the request for good, so inline gave every chunk the first's)."""

from __future__ import annotations

import pytest
from vllm import SamplingParams
from vllm.v1.request import Request

from engine_integration import inproc
from kvhint_server.events import BlocksStored

BLOCK = 16


def _chunk(continuation: str, prompt: range) -> Request:
    return Request(
        request_id="stream", prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=1, ignore_eos=True, extra_args={"continuation_id": continuation}),
        pooling_params=None, block_hasher=inproc._block_hasher(BLOCK), session_id="sess", resumable=True,
    )


@pytest.mark.parametrize("bookkeeping", ["inline", "deferred"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_each_streamed_chunk_stores_its_blocks_under_its_own_continuation(bookkeeping: str, async_scheduling: bool) -> None:
    with inproc.running_scheduler(num_blocks=64, block_size=BLOCK, async_scheduling=async_scheduling) as scheduler:
        core = scheduler.kvhint_core
        if bookkeeping == "deferred":
            core.journal.start(thread=False)  # a settler that has not reached the entries yet
        scheduler.add_request(_chunk("c1", range(100, 100 + 2 * BLOCK + 3)))
        scheduler.add_request(_chunk("c2", range(500, 500 + 2 * BLOCK)))  # the next chunk, queued meanwhile
        for _ in range(8):
            inproc.step(scheduler)
        core.settle()
        stored = [(e.payload.coordinates.continuation_id, e.payload.first_position)
                  for e in core.bus.read_after(0, 1000) or [] if isinstance(e.payload, BlocksStored)]
        assert stored == [("c1", 0), ("c2", 2)]
        assert set(core.index.continuations) == {"c1", "c2"}


# ---------------------------------------------------------------- malformed input on a request


def test_a_session_id_that_is_not_utf8_text_is_ignored_and_the_request_served() -> None:
    """A session id with a lone surrogate (offline or in-process add_request; JSON's "\\ud800")
    is malformed like any other: ignored and logged, the request served and its continuation
    kept (coords' contract). Its UTF-8 length check raised UnicodeEncodeError out of vLLM's
    cache_full_blocks instead, which ends EngineCore."""
    with inproc.running_scheduler(num_blocks=32, block_size=BLOCK) as scheduler:
        prompt = list(range(100, 100 + 2 * BLOCK + 1))
        request = inproc.make_request("r", prompt, session_id="\ud800", max_tokens=1, block_size=BLOCK)
        request.sampling_params.extra_args = {"continuation_id": "c1"}
        scheduler.add_request(request)
        assert inproc.run_until_idle(scheduler) == ["r"]
        core = scheduler.kvhint_core
        core.settle()
        stored = [e.payload.coordinates for e in core.bus.read_after(0, 1000) or [] if isinstance(e.payload, BlocksStored)]
        assert [(c.session_id, c.continuation_id) for c in stored] == [("", "c1")]
        assert not core.index.sessions


@pytest.mark.parametrize("parser_bug", [False, True], ids=["null-hash", "parser-raises"])
def test_an_envelope_the_parser_trips_on_is_ignored_and_the_request_served(parser_bug, monkeypatch) -> None:
    """A kv_hints envelope whose payload holds a null block hash (vLLM types the payload as any
    JSON) is malformed: logged and ignored, the request served (envelope_hints' contract). Its
    TypeError escaped KvHintScheduler.add_request, which ends EngineCore. The parser now says
    EnvelopeError for it; `parser-raises` stands for whatever else it may trip on."""
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    from engine_integration import envelope_hints

    if parser_bug:
        def tripped(*_a, **_k):
            raise TypeError("a parser bug")

        monkeypatch.setattr(envelope_hints, "envelope_to_hints", tripped)

    action = KvHintAction(action_id="a1", action_type="kv.retain", action_version="1.0",
                          payload={"selector": {"block_hashes": [None]}, "ttl_seconds": 30})
    envelope = KvHintsEnvelope(protocol_version="0.1", message_id="m1", actions=[action])
    with inproc.running_scheduler(num_blocks=32, block_size=BLOCK) as scheduler:
        scheduler.add_request(inproc.make_request("r", list(range(100, 100 + 2 * BLOCK + 1)), session_id="s",
                                                  max_tokens=1, block_size=BLOCK, kv_hints=envelope))
        assert inproc.run_until_idle(scheduler) == ["r"]
        assert not scheduler.kvhint_core.ledger.grants
