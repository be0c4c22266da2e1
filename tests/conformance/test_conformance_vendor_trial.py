"""Suite defects an engine vendor's trial found (a minimal servicer of their own, with injected
MUST violations): violations that passed, and failures that blamed the wrong thing. Each test runs
the real servicer over the fake engine (tests/unit), where the case passes, and a broken servicer
(a FaultProxy subclass in front of it, or the scripted fake servicer of tests/client), where it
now fails, saying why. No engine.

* A HintResult's affected_blocks split into one DEVICE:1 entry per block plus HOST:0, and a reason
  on ACCEPTED, passed (hints.device_blocks summed the entries).
* GetOperation with an empty or over-long id answered NOT_FOUND, and WatchEvents START_RESUME
  with an empty or over-long resume_epoch answered a Resync, both instead of INVALID_ARGUMENT.
* A target that publishes no HintApplied for the MISSING Release the suite reads the sequence
  with was told its heartbeats run ahead of the latest sequence.
* The continuation cases failed a target that advertises no continuation selector at all.
* A ranged hint answered MISSING where supports_range is false: the failure now cites the rule.
* A hint with an unadvertised action, selector kind or range answered REJECTED/UNSUPPORTED was
  failed for not being INVALID_HINT.
* Random undecodable payloads answered INTERNAL (a stub-generated grpcio servicer's default) did not
  name the code.
* The JUnit report did not say which profile the run claimed.
"""

from __future__ import annotations

import contextlib
import re
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS / "unit"), str(TESTS / "client")]

from fake_kvhint_server import HANG, start_fake_server  # noqa: E402
from fake_openai import openai_over  # noqa: E402
from kvhint_unit_support import Harness, local_engine_info  # noqa: E402
from test_conformance_servicers import SilentSequence, lines, run  # noqa: E402

from conformance import hints as H  # noqa: E402
from conformance.report import RunInfo, junit_xml  # noqa: E402
from conformance.testing.fault_proxy import SERVICE, WATCH, FaultProxy  # noqa: E402
from kvhint.v1 import kvhint_pb2 as pb  # noqa: E402
from kvhint_server.model import EngineInfo, SelectorKind  # noqa: E402

S = "kvhint.v1/"
GET_OPERATION = SERVICE + "GetOperation"


def session_only_info() -> EngineInfo:
    """The fake engine advertising its actions on session selectors only, without ranges (the
    vendor's core-profile engine)."""
    info = local_engine_info(num_device_blocks=64)
    actions = tuple(
        type(a)(a.action, a.supported, (SelectorKind.SESSION,) if a.supported else (), supports_range=False, notes=a.notes)
        for a in info.actions
    )
    return EngineInfo(**{**{f: getattr(info, f) for f in info.__dataclass_fields__}, "actions": actions})


@pytest.fixture
def server() -> Iterator[Harness]:
    harness = Harness(local_engine_info(num_device_blocks=64))
    try:
        yield harness
    finally:
        harness.close()


@pytest.fixture
def session_only() -> Iterator[Harness]:
    harness = Harness(session_only_info())
    try:
        yield harness
    finally:
        harness.close()


def passes(address: str, case: str, *extra: str) -> None:
    rc, text = run(address, "--run", case, "-v", *extra)
    assert rc == 0 and re.search(rf"^PASSED +{re.escape(S + case)} ", text, re.M), text


def failure(address: str, case: str, *extra: str) -> str:
    rc, text = run(address, "--run", case, *extra)
    assert rc == 1, text
    return lines(text, "FAILED")[S + case]


def caught(harness: Harness, case: str, proxy: type[FaultProxy], *, traffic: bool = False) -> str:
    """`case` passes against `harness`'s servicer and fails through `proxy` in front of it (with
    the fake OpenAI endpoint when it needs `traffic`): the failure's reason."""
    target = f"127.0.0.1:{harness.port}"
    with contextlib.ExitStack() as stack:
        extra = ("--openai-url", stack.enter_context(openai_over(harness.engine))) if traffic else ()
        passes(target, case, *extra)
        with proxy(target) as broken:
            return failure(broken.address, case, *extra)


# -- HintResult form ----------------------------------------------------------------------------


