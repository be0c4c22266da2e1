"""Retain / Pin / Release / Evict on a real vLLM engine, observed the way a
user sees them: `cached_tokens` when a session resumes after cache pressure.

Tests taking `any_clean` run on the dense model and on the hybrid one (a
sliding-window and a full-attention KV-cache group), where a hit needs both
groups to hit."""

from __future__ import annotations

import concurrent.futures

import pytest
from engine_support import PROMPT, Engine, evict, pin, release, retain, session_sel, tokens

from conformance.cases.retention import first_divergence_is_a_tie
from conformance.target import Options
from kvhint.v1 import kvhint_pb2 as pb

pytestmark = pytest.mark.engine

FULL_HIT = 704  # 22 blocks of 32; the last partial block is always recomputed
# (hybrid too: vLLM caches the sliding-window tail ending at block 22 of a 720-token prompt)


def test_pinned_session_survives_pressure_that_evicts_an_unhinted_one(any_clean: Engine) -> None:
    pinned, control = tokens("pinned"), tokens("control")
    assert any_clean.complete(control, "control").cached_tokens == 0
    assert any_clean.complete(pinned, "pinned").cached_tokens == 0
    (result,) = any_clean.apply(pin("pinned", ttl=60))
    assert result.outcome == pb.OUTCOME_ACCEPTED
    assert result.affected_blocks[0].blocks == 22

    any_clean.fill("pin")

    assert any_clean.complete(pinned, "pinned").cached_tokens == FULL_HIT
    assert any_clean.complete(control, "control").cached_tokens == 0  # same pressure, no hint: evicted
    any_clean.apply(release("pinned"))


def test_retained_session_survives_pressure(any_clean: Engine) -> None:
    kept, control = tokens("kept"), tokens("control-r")
    any_clean.complete(control, "control-r")
    any_clean.complete(kept, "kept")
    (result,) = any_clean.apply(retain("kept", priority=5, ttl=60))
    assert result.outcome == pb.OUTCOME_ACCEPTED

    any_clean.fill("retain")

    assert any_clean.complete(kept, "kept").cached_tokens == FULL_HIT
    assert any_clean.complete(control, "control-r").cached_tokens == 0
    any_clean.apply(release("kept"))


def test_lower_retain_priority_is_evicted_first_tail_first(clean: Engine) -> None:
    names = ("high", "mid", "low")  # oldest first: plain LRU would evict `high` first
    for name in names:
        clean.complete(tokens(name), name)
    clean.apply(retain("high", priority=9), retain("mid", priority=5), retain("low", priority=1))
    # 66 retained blocks leave 13 ordinary ones; a 720-token prompt needs 23
    # blocks, so 10 retained blocks go: all from the lowest priority, tail first.
    clean.fill("priority", n=1)

    assert clean.complete(tokens("high"), "high").cached_tokens == FULL_HIT
    assert clean.complete(tokens("mid"), "mid").cached_tokens == FULL_HIT
    assert clean.complete(tokens("low"), "low").cached_tokens == (22 - 10) * 32
    clean.apply(*(release(n) for n in names))


def test_release_makes_a_session_the_first_eviction_candidate(any_clean: Engine) -> None:
    any_clean.fill("release-pre", n=2)
    older, released = tokens("older"), tokens("released")
    any_clean.complete(older, "older")
    any_clean.complete(released, "released")

    (result,) = any_clean.apply(release("released"))
    assert result.outcome == pb.OUTCOME_ACCEPTED
    # Still reusable until something needs the room.
    assert any_clean.complete(released, "released").cached_tokens == FULL_HIT

    any_clean.apply(release("released"))
    # Pressure as large as what the released session holds. Dense: one 720-token
    # prompt (23 blocks). Hybrid: the session holds 22 full-attention and 4 window
    # blocks, a prefill needs two copies of every block (the window group frees
    # its early blocks only after the step), so a 400-token prompt (2 x 13).
    hybrid = any_clean.served.spec.model.rstrip("/").endswith("hybrid")
    any_clean.complete(tokens("release-post", 400 if hybrid else PROMPT))
    # `older` first: recomputing `released` is pressure of its own.
    assert any_clean.complete(older, "older").cached_tokens == FULL_HIT  # LRU would have taken this
    assert any_clean.complete(released, "released").cached_tokens == 0  # went first


