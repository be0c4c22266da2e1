"""The gRPC surface of the in-engine sidecar: bad input, health, reflection
from a non-Python client (buf curl), pagination and idempotency."""

from __future__ import annotations

import json
import shutil
import subprocess

import grpc
import pytest
from engine_support import Engine, pin, release, resume_scenario, session_sel, tokens
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvhint.v1 import kvhint_pb2 as pb

pytestmark = pytest.mark.engine

APPLY = "/kvhint.v1.KvHintService/ApplyHints"


def error_info(err: grpc.RpcError) -> error_details_pb2.ErrorInfo:
    status = rpc_status.from_call(err)
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    return info


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=300))
def test_arbitrary_bytes_get_invalid_argument_or_per_hint_results(engine: Engine, raw: bytes) -> None:
    call = engine.channel.unary_unary(APPLY, request_serializer=None, response_deserializer=pb.ApplyHintsResponse.FromString)
    try:
        response = call(raw, timeout=10)
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
        info = error_info(err)
        assert info.domain == "kvhint.v1" and info.reason.startswith("REASON_")
        return
    request = pb.ApplyHintsRequest.FromString(raw)
    assert len(response.results) == len(request.hints)
    for hint, result in zip(request.hints, response.results):
        assert result.outcome != pb.OUTCOME_UNSPECIFIED
        assert result.hint_id == hint.hint_id


def hints() -> st.SearchStrategy[pb.Hint]:
    ids = st.one_of(st.just(""), st.text(max_size=8), st.text(min_size=250, max_size=300))
    selector = st.one_of(
        st.builds(lambda s, c: pb.Selector(session=pb.SessionSelector(session_id=s, include_children=c)), ids, st.booleans()),
        st.builds(lambda c: pb.Selector(continuation=pb.ContinuationSelector(continuation_id=c)), ids),
        st.builds(lambda hs: pb.Selector(block_hashes=pb.BlockHashSelector(block_hashes=hs)), st.lists(st.binary(max_size=70), max_size=4)),
        st.just(pb.Selector()),
    )
    ttl = st.builds(lambda s, n: {"seconds": s, "nanos": n}, st.integers(-10, 10**7), st.integers(-(10**9), 10**9))
    action = st.one_of(
        st.builds(lambda t: {"pin": pb.PinAction(ttl=t)}, ttl),
        st.builds(lambda p, t: {"retain": pb.RetainAction(priority=p, ttl=t)}, st.integers(-(2**31), 2**31 - 1), ttl),
        st.just({"release": pb.ReleaseAction()}),
        st.just({"evict": pb.EvictAction()}),
        st.builds(lambda t: {"demote": pb.DemoteAction(target_tier=t)}, st.integers(0, 7)),
        st.just({"prefetch": pb.PrefetchAction()}),
        st.builds(lambda d: {"share": pb.ShareAction(destination=d)}, ids),
        st.just({}),
    )
    return st.builds(
        lambda hid, sel, act, mb: pb.Hint(hint_id=hid, selector=sel, max_blocks=mb, **act),
        st.one_of(st.just(""), st.text(max_size=200)),
        selector,
        action,
        st.integers(0, 2**32 - 1),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(hints(), max_size=6))
def test_structured_bad_hints_are_rejected_per_hint_and_the_engine_keeps_serving(engine: Engine, batch: list[pb.Hint]) -> None:
    try:
        response = engine.stub.ApplyHints(pb.ApplyHintsRequest(hints=batch), timeout=10)
    except grpc.RpcError as err:
        assert not batch and err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_info(err).metadata["field"] == "hints"
        return
    assert len(response.results) == len(batch)
    for result in response.results:
        if result.outcome == pb.OUTCOME_REJECTED:
            assert result.reason != pb.REASON_UNSPECIFIED and result.message


def test_engine_still_serves_after_bad_input(engine: Engine) -> None:
    # Runs after the two property tests above (file order).
    prompt = tokens("after-bad-input")
    assert engine.complete(prompt, "after-bad-input").prompt_tokens == 720
    assert engine.complete(prompt, "after-bad-input").cached_tokens == 704