class SplitAffected(FaultProxy):
    """affected_blocks as one DEVICE:1 entry per block, plus HOST:0 (the totals still add up)."""

    def _rewrite_result(self, result: pb.HintResult, hint: pb.Hint) -> None:
        device = H.device_blocks(result)
        if device:
            del result.affected_blocks[:]
            for _ in range(device):
                result.affected_blocks.add(tier=pb.TIER_DEVICE, blocks=1)
            result.affected_blocks.add(tier=pb.TIER_HOST, blocks=0)


class ReasonOnAccepted(FaultProxy):
    """ACCEPTED results carry REASON_MAX_BLOCKS."""

    def _rewrite_result(self, result: pb.HintResult, hint: pb.Hint) -> None:
        if result.outcome == pb.OUTCOME_ACCEPTED:
            result.reason = pb.REASON_MAX_BLOCKS


@pytest.mark.parametrize(("proxy", "said"), [
    (SplitAffected, "affected_blocks [DEVICE:1, DEVICE:1, DEVICE:1, HOST:0] has an entry with 0 blocks"),
    (ReasonOnAccepted, "ACCEPTED with reason MAX_BLOCKS (HintResult.reason is REASON_UNSPECIFIED for ACCEPTED and DEFERRED)"),
])
def test_a_malformed_accepted_result_fails_the_outcome_case(server: Harness, proxy: type[FaultProxy], said: str) -> None:
    case = "outcomes/pin-session-accepted"
    reason = caught(server, case, proxy, traffic=True)
    assert said in reason, reason


def test_a_split_affected_count_fails_the_clipping_case(server: Harness) -> None:
    case = "clipping/pin-max-blocks"
    reason = caught(server, case, SplitAffected, traffic=True)
    assert "affected_blocks [DEVICE:1, HOST:0] has an entry with 0 blocks" in reason, reason


TIERS = st.sampled_from([pb.TIER_DEVICE, pb.TIER_HOST, pb.TIER_DISK, pb.TIER_REMOTE])


@given(st.dictionaries(TIERS, st.integers(1, 10_000), max_size=4), st.sampled_from(list(pb.Outcome.values())))
def test_a_well_formed_result_has_no_problem(counts: dict[int, int], outcome: int) -> None:
    reason = pb.REASON_UNSPECIFIED if outcome in (pb.OUTCOME_ACCEPTED, pb.OUTCOME_DEFERRED) else pb.REASON_NOT_RESIDENT
    result = pb.HintResult(outcome=outcome, reason=reason,  # type: ignore[arg-type]
                           affected_blocks=[pb.TierBlockCount(tier=t, blocks=n) for t, n in sorted(counts.items())])  # type: ignore[arg-type]
    assert H.result_form_problems(result) == []


@given(st.lists(st.tuples(TIERS, st.integers(0, 5)), min_size=1, max_size=6))
def test_every_malformed_affected_list_is_named(entries: list[tuple[int, int]]) -> None:
    result = pb.HintResult(outcome=pb.OUTCOME_ACCEPTED,
                           affected_blocks=[pb.TierBlockCount(tier=t, blocks=n) for t, n in entries])  # type: ignore[arg-type]
    tiers = [t for t, _ in entries]
    well_formed = all(n > 0 for _, n in entries) and tiers == sorted(set(tiers))
    problems = H.result_form_problems(result)
    assert (problems == []) == well_formed, (entries, problems)


@pytest.mark.parametrize("outcome", [pb.OUTCOME_ACCEPTED, pb.OUTCOME_DEFERRED])
def test_a_reason_on_accepted_or_deferred_is_named(outcome: int) -> None:
    result = pb.HintResult(outcome=outcome, reason=pb.REASON_MAX_BLOCKS)  # type: ignore[arg-type]
    name = H.outcome_name(outcome)
    assert H.result_form_problems(result) == [
        f"{name} with reason MAX_BLOCKS (HintResult.reason is REASON_UNSPECIFIED for ACCEPTED and DEFERRED)"]


# -- request-level ids --------------------------------------------------------------------------


class LaxRequestIds(FaultProxy):
    """A servicer that does not validate request-level ids: GetOperation with an empty or over-long
    id looks it up (NOT_FOUND), and START_RESUME with an empty or over-long resume_epoch compares it
    with the current epoch (a Resync, CAUSE_EPOCH_CHANGED)."""

    LIMIT = 256

    def rewrite_request(self, method: str, raw: bytes) -> bytes:
        if method == GET_OPERATION:
            request = pb.GetOperationRequest.FromString(raw)
            if not request.operation_id or len(request.operation_id) > self.LIMIT:
                return pb.GetOperationRequest(operation_id="lax-no-such-operation").SerializeToString()
        if method == WATCH:
            request = pb.WatchEventsRequest.FromString(raw)
            if request.start == pb.WatchEventsRequest.START_RESUME and (
                    not request.resume_epoch or len(request.resume_epoch) > self.LIMIT):
                request.resume_epoch = "lax-epoch"
                return request.SerializeToString()
        return raw