def test_release_of_unknown_session_is_missing(clean: Engine) -> None:
    (result,) = clean.apply(release("never-seen"))
    assert result.outcome == pb.OUTCOME_MISSING
    assert result.reason == pb.REASON_NOT_RESIDENT


def test_evict_frees_a_session_now(any_clean: Engine) -> None:
    gone = tokens("evicted")
    any_clean.complete(gone, "evicted")
    (result,) = any_clean.apply(evict("evicted"))
    assert result.outcome == pb.OUTCOME_ACCEPTED
    assert result.affected_blocks[0].blocks == 22
    assert any_clean.complete(gone, "evicted").cached_tokens == 0
    residency = any_clean.stub.QueryResidency(pb.QueryResidencyRequest(selector=session_sel("evicted")))
    assert residency.totals[0].blocks == 22  # recomputed and cached again


def test_pinned_session_keeps_its_prefix_hit_after_unrelated_prompts(any_clean: Engine) -> None:
    """Issue 12's scenario: session A (512 tokens), Pin(A, 300 s), six unrelated
    600-token prompts, then A resumes. The resume gets the hit it gets with no
    pressure at all (dense: 512 tokens; hybrid: the sliding-window tail vLLM
    caches ends at A's last full block but one, so 480), and an unhinted
    session under the same pressure gets nothing."""
    a, b = tokens("issue-a", 512), tokens("issue-b", 512)
    turn2 = tokens("issue-turn2", 64)
    any_clean.complete(a, "issue-a")
    reference = any_clean.complete(a + turn2, "issue-a").cached_tokens
    assert reference >= 512 - 2 * 32
    any_clean.reset_cache()

    any_clean.complete(b, "issue-b")
    any_clean.complete(a, "issue-a")
    (result,) = any_clean.apply(pin("issue-a", ttl=300))
    assert result.outcome == pb.OUTCOME_ACCEPTED and result.affected_blocks[0].blocks == 16  # logical blocks
    for i in range(6):
        any_clean.complete(tokens(f"issue-filler-{i}", 600))
    assert any_clean.complete(a + turn2, "issue-a").cached_tokens == reference
    assert any_clean.complete(b + turn2, "issue-b").cached_tokens == 0
    any_clean.apply(release("issue-a"))


def evict_while_running(engine: Engine, session: str, prompt: list[int]) -> tuple[pb.HintResult | None, list[int]]:
    """Start a long request; once QueryResidency shows its blocks in use, Evict
    its session. Returns the Evict result (None if the request ended first)."""
    import time

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        running = pool.submit(engine.complete, prompt, session, max_tokens=700, extra_body={"ignore_eos": True})
        # Two more long requests keep the engine busy, so the request runs longer.
        for i in range(2):
            pool.submit(engine.complete, tokens(f"{session}-load-{i}", 64), max_tokens=700, extra_body={"ignore_eos": True})
        result = None
        while not running.done() and result is None:
            blocks = engine.stub.QueryResidency(pb.QueryResidencyRequest(selector=session_sel(session)), timeout=60).blocks
            if any(b.in_use for b in blocks):
                (result,) = engine.apply(evict(session))
            time.sleep(0.01)
        return result, list(running.result().token_ids)


