"""retention/pins-never-fail-allocations' tie rule (no engine): where a greedy completion run under
pins first differs from an unpinned rerun, the difference passes only when the pinned run's token
is one of the rerun's best candidates, within --tie-nats of the best. The engine-side half (real
logprobs from vLLM) is tests/conformance/test_conformance_engine.py."""

from __future__ import annotations

import io
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.cases.retention import TIE_CANDIDATES, first_divergence_is_a_tie
from conformance.runner import main, parse_args
from conformance.target import Options
from kvhint_client.openai_traffic import Completion, _token_id

TOKENS = (10, 11, 12, 13)
DIVERGE = 2  # the position where the candidates below apply


def rerun(candidates: tuple[tuple[int, float], ...]) -> SimpleNamespace:
    """A case context whose unpinned rerun generates TOKENS, with `candidates` (id, logprob), best
    first, at position DIVERGE and a clear winner elsewhere."""

    def complete(prompt: list[int], **kw: Any) -> Completion:
        assert kw["extra_body"] == {"logprobs": TIE_CANDIDATES, "return_tokens_as_token_ids": True}
        steps = [((t, -0.1), (t + 100, -5.0)) for t in TOKENS]
        steps[DIVERGE] = candidates
        return Completion(prompt_tokens=len(prompt), cached_tokens=0, token_ids=TOKENS, text="", ttft_s=0.0,
                          latency_s=0.0, top_logprobs=tuple(tuple(lp for _, lp in s) for s in steps),
                          top_token_ids=tuple(tuple(i for i, _ in s) for s in steps))

    return SimpleNamespace(complete=complete)


def with_token(token: int) -> tuple[int, ...]:
    out = list(TOKENS)
    out[DIVERGE] = token
    return tuple(out)


@given(gap=st.floats(0.0, 1.0), tol=st.floats(0.0, 1.0), rank=st.integers(1, 4))
def test_a_candidate_passes_exactly_when_its_gap_is_within_the_tolerance(gap: float, tol: float, rank: int) -> None:
    best = -1.0
    candidates = tuple((TOKENS[DIVERGE] if k == 0 else 500 + k, best - (gap if k == rank else gap * k / rank))
                       for k in range(TIE_CANDIDATES))
    verdict = first_divergence_is_a_tie(rerun(candidates), [1, 2], with_token(500 + rank), tol)  # type: ignore[arg-type]
    if (best - candidates[rank][1]) <= tol:
        assert verdict is None
    else:
        assert verdict is not None and f"token {DIVERGE}," in verdict and "tie tolerance" in verdict


def test_a_token_outside_the_candidates_fails_whatever_the_tolerance() -> None:
    candidates = ((12, -1.0), (40, -1.0078125), (41, -1.5), (42, -2.0), (43, -3.0))
    assert first_divergence_is_a_tie(rerun(candidates), [1], with_token(40), 2.0**-4) is None  # type: ignore[arg-type]
    verdict = first_divergence_is_a_tie(rerun(candidates), [1], with_token(99), 1e9)  # type: ignore[arg-type]
    assert verdict is not None and "99 is not among" in verdict and f"token {DIVERGE}:" in verdict


def test_length_and_missing_logprobs_are_differences() -> None:
    candidates = ((12, -1.0), (40, -1.0))
    ctx = rerun(candidates)
    assert first_divergence_is_a_tie(ctx, [1], TOKENS, 0.0) is None  # type: ignore[arg-type]
    assert first_divergence_is_a_tie(ctx, [1], TOKENS[:2], 1.0) == "2 tokens against 4 unpinned"  # type: ignore[arg-type]
    bare = SimpleNamespace(complete=lambda p, **kw: Completion(len(p), 0, TOKENS, "", 0.0, 0.0))
    verdict = first_divergence_is_a_tie(bare, [1], with_token(40), 1.0)  # type: ignore[arg-type]
    assert verdict is not None and "no top-2 logprobs" in verdict


def test_logprob_keys_name_token_ids_only_in_vllms_form() -> None:
    assert [_token_id(k) for k in ("token_id:17", "token_id:0", "hello", "token_id:", "token_id:-3", ":5")] == [
        17, 0, -1, -1, -1, -1]


def test_tie_nats_option() -> None:
    args = parse_args(["--target", "h:1", "--tie-nats", "0.001"])
    assert args.tie_nats == 0.001
    assert parse_args(["--target", "h:1"]).tie_nats == Options.tie_nats == 2.0**-4


@pytest.mark.parametrize("bad", ["-0.1", "nan", "inf"])
def test_a_bad_tie_tolerance_is_a_usage_error(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--target", "h:1", "--tie-nats", bad], out=io.StringIO()) == 2
    assert f"--tie-nats {float(bad)!r}: expected a finite number of nats >= 0" in capsys.readouterr().err