def test_a_malformed_operation_id_must_be_invalid_argument(server: Harness) -> None:
    case = "bad-input/malformed-operation-id-invalid-argument"
    reason = caught(server, case, LaxRequestIds)
    assert reason == "GetOperation with an empty operation_id: failed with NOT_FOUND, expected INVALID_ARGUMENT", reason


def test_a_resume_without_epoch_must_be_invalid_argument(server: Harness) -> None:
    case = "bad-input/resume-without-epoch-invalid-argument"
    reason = caught(server, case, LaxRequestIds)
    assert reason == ("WatchEvents START_RESUME with an empty resume_epoch: the stream ended without an error after "
                      "['resync'], expected INVALID_ARGUMENT"), reason


class OnlyOverlongIdsLax(LaxRequestIds):
    """Empty ids refused, over-long ones looked up: the limit half of each case."""

    def rewrite_request(self, method: str, raw: bytes) -> bytes:
        if method == GET_OPERATION and not pb.GetOperationRequest.FromString(raw).operation_id:
            return raw
        if method == WATCH and not pb.WatchEventsRequest.FromString(raw).resume_epoch:
            return raw
        return super().rewrite_request(method, raw)


def test_an_over_long_request_id_must_be_invalid_argument(server: Harness) -> None:
    with OnlyOverlongIdsLax(f"127.0.0.1:{server.port}") as broken:
        reason = failure(broken.address, "bad-input/malformed-operation-id-invalid-argument")
        assert reason.startswith("GetOperation with an operation_id of 257 bytes (limits.max_id_length 256): failed with "
                                 "NOT_FOUND"), reason
        reason = failure(broken.address, "bad-input/resume-without-epoch-invalid-argument")
        assert reason.startswith("WatchEvents START_RESUME with a resume_epoch of 257 bytes"), reason


# -- HintApplied for every answered hint ---------------------------------------------------------


def test_no_hint_applied_for_the_sequence_probe_is_said_plainly_not_blamed_on_heartbeats() -> None:
    """A servicer whose ApplyHints publishes nothing (applied_at_sequence stays) and whose
    heartbeats carry that latest sequence, correctly: the heartbeat case used to report
    "heartbeats carry sequences at or past that of the event applied after them"."""
    fake = SilentSequence()
    heartbeat = pb.WatchEventsResponse(epoch="E1", sequence=100, heartbeat=pb.Heartbeat())
    fake.watch_scripts = [[heartbeat, heartbeat, HANG], [heartbeat, heartbeat, HANG]]
    served = start_fake_server(fake)
    try:
        reason = failure(served.address, "events/heartbeat-carries-latest-sequence")
    finally:
        served.stop()
    assert reason.startswith("the target published no HintApplied for a hint it answered (ACCEPTED"), reason
    assert "applied_at_sequence stayed at 100 (was 100)" in reason
    assert "every hint an ApplyHints call answers is published as one HintApplied event, whatever its outcome" in reason
    assert "heartbeats carry" not in reason


# -- capabilities the cases need ------------------------------------------------------------------

CONTINUATION_CASES = ("selectors/continuation-resolves-prefix-chain", "queries/list-sessions-reports-session")


def test_continuation_cases_skip_without_a_continuation_selector(server: Harness, session_only: Harness) -> None:
    pattern = "|".join(CONTINUATION_CASES)
    with openai_over(server.engine) as url:
        rc, text = run(f"127.0.0.1:{server.port}", "--openai-url", url, "--run", pattern, "-v")
    assert rc == 0 and all(re.search(rf"^PASSED +{re.escape(S + c)} ", text, re.M) for c in CONTINUATION_CASES), text
    with openai_over(session_only.engine) as url:
        rc, text = run(f"127.0.0.1:{session_only.port}", "--openai-url", url, "--run", pattern, "-v")
    assert rc == 0, text
    skipped = lines(text, "SKIPPED")
    for case in CONTINUATION_CASES:
        assert skipped[S + case] == "not advertised by the target: selector:continuation", text


