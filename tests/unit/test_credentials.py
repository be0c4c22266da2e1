"""A call presents one `authorization` header (kvhint_server/credentials.py): the auth check and
the rate limiter read the same one. Real server over loopback, fake engine."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kvhint.v1 import kvhint_pb2 as pb

from kvhint_unit_support import Harness, local_engine_info, retain

TOKEN = (("authorization", "Bearer s3cret"),)


def _calls_admitted(harness: Harness, metadata_of, n: int) -> int:
    admitted = 0
    for i in range(n):
        try:
            harness.stub.ApplyHints(pb.ApplyHintsRequest(hints=[retain("a", 1)]), metadata=metadata_of(i), timeout=5)
            admitted += 1
        except grpc.RpcError as err:
            assert err.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED), err
    return admitted


def test_a_repeated_authorization_header_is_unauthenticated_and_buys_no_rate_bucket(make_harness) -> None:
    """With the token sent last and a different value first each time, the token check read the last
    value and the rate limiter keyed its bucket by the first: every call got a fresh burst."""
    harness = make_harness(auth_token="s3cret", rate_limit_hints_per_s=1, rate_limit_burst=2)
    assert _calls_admitted(harness, lambda i: TOKEN, 10) == 2  # the token's own bucket
    repeated = lambda i: (("authorization", f"junk-{i}"), *TOKEN)  # noqa: E731
    with pytest.raises(grpc.RpcError) as err:
        harness.stub.GetCapabilities(pb.GetCapabilitiesRequest(), metadata=repeated(0), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _calls_admitted(harness, repeated, 10) == 0


def test_a_repeated_authorization_header_is_unauthenticated_with_tenants(tmp_path: Path) -> None:
    path = tmp_path / "tenants.json"
    path.write_text('{"tenants": [{"name": "team-a", "session_prefix": "a/", "tokens": ["tok-a"]}]}')
    harness = Harness(local_engine_info(), tenants_file=str(path))
    try:
        ok = (("authorization", "Bearer tok-a"),)
        assert harness.stub.ListSessions(pb.ListSessionsRequest(), metadata=ok, timeout=5) is not None
        for md in ((("authorization", "Bearer nope"), *ok), (*ok, *ok)):
            with pytest.raises(grpc.RpcError) as err:
                harness.stub.ListSessions(pb.ListSessionsRequest(), metadata=md, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "2 authorization headers" in (err.value.details() or "")
    finally:
        harness.close()
