"""evict/skips-blocks-in-use against a scripted context (no engine): what the case asks of the
target. Its running request decodes a bounded number of tokens whatever max_model_len the target
serves (it decoded up to max_model_len, twice, which was 40% of a whole suite run on a 2-core CPU
engine), it fires Evicts while that request runs, and it passes on a CLIPPED/BLOCKS_IN_USE result
with the request's tokens unchanged and fails on changed tokens."""

from __future__ import annotations

import time
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest

from conformance.cases import REGISTRY
from conformance.cases.release_evict import RUNNING_DECODE_TOKENS
from conformance.model import CaseFailed
from kvhint.v1 import kvhint_pb2 as pb

CASE = REGISTRY.by_id()["kvhint.v1/evict/skips-blocks-in-use"]


class Scripted:
    """The CaseContext surface the case uses: completions take `step_s` per token and record their
    max_tokens; every Evict fired while one runs is answered CLIPPED/BLOCKS_IN_USE."""

    def __init__(self, max_model_len: int, *, disturbed: bool = False, step_s: float = 0.00005) -> None:
        self.plan = SimpleNamespace(block_size=32)
        self.target = SimpleNamespace(options=SimpleNamespace(max_model_len=max_model_len))
        self.max_tokens: list[int] = []
        self.disturbed, self.step_s, self.calls, self.timeout = disturbed, step_s, 0, 10.0
        self.stub = SimpleNamespace(ApplyHints=SimpleNamespace(future=self._evict))

    def tokens(self, tag: str, n: int) -> list[int]:
        return [3 + i for i in range(n)]

    def sid(self, tag: str) -> str:
        return "s-" + tag

    def apply_one(self, hint: pb.Hint) -> pb.HintResult:
        return pb.HintResult(outcome=pb.OUTCOME_ACCEPTED)

    def complete(self, prompt: list[int], session: str, *, max_tokens: int, extra_body: Any) -> Any:
        self.max_tokens.append(max_tokens)
        self.calls += 1
        time.sleep(max_tokens * self.step_s)
        ids = tuple(range(max_tokens))
        if self.disturbed and self.calls > 1:
            ids = ids[:-1] + (7,)
        return SimpleNamespace(token_ids=ids, text=str(len(ids)))

    def _evict(self, request: pb.ApplyHintsRequest, timeout: float) -> Future:
        future: Future = Future()
        clip = pb.Clip(reason=pb.REASON_BLOCKS_IN_USE, granted_blocks=0)
        future.set_result(pb.ApplyHintsResponse(results=[
            pb.HintResult(outcome=pb.OUTCOME_CLIPPED, reason=pb.REASON_BLOCKS_IN_USE, clips=[clip])]))
        return future


@pytest.mark.parametrize("max_model_len", [1024, 8192, 131072])
def test_the_running_request_decodes_a_bounded_length_on_any_context_length(max_model_len: int) -> None:
    ctx = Scripted(max_model_len)
    CASE.run(ctx)  # type: ignore[arg-type]
    assert ctx.max_tokens == [RUNNING_DECODE_TOKENS] * 2
    assert RUNNING_DECODE_TOKENS <= 256


def test_a_short_context_still_leaves_the_prompt_room() -> None:
    ctx = Scripted(200)
    CASE.run(ctx)  # type: ignore[arg-type]
    assert ctx.max_tokens == [200 - 64 - 8] * 2


def test_changed_tokens_fail_the_case() -> None:
    with pytest.raises(CaseFailed, match="different tokens"):
        CASE.run(Scripted(1024, disturbed=True))  # type: ignore[arg-type]