class RangedAsMissing(FaultProxy):
    """A ranged hint the engine refuses (REJECTED/UNSUPPORTED) answered as if its selector had been
    resolved first: MISSING/NOT_RESIDENT."""

    def _rewrite_result(self, result: pb.HintResult, hint: pb.Hint) -> None:
        if hint.selector.HasField("range") and result.reason == pb.REASON_UNSUPPORTED:
            result.outcome, result.reason, result.message = pb.OUTCOME_MISSING, pb.REASON_NOT_RESIDENT, "nothing resident"


def test_a_ranged_hint_answered_missing_cites_the_rule(session_only: Harness) -> None:
    case = "selectors/range-unadvertised-unsupported"
    reason = caught(session_only, case, RangedAsMissing)
    assert "expected REJECTED/UNSUPPORTED: a hint rejected for its form (INVALID_HINT, UNSUPPORTED) is rejected before " \
           "its selector is resolved, so it is never MISSING" in reason, reason


class SupportFirst(FaultProxy):
    """Support is checked before form: a hint with a continuation or block-hash selector, or a
    range, that the engine rejected INVALID_HINT is answered REJECTED/UNSUPPORTED."""

    def _rewrite_result(self, result: pb.HintResult, hint: pb.Hint) -> None:
        unusual = hint.selector.WhichOneof("target") in ("continuation", "block_hashes") or hint.selector.HasField("range")
        if unusual and result.outcome == pb.OUTCOME_REJECTED and result.reason == pb.REASON_INVALID_HINT:
            result.reason, result.message = pb.REASON_UNSUPPORTED, "not supported"


def test_unadvertised_kinds_may_be_unsupported_before_invalid(session_only: Harness, server: Harness) -> None:
    case = "bad-input/invalid-hints-rejected-per-hint"
    passes(f"127.0.0.1:{session_only.port}", case)
    with SupportFirst(f"127.0.0.1:{session_only.port}") as lenient:
        passes(lenient.address, case)
    # Where the kind is advertised, INVALID_HINT stays required.
    with SupportFirst(f"127.0.0.1:{server.port}") as broken:
        reason = failure(broken.address, case)
    assert re.search(r": REJECTED/UNSUPPORTED 'not supported', expected REJECTED/INVALID_HINT$", reason), reason


# -- undecodable requests -------------------------------------------------------------------------


class _Internal(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.INTERNAL

    def details(self) -> str:
        return "Exception deserializing request!"

    def trailing_metadata(self) -> tuple[()]:
        return ()


class StubGenerated(FaultProxy):
    """Undecodable ApplyHints requests answered INTERNAL, as a stub-generated grpcio servicer does."""

    def apply_hints(self, raw: bytes, timeout: float | None) -> bytes:
        try:
            pb.ApplyHintsRequest.FromString(raw)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError
            raise _Internal() from exc
        return super().apply_hints(raw, timeout)


def test_payloads_answered_internal_name_the_code(server: Harness) -> None:
    case = "bad-input/engine-serves-after-bad-input"
    reason = caught(server, case, StubGenerated, traffic=True)
    assert re.fullmatch(r"\d+ of 200 random ApplyHints payloads failed with INTERNAL \(\d+\), expected INVALID_ARGUMENT",
                        reason), reason


# -- the JUnit report ------------------------------------------------------------------------------


def _properties(xml: bytes) -> dict[str, str]:
    suite = ET.fromstring(xml).find("testsuite")
    assert suite is not None
    return {p.get("name", ""): p.get("value", "") for p in suite.findall("properties/property")}


def test_junit_properties_name_the_claimed_profile() -> None:
    for profile in ("core", "tiers"):
        props = _properties(junit_xml([], RunInfo("h:1", "", "acme 0.1", "e1", "", 1.0, "n", profile)))
        assert props["profile"] == profile and props["target"] == "h:1" and props["engine"] == "acme 0.1", props


def test_a_runs_junit_report_says_profile_target_and_engine(server: Harness, tmp_path: Path) -> None:
    report = tmp_path / "report.xml"
    target = f"127.0.0.1:{server.port}"
    rc, text = run(target, "--profile", "tiers", "--run", "capabilities/protocol-version", "--junit-xml", str(report))
    assert rc == 0, text
    props = _properties(report.read_bytes())
    assert (props["profile"], props["target"], props["engine"]) == ("tiers", target, "fake 0"), props
