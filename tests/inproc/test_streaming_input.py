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
