"""Events and queries agree on a real engine: the rel-a reproduction from issue 14.

A session holds 3 device blocks; an EventFollower and the server agree. After an ACCEPTED
Release the server reports no blocks and ListSessions drops the session; the follower must drop
it too (MembershipChanged), while the blocks stay cached: the same prompt gets 96 cached tokens,
and that hit makes the session a member again, on both sides."""

from __future__ import annotations

import io
import time

import pytest
from engine_support import Engine, release, session_sel, tokens
from events_support import latest_sequence

from conformance.runner import main as conformance_main
from kvhint.v1 import kvhint_pb2 as pb
from kvhint_client.follower import EventFollower

pytestmark = pytest.mark.engine

ENGINE = "e"


def _caught_up(follower: EventFollower, engine: Engine, timeout: float = 10.0) -> None:
    target = latest_sequence(engine.stub)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        position = follower.position(ENGINE)
        if position is not None and position[1] >= target and follower.index.is_live(ENGINE):
            return
        time.sleep(0.02)
    raise AssertionError(f"the follower did not reach sequence {target}: {follower.position(ENGINE)}")


def _server_blocks(engine: Engine, session: str) -> set[bytes]:
    page = engine.stub.QueryResidency(pb.QueryResidencyRequest(selector=session_sel(session), tiers=[pb.TIER_DEVICE]), timeout=10)
    return {b.block_hash for b in page.blocks}


def _listed(engine: Engine, session: str) -> bool:
    page = engine.stub.ListSessions(pb.ListSessionsRequest(session_id_prefix=session), timeout=10)
    return any(s.session_id == session for s in page.sessions)


def _agree(follower: EventFollower, engine: Engine, session: str) -> set[bytes]:
    _caught_up(follower, engine)
    server = _server_blocks(engine, session)
    assert follower.index.session_blocks(session, ENGINE, tier="device") == server
    assert (session in follower.index.sessions(ENGINE)) == _listed(engine, session) == bool(server)
    return server


def test_release_is_on_the_stream_and_the_follower_agrees(clean: Engine) -> None:
    prompt = tokens("rel-a", 100)  # 3 full blocks of 32 tokens
    with EventFollower({ENGINE: clean.grpc_address}, heartbeat=0.2) as follower:
        assert follower.wait_synced(timeout=20)
        clean.complete(prompt, "rel-a")
        held = _agree(follower, clean, "rel-a")
        assert len(held) == 3
        assert [r.blocks for r in follower.index.engines_for_session("rel-a")] == [3]

        [result] = clean.apply(release("rel-a"))
        assert result.outcome == pb.OUTCOME_ACCEPTED
        assert _agree(follower, clean, "rel-a") == set()
        assert follower.index.engines_for_session("rel-a") == []
        assert held <= follower.index.tier_blocks(ENGINE, "device"), "the released blocks stay cached"

        assert clean.complete(prompt, "rel-a").cached_tokens == 96
        assert _agree(follower, clean, "rel-a") == held  # the hit re-joins the blocks


def test_conformance_case_passes(clean: Engine) -> None:
    out = io.StringIO()
    rc = conformance_main(
        ["--target", clean.grpc_address, "--openai-url", clean.http, "--run", "follower-agrees-after-release", "-v"], out=out
    )
    assert rc == 0, out.getvalue()
    assert "follower-agrees-after-release" in out.getvalue()