def test_too_many_hints_is_invalid_argument(engine: Engine) -> None:
    limit = engine.stub.GetCapabilities(pb.GetCapabilitiesRequest()).limits.max_hints_per_batch
    with pytest.raises(grpc.RpcError) as err:
        engine.stub.ApplyHints(pb.ApplyHintsRequest(hints=[release("x")] * (limit + 1)), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(err.value).reason == "REASON_TOO_MANY_HINTS"


def test_capabilities_describe_the_engine(engine: Engine) -> None:
    caps = engine.stub.GetCapabilities(pb.GetCapabilitiesRequest())
    assert caps.protocol_version == "kvhint.v1" and caps.engine == "vllm" and caps.engine_version == "0.32.0"
    assert caps.block_size == 32 and caps.num_device_blocks == 80
    assert caps.tiers[0].tier == pb.TIER_DEVICE and caps.tiers[0].medium == "GPU"
    supported = {a.action for a in caps.actions if a.supported}
    assert supported == {pb.ACTION_RETAIN, pb.ACTION_PIN, pb.ACTION_RELEASE, pb.ACTION_EVICT}
    unsupported = [a for a in caps.actions if not a.supported]
    assert {a.action for a in unsupported} == {pb.ACTION_DEMOTE, pb.ACTION_PREFETCH, pb.ACTION_SHARE}
    (result,) = engine.apply(pb.Hint(selector=session_sel("any"), demote=pb.DemoteAction()))
    assert result.outcome == pb.OUTCOME_REJECTED and result.reason == pb.REASON_UNSUPPORTED
    assert caps.limits.max_ttl.seconds == 3600 and caps.event_replay_window == 10_000


def test_capabilities_list_the_kv_cache_groups(any_engine: Engine) -> None:
    """Dense: one full-attention group. Hybrid (Gemma 2): a sliding-window group of
    128 tokens and a full-attention group, which alone defines residency."""
    groups = any_engine.stub.GetCapabilities(pb.GetCapabilitiesRequest()).kv_cache_groups
    kinds = sorted((g.kind, g.sliding_window_tokens, g.defines_residency, g.block_size) for g in groups)
    full = (pb.KvCacheGroup.KIND_FULL_ATTENTION, 0, True, 32)
    window = (pb.KvCacheGroup.KIND_SLIDING_WINDOW, 128, False, 32)
    hybrid = any_engine.served.spec.model.rstrip("/").endswith("hybrid")
    assert kinds == ([full, window] if hybrid else [full])
    assert sorted(g.group_id for g in groups) == list(range(len(groups)))


def test_health_service_reports_serving(engine: Engine) -> None:
    stub = health_pb2_grpc.HealthStub(engine.channel)
    for service in ("", "kvhint.v1.KvHintService"):
        assert stub.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING


def test_non_python_client_through_reflection(engine: Engine) -> None:
    buf = shutil.which("buf")
    assert buf, "buf (PyPI buf-bin) is a dev dependency"
    url = f"http://{engine.grpc_address}/kvhint.v1.KvHintService/GetCapabilities"
    out = subprocess.run([buf, "curl", "--protocol", "grpc", "--http2-prior-knowledge", url], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    caps = json.loads(out.stdout)
    assert caps["protocolVersion"] == "kvhint.v1" and caps["blockSize"] == 32
    engine.complete(tokens("buf-curl"), "buf-curl")
    body = json.dumps({"hints": [{"hintId": "buf-1", "selector": {"session": {"sessionId": "buf-curl"}}, "pin": {"ttl": "30s"}}]})
    out = subprocess.run(
        [buf, "curl", "--protocol", "grpc", "--http2-prior-knowledge", "-d", body, url.replace("GetCapabilities", "ApplyHints")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["results"][0]["outcome"] == "OUTCOME_ACCEPTED"
    engine.apply(release("buf-curl"))


def test_issue_scenario_through_the_openai_api_and_buf_curl(any_clean: Engine, request: pytest.FixtureRequest) -> None:
    """Issue 12's scenario as a router not written in Python runs it (scripts/resume_scenario.py:
    plain HTTP for the OpenAI API, `buf curl` for Pin and Release), on the dense and the hybrid
    model: the pinned session's resume keeps the hit it has with no pressure (dense: all 512
    tokens; hybrid: 480, the cached window tail ends a block early), and the unhinted control loses it."""
    out = resume_scenario(any_clean, tag=f"wire-{request.node.callspec.id}")
    assert out["pin_outcome"] == "OUTCOME_ACCEPTED" and out["pin_device_blocks"] == 16  # logical blocks
    assert out["pinned_resume_cached_tokens"] == out["reference_cached_tokens"] >= 480
    assert out["control_resume_cached_tokens"] == 0 and out["release_outcome"] == "OUTCOME_ACCEPTED"


def test_idempotent_hint_ids(clean: Engine) -> None:
    clean.complete(tokens("idem"), "idem")
    first = clean.apply(pin("idem", ttl=30, hint_id="idem-1"))[0]
    again = clean.apply(pin("idem", ttl=30, hint_id="idem-1"))[0]
    assert first.outcome == again.outcome == pb.OUTCOME_ACCEPTED
    assert again.replayed and not first.replayed
    conflict = clean.apply(pin("idem", ttl=99, hint_id="idem-1"))[0]
    assert conflict.outcome == pb.OUTCOME_REJECTED and conflict.reason == pb.REASON_HINT_ID_CONFLICT
    clean.apply(release("idem"))


def test_residency_pages_and_sessions(clean: Engine) -> None:
    for s in ("page-a", "page-b", "page-c"):
        clean.complete(tokens(s), s, continuation_id=f"{s}/1")
    seen: list[bytes] = []
    token = ""
    while True:
        page = clean.stub.QueryResidency(pb.QueryResidencyRequest(selector=session_sel("page-b"), page_size=5, page_token=token))
        seen += [b.block_hash for b in page.blocks]
        assert page.totals[0].blocks == 22
        token = page.next_page_token
        if not token:
            break
    assert len(seen) == 22 == len(set(seen))
    continuation = clean.stub.QueryResidency(
        pb.QueryResidencyRequest(selector=pb.Selector(continuation=pb.ContinuationSelector(continuation_id="page-b/1")))
    )
    assert [b.block_hash for b in continuation.blocks] == seen
    ranged = clean.stub.QueryResidency(
        pb.QueryResidencyRequest(selector=pb.Selector(session=pb.SessionSelector(session_id="page-b"), range=pb.BlockRange(start=2, end=5)))
    )
    assert [b.position for b in ranged.blocks] == [2, 3, 4]
    names = [s.session_id for s in clean.stub.ListSessions(pb.ListSessionsRequest(page_size=2)).sessions]
    assert names == ["page-a", "page-b"]
    with pytest.raises(grpc.RpcError) as err:
        clean.stub.QueryResidency(pb.QueryResidencyRequest(selector=session_sel("page-a"), page_token="garbage"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_child_sessions_are_selected_with_include_children(clean: Engine) -> None:
    parent = tokens("parent", 320)
    clean.complete(parent, "parent")
    clean.complete(parent + tokens("child-1", 320), "child-1", parent_session_id="parent")
    sel = pb.Selector(session=pb.SessionSelector(session_id="parent", include_children=True))
    both = clean.stub.QueryResidency(pb.QueryResidencyRequest(selector=sel))
    alone = clean.stub.QueryResidency(pb.QueryResidencyRequest(selector=session_sel("parent")))
    assert len(alone.blocks) == 10 and len(both.blocks) == 20
    info = {s.session_id: s for s in clean.stub.ListSessions(pb.ListSessionsRequest()).sessions}
    assert info["child-1"].parent_session_id == "parent"


def test_unknown_operation_is_not_found(engine: Engine) -> None:
    with pytest.raises(grpc.RpcError) as err:
        engine.stub.GetOperation(pb.GetOperationRequest(operation_id="op-nope"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert error_info(err.value).reason == "REASON_NOT_FOUND"