def test_evict_skips_blocks_of_a_running_request(clean: Engine) -> None:
    """Evict of a running request's session is CLIPPED/BLOCKS_IN_USE, evicts
    nothing, and leaves the request's output unchanged.

    Deterministic: once the request's first blocks are stored (it is running),
    the engine is paused with vLLM's dev-mode `POST /pause?mode=keep` (and
    clear_cache=false), which freezes running requests with their blocks.
    While paused, QueryResidency confirms the blocks are in use and the Evict
    is applied (KvHint applies hints on the idle engine); then `POST /resume`
    lets the request finish."""
    import urllib.request

    from events_support import Collector

    def post(path: str) -> None:
        with urllib.request.urlopen(urllib.request.Request(clean.http + path, data=b"", method="POST"), timeout=60) as r:
            assert r.status == 200, path

    def running_blocks(session: str) -> list[pb.BlockInfo]:
        blocks = clean.stub.QueryResidency(pb.QueryResidencyRequest(selector=session_sel(session)), timeout=30).blocks
        return [b for b in blocks if b.in_use]

    max_tokens = 760
    for attempt in range(3):  # a retry only if the request finished before the pause took hold
        session = f"running-{attempt}"
        prompt = tokens(session, 256)
        reference = clean.complete(prompt, max_tokens=max_tokens, extra_body={"ignore_eos": True}).token_ids
        clean.reset_cache()
        watch = Collector(
            clean.grpc_address,
            pb.WatchEventsRequest(
                start=pb.WatchEventsRequest.START_NOW,
                filter=pb.EventFilter(session_ids=[session]),
                heartbeat_interval={"nanos": 100_000_000},
            ),
        )
        try:
            watch.wait_for(bool)  # subscribed (a heartbeat arrived) before the request starts
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                running = pool.submit(clean.complete, prompt, session, max_tokens=max_tokens, extra_body={"ignore_eos": True})
                watch.wait_for(lambda ms: any(m.WhichOneof("payload") == "blocks_stored" for m in ms), timeout=120)
                post("/pause?mode=keep&clear_cache=false")
                try:
                    in_use = running_blocks(session)  # frozen until /resume: this is the state Evict sees
                    if in_use:
                        (result,) = clean.apply(evict(session))
                        after = running_blocks(session)
                finally:
                    post("/resume")
                output = running.result(timeout=300).token_ids
        finally:
            watch.stop()
        if in_use:
            break
    assert in_use, "the request finished before the engine paused, every time"
    assert result.outcome == pb.OUTCOME_CLIPPED and result.reason == pb.REASON_BLOCKS_IN_USE, result
    assert result.clips[0].granted_blocks == 0 and result.clips[0].requested_blocks == len(in_use)
    assert [b.block_hash for b in after] == [b.block_hash for b in in_use]  # nothing was evicted
    assert len(output) == max_tokens and tuple(output) == reference  # the running request was not disturbed


def test_ttl_above_the_cap_is_clipped(clean: Engine) -> None:
    clean.complete(tokens("long-ttl"), "long-ttl")
    (result,) = clean.apply(pin("long-ttl", ttl=7200))
    assert result.outcome == pb.OUTCOME_CLIPPED
    assert result.reason == pb.REASON_TTL_CAPPED
    assert result.effective_ttl.seconds == 3600
    assert result.clips[0].requested_ttl.seconds == 7200
    clean.apply(release("long-ttl"))


def test_pin_budget_clips_with_the_granted_count(clean: Engine) -> None:
    caps = clean.stub.GetCapabilities(pb.GetCapabilitiesRequest())
    budget = caps.limits.pin_budget_blocks
    assert budget == int((caps.num_device_blocks - 1) * 0.5)
    clean.complete(tokens("budget-a"), "budget-a")
    clean.complete(tokens("budget-b"), "budget-b")
    first, second = clean.apply(pin("budget-a"), pin("budget-b"))
    assert first.outcome == pb.OUTCOME_ACCEPTED
    assert second.outcome == pb.OUTCOME_CLIPPED
    assert second.reason == pb.REASON_PIN_BUDGET
    assert second.clips[0].requested_blocks == 22
    assert second.clips[0].granted_blocks == budget - 22
    clean.apply(release("budget-a"), release("budget-b"))


