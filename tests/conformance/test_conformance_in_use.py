"""evict/skips-blocks-in-use against a scripted context (no engine): what the case asks of the
target. Its running request decodes a bounded number of tokens whatever max_model_len the target
serves (it decoded up to max_model_len, twice, which was 40% of a whole suite run on a 2-core CPU
engine), it fires Evicts while that request runs, and it passes on a CLIPPED/BLOCKS_IN_USE result
with the request's tokens unchanged and fails on changed tokens.

An Evict answered ACCEPTED while the request went on storing blocks (a later Evict, in the order
the target applied them, found the session's blocks again) fails as such: such a target was told
"no EVICT was applied ... the client may be starved of CPU". An ACCEPTED that may have come after
the request ended (nothing found afterwards) is not a failure by itself, and the order comes from
applied_at_sequence, not from the order the Evicts were sent."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest

from conformance.cases import REGISTRY
from conformance.cases.release_evict import RUNNING_DECODE_TOKENS, accepted_while_running
from conformance.model import CaseFailed
from kvhint.v1 import kvhint_pb2 as pb

CASE = REGISTRY.by_id()["kvhint.v1/evict/skips-blocks-in-use"]


def in_use(n: int) -> tuple[pb.HintResult, int]:
    """Every Evict CLIPPED/BLOCKS_IN_USE, applied in the order sent."""
    clip = pb.Clip(reason=pb.REASON_BLOCKS_IN_USE, granted_blocks=0)
    return pb.HintResult(outcome=pb.OUTCOME_CLIPPED, reason=pb.REASON_BLOCKS_IN_USE, clips=[clip]), n + 1


def accepted(blocks: int) -> pb.HintResult:
    return pb.HintResult(outcome=pb.OUTCOME_ACCEPTED, affected_blocks=[pb.TierBlockCount(tier=pb.TIER_DEVICE, blocks=blocks)])


MISSING = pb.HintResult(outcome=pb.OUTCOME_MISSING, reason=pb.REASON_NOT_RESIDENT)


def scripted(answers: list[tuple[pb.HintResult, int]]) -> Callable[[int], tuple[pb.HintResult, int]]:
    """The n-th Evict of each running request gets answers[n] (result, applied_at_sequence)."""
    return lambda n: answers[n]


class Scripted:
    """The CaseContext surface the case uses: completions take `step_s` per token and record their
    max_tokens. While one runs, the n-th Evict fired is answered `answer(n)` (the result and the
    applied_at_sequence); a running request (not the reference) ends only after `evicts` Evicts."""

    def __init__(self, max_model_len: int, *, disturbed: bool = False, step_s: float = 0.00005,
                 answer: Callable[[int], tuple[pb.HintResult, int]] = in_use, evicts: int = 0) -> None:
        self.plan = SimpleNamespace(block_size=32)
        self.target = SimpleNamespace(options=SimpleNamespace(max_model_len=max_model_len))
        self.max_tokens: list[int] = []
        self.disturbed, self.step_s, self.calls, self.timeout = disturbed, step_s, 0, 10.0
        self.stub = SimpleNamespace(ApplyHints=SimpleNamespace(future=self._evict))
        self.answer, self.evicts, self.sent = answer, evicts, 0
        self.enough = threading.Event()

    def tokens(self, tag: str, n: int) -> list[int]:
        return [3 + i for i in range(n)]

    def sid(self, tag: str) -> str:
        return "s-" + tag

    def apply_one(self, hint: pb.Hint) -> pb.HintResult:
        return pb.HintResult(outcome=pb.OUTCOME_ACCEPTED)

    def complete(self, prompt: list[int], session: str, *, max_tokens: int, extra_body: Any) -> Any:
        self.max_tokens.append(max_tokens)
        self.calls += 1
        if self.calls > 1 and self.evicts:
            assert self.enough.wait(10)
        time.sleep(max_tokens * self.step_s)
        ids = tuple(range(max_tokens))
        if self.disturbed and self.calls > 1:
            ids = ids[:-1] + (7,)
        return SimpleNamespace(token_ids=ids, text=str(len(ids)))

    def _evict(self, request: pb.ApplyHintsRequest, timeout: float) -> Future:
        if request.hints[0].selector.session.session_id != getattr(self, "_running", None):
            self._running, self.sent = request.hints[0].selector.session.session_id, 0
            self.enough.clear()
        result, sequence = self.answer(min(self.sent, self.evicts - 1) if self.evicts else self.sent)
        self.sent += 1
        if self.evicts and self.sent >= self.evicts:
            self.enough.set()
        future: Future = Future()
        future.set_result(pb.ApplyHintsResponse(results=[result], applied_at_sequence=sequence))
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


def test_an_evict_accepted_while_the_request_stores_blocks_fails_as_such() -> None:
    """A target that evicts blocks in use: each Evict removes what the request stored since the
    last one, ACCEPTED. The later Evicts finding blocks again prove the request still ran."""
    answers = [(MISSING, 1), (accepted(2), 2), (accepted(1), 3), (accepted(1), 4)]
    with pytest.raises(CaseFailed, match="ACCEPTED while a request used the blocks; expected CLIPPED with BLOCKS_IN_USE"):
        CASE.run(Scripted(1024, answer=scripted(answers), evicts=len(answers)))  # type: ignore[arg-type]


def test_an_accepted_evict_before_a_clipped_one_fails() -> None:
    answers = [(accepted(2), 1), in_use(1)]
    with pytest.raises(CaseFailed, match="ACCEPTED while a request used the blocks"):
        CASE.run(Scripted(1024, answer=scripted(answers), evicts=len(answers)))  # type: ignore[arg-type]


def test_the_order_evicts_were_applied_in_is_read_from_applied_at_sequence() -> None:
    """A correct target: the ACCEPTED Evict (sent second) was applied after the request ended,
    later than the CLIPPED one sent after it (applied_at_sequence says so): it passes."""
    answers = [(MISSING, 1), (accepted(9), 5), in_use(3)]
    CASE.run(Scripted(1024, answer=scripted(answers), evicts=len(answers)))  # type: ignore[arg-type]


def test_an_accepted_evict_after_the_request_ended_passes() -> None:
    answers = [(MISSING, 1), in_use(1), in_use(2), (accepted(9), 4), (MISSING, 5)]
    CASE.run(Scripted(1024, answer=scripted(answers), evicts=len(answers)))  # type: ignore[arg-type]


def test_only_accepted_evicts_do_not_blame_the_cpu_alone_nor_claim_a_violation() -> None:
    """No Evict found the blocks in use, and none found them after an ACCEPTED one: the request may
    have ended first. The failure says that every Evict that found its blocks was ACCEPTED."""
    answers = [(MISSING, 1), (MISSING, 2), (accepted(9), 3), (MISSING, 4)]
    with pytest.raises(CaseFailed) as failure:
        CASE.run(Scripted(1024, answer=scripted(answers), evicts=len(answers)))  # type: ignore[arg-type]
    text = str(failure.value)
    assert "every Evict that found the request's blocks was ACCEPTED" in text
    assert "expected CLIPPED with BLOCKS_IN_USE" in text
    assert "ACCEPTED while a request used the blocks" not in text


def test_no_evict_finding_the_blocks_keeps_the_cpu_wording() -> None:
    answers = [(MISSING, 1), (MISSING, 2)]
    with pytest.raises(CaseFailed, match="no EVICT was applied while a 256-token request ran, in 12 attempts.*starved of CPU"):
        CASE.run(Scripted(1024, answer=scripted(answers), evicts=len(answers)))  # type: ignore[arg-type]


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0, 1], [1, 2, 0]])
def test_accepted_while_running_depends_on_applied_order_only(order: list[int]) -> None:
    """The same answers sent in any order: ACCEPTED (seq 1), then CLIPPED (seq 2) is a violation;
    the verdict follows applied_at_sequence."""
    answers = [(1, accepted(2)), (2, in_use(0)[0]), (3, MISSING)]
    sent = [(answers[i][0], n, answers[i][1]) for n, i in enumerate(order)]
    found = accepted_while_running(sent)
    assert found is not None and found[0].outcome == pb.OUTCOME_ACCEPTED and found[1].outcome == pb.OUTCOME_CLIPPED
