"""Clip.requested_ttl echoes the TTL a hint asked for, to the nanosecond (real gRPC, fake engine)."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st
from google.protobuf import duration_pb2
from kvhint_unit_support import Harness, h, session_sel

from kvhint.v1 import kvhint_pb2 as pb

TTLS = st.builds(duration_pb2.Duration, seconds=st.integers(61, 315_576_000_000), nanos=st.integers(0, 999_999_999))


@settings(max_examples=40, deadline=None)
@given(st.lists(TTLS, min_size=1, max_size=16))
@example([duration_pb2.Duration(seconds=9_007_199, nanos=836_132_367)])  # 104 days: came back ...366 ns
def test_a_capped_ttl_echoes_the_requested_ttl_to_the_nanosecond(asked):
    """Clip.requested_ttl is the TTL the hint asked for, exactly: the server carried it as float
    seconds, 1 ns off for most TTLs past 2**23 s (97 days)."""
    harness = Harness(max_ttl_s=60.0)
    try:
        harness.engine.store([h(1)], session="a")
        hints = [pb.Hint(selector=session_sel("a"), retain=pb.RetainAction(ttl=ttl)) for ttl in asked]
        clips = [r.clips[0] for r in harness.apply(*hints).results]
        assert [(c.reason, c.requested_ttl) for c in clips] == [(pb.REASON_TTL_CAPPED, ttl) for ttl in asked]
    finally:
        harness.close()
