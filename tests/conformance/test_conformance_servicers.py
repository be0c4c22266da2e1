"""The conformance suite against servicers without an engine (fast): the real KvHintServer over a
fake engine adapter (tests/unit), fault-injecting proxies in front of it, and a scripted fake
servicer (tests/client). No OpenAI endpoint is given, so only cases without traffic apply; the
faults that need traffic to be seen are checked against a served engine in
test_conformance_engine.py.

What this proves: profiles turn "not advertised" into failures (a servicer that advertises no
actions fails instead of passing by skipping), a target whose hints publish no events fails the
replay-window case, and dropped or repeated events are caught by the gap-free stream case.
"""

from __future__ import annotations

import io
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conformance.cases import REGISTRY
from conformance.runner import main, read_known_failing
from conformance.testing.fault_proxy import FaultProxy
from conformance.testing.vllm_ci import KNOWN_FAILING

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS / "unit"), str(TESTS / "client")]

from fake_kvhint_server import FakeKvHint, start_fake_server  # noqa: E402
from kvhint_unit_support import Harness, local_engine_info  # noqa: E402

from kvhint.v1 import kvhint_pb2 as pb  # noqa: E402
from kvhint_server.model import Action, ActionSupport, EngineInfo  # noqa: E402

S = "kvhint.v1/"
GAP_FREE = S + "events/unfiltered-stream-gap-free"


def run(target: str, *extra: str) -> tuple[int, str]:
    out = io.StringIO()
    rc = main(["--target", target, "--rpc-timeout", "10", *extra], out=out)
    return rc, out.getvalue()


def lines(text: str, label: str) -> dict[str, str]:
    return dict(re.findall(rf"^{label}: (\S+): (.*)$", text, re.M))


@pytest.fixture
def server() -> Iterator[Harness]:
    """The real servicer over a fake engine advertising Retain/Pin/Release/Evict on every selector."""
    harness = Harness(local_engine_info(), event_replay_window=64)
    try:
        yield harness
    finally:
        harness.close()


def no_actions_info() -> EngineInfo:
    info = local_engine_info()
    return EngineInfo(**{**{f: getattr(info, f) for f in info.__dataclass_fields__},
                         "actions": tuple(ActionSupport(a, False, notes="nothing") for a in Action)})


def test_core_profile_passes_and_the_tiers_profile_fails_on_a_core_servicer(server: Harness) -> None:
    address = f"127.0.0.1:{server.port}"
    rc, text = run(address, "--run", "capabilities/profile-")
    assert rc == 0, text
    assert lines(text, "SKIPPED") == {S + "capabilities/profile-tiers":
                                      "the run claims the 'core' profile (--profile), which does not include 'tiers'"}
    rc, text = run(address, "--profile", "tiers", "--run", "capabilities/profile-|outcomes/demote-session-missing")
    assert rc == 1, text
    failed = lines(text, "FAILED")
    assert set(failed) == {S + "capabilities/profile-tiers", S + "outcomes/demote-session-missing"}, text
    assert "demote:session, prefetch:session, share:session" in failed[S + "capabilities/profile-tiers"]
    assert "the 'tiers' profile requires demote:session" in failed[S + "outcomes/demote-session-missing"]


def test_a_servicer_that_advertises_no_actions_fails_instead_of_skipping() -> None:
    harness = Harness(no_actions_info())
    try:
        rc, text = run(f"127.0.0.1:{harness.port}", "--skip", "requirements/")
    finally:
        harness.close()
    assert rc == 1, text
    failed = lines(text, "FAILED")
    for action in ("retain", "pin", "release", "evict"):
        assert S + f"outcomes/{action}-session-accepted" in failed, text
        assert S + f"outcomes/{action}-session-missing" in failed, text
    assert S + "capabilities/profile-core" in failed
    assert S + "events/resume-outside-window-resync" in failed
    assert GAP_FREE in failed
    # Actions outside the profile (and selectors other than session) still skip.
    skipped = lines(text, "SKIPPED")
    assert skipped[S + "outcomes/demote-session-missing"] == "not advertised by the target: demote:session"
    assert skipped[S + "outcomes/pin-continuation-missing"] == "not advertised by the target: pin:continuation"


def test_the_real_servicer_passes_the_stream_and_window_cases(server: Harness) -> None:
    rc, text = run(f"127.0.0.1:{server.port}", "--run", "unfiltered-stream-gap-free|resume-outside-window", "-v")
    assert rc == 0, text
    assert re.search(rf"^PASSED +{re.escape(GAP_FREE)} ", text, re.M), text
    assert re.search(rf"^PASSED +{re.escape(S)}events/resume-outside-window-resync ", text, re.M), text


@pytest.mark.parametrize("fault", ["drop-events", "repeat-sequence"])
def test_lost_or_repeated_events_are_caught_by_the_gap_free_case(server: Harness, fault: str) -> None:
    with FaultProxy(f"127.0.0.1:{server.port}", [fault]) as proxy:
        rc, text = run(proxy.address, "--run", "unfiltered-stream-gap-free")
    assert rc == 1, text
    assert GAP_FREE in lines(text, "FAILED"), text


class SilentSequence(FakeKvHint):
    """Applies hints but publishes no events: applied_at_sequence never moves."""

    def __init__(self) -> None:
        super().__init__()
        self.capabilities.event_replay_window = 32
        self.capabilities.limits.max_hints_per_batch = 64
        self.capabilities.actions.add(action=pb.ACTION_RELEASE, supported=True, selectors=[pb.SELECTOR_KIND_SESSION])

    def ApplyHints(self, request, context):  # noqa: N802 - gRPC method name
        response = super().ApplyHints(request, context)
        self.sequence = 100
        response.applied_at_sequence = 100
        return response


def test_no_hint_applied_events_fail_the_replay_window_case() -> None:
    fake = start_fake_server(SilentSequence())
    try:
        rc, text = run(fake.address, "--run", "resume-outside-window")
    finally:
        fake.stop()
    assert rc == 1, text
    reason = lines(text, "FAILED")[S + "events/resume-outside-window-resync"]
    # It says what the target did not do, for hints it answered (MISSING ones included), and the rule.
    assert "the target published no HintApplied for the hints it answered" in reason, text
    assert "every hint an ApplyHints call answers is published as one HintApplied event" in reason, text


def test_known_failing_list_names_registered_cases() -> None:
    """Every entry of the vLLM known-failing list matches a case (the runner refuses the list
    otherwise); that each still fails is checked by the engine run (a passing entry is stale)."""
    patterns = read_known_failing(str(KNOWN_FAILING), REGISTRY)
    assert all(any(re.fullmatch(p.replace("*", ".*"), i) for i in REGISTRY.ids()) for p in patterns)


def test_every_fault_is_expected_to_be_caught_by_registered_cases() -> None:
    """The engine test's fault table covers every fault the proxy offers, naming real cases."""
    from test_conformance_engine import CAUGHT_BY  # same folder; the module starts no engine on import

    from conformance.testing.fault_proxy import FAULTS

    assert set(CAUGHT_BY) == set(FAULTS)
    ids = set(REGISTRY.ids())
    for fault, cases in CAUGHT_BY.items():
        assert cases and set(cases) <= ids, (fault, sorted(set(cases) - ids))