def test_a_clipped_pin_grants_what_the_resume_hits(any_clean: Engine) -> None:
    """A two-turn session (8 blocks, then 18), pinned with max_blocks=12, then pressure: the
    resume hits exactly the blocks the Pin granted. Dense: the 12. Hybrid: a hit ends only where
    the sliding-window tail is cached (turn 1's end), so the Pin drops the blocks after it
    (WINDOW_TAIL_MISSING) instead of granting 12 of which the resume could use fewer."""
    first = tokens("clip-a", 256)
    second = first + tokens("clip-a2", 320)
    any_clean.complete(first, "clip-a")
    any_clean.complete(second, "clip-a")
    (result,) = any_clean.apply(pin("clip-a", max_blocks=12))
    granted = result.affected_blocks[0].blocks if result.affected_blocks else 0
    for i in range(6):
        any_clean.complete(tokens(f"clip-filler-{i}", 600))
    hit = any_clean.complete(second + tokens("clip-a3", 64), "clip-a").cached_tokens
    any_clean.apply(release("clip-a"))
    assert result.outcome == pb.OUTCOME_CLIPPED and result.reason == pb.REASON_MAX_BLOCKS
    assert result.clips[0].granted_blocks == 12
    caps = any_clean.stub.GetCapabilities(pb.GetCapabilitiesRequest())
    if not any(g.kind == pb.KvCacheGroup.KIND_SLIDING_WINDOW for g in caps.kv_cache_groups):
        assert len(result.clips) == 1 and granted == 12  # dense: every prefix is a hit
    else:
        assert result.clips[1].reason == pb.REASON_WINDOW_TAIL_MISSING
        assert result.clips[1].requested_blocks == 12 and 0 < result.clips[1].granted_blocks == granted < 12
    assert hit == granted * 32


def test_pins_never_fail_a_request_stock_vllm_would_serve(clean: Engine) -> None:
    for i in range(2):
        clean.complete(tokens(f"pinned-{i}"), f"pinned-{i}")
    clean.apply(pin("pinned-0"), pin("pinned-1"))  # budget-full: 39 of 79 blocks
    # Each of these needs 32 blocks; together they need more than the unpinned pool.
    big = [tokens(f"huge-{i}", 1000) for i in range(2)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outputs = list(pool.map(lambda p: clean.complete(p, max_tokens=16), big))
    assert all(len(o.token_ids) == 16 for o in outputs)
    clean.reset_cache()
    # The same greedy tokens run alone with nothing pinned, up to a numerical tie: the engine computes
    # in bfloat16, and a batch of two rounds differently from a batch of one (the conformance rule,
    # conformance.cases.retention.first_divergence_is_a_tie).
    for p, out in zip(big, outputs):
        assert first_divergence_is_a_tie(clean, p, out.token_ids, Options.tie_nats) is None  # type: ignore[arg-type]


def test_hints_apply_on_an_idle_engine_without_waiting_for_a_request(clean: Engine) -> None:
    """An idle EngineCore blocks in its input queue; the sidecar must wake it.

    Without the wake-up the task would wait for the next request and the RPC
    would fail at its deadline, so a short deadline makes this a behaviour check.
    How fast the wake-up is (milliseconds) is measured by bench/apply_latency.py,
    not asserted here: a timed assertion flakes on a loaded CI machine.
    """
    import time

    clean.complete(tokens("idle"), "idle")
    time.sleep(0.5)  # the engine is idle, blocked on its input queue
    request = pb.ApplyHintsRequest(hints=[pin("idle", ttl=5)])
    (result,) = clean.stub.ApplyHints(request, timeout=3).results
    assert result.outcome == pb.OUTCOME_ACCEPTED
    residency = clean.stub.QueryResidency(pb.QueryResidencyRequest(selector=session_sel("idle")), timeout=3)
    assert residency.blocks and all(
        b.retention.retention_class == pb.RetentionState.CLASS_PINNED for b in residency.blocks
    )
    clean.apply(release("idle"))


def test_kv_cache_usage_returns_to_zero_with_retention_in_place(clean: Engine) -> None:
    import urllib.request

    for s in ("acct-a", "acct-b", "acct-c"):
        clean.complete(tokens(s), s, max_tokens=4)
    clean.apply(pin("acct-a"), retain("acct-b", priority=3))
    with urllib.request.urlopen(clean.http + "/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    usage = [line for line in metrics.splitlines() if line.startswith("vllm:kv_cache_usage_perc")]
    assert usage and float(usage[0].rsplit(" ", 1)[1]) == 0.0  # protected blocks are still free blocks
    residency = clean.stub.QueryResidency(pb.QueryResidencyRequest(selector=session_sel("acct-a")))
    assert residency.totals[0].blocks == 22
    assert all(b.retention.retention_class == pb.RetentionState.CLASS_PINNED for b in residency.blocks)
    assert all(not b.in_use for b in residency.blocks)
    clean.apply(release("acct-a"), release("acct-b"))
    assert PROMPT // 32 == 22
