"""KV tiers on real served engines: Demote, Prefetch and Share through the kvhint.v1
gRPC surface and the OpenAI API (engine_integration.tiers.runtime).

Two `vllm serve` engines (tiny model, 80 G1 blocks of 32 tokens) are started
once for this module with the launcher's one tier flag, `--kvhint-tiers`, and
mount the same G3 file tier:

  A: host=64 blocks, file=ROOT, peers b (engine B) and `down` (nothing listens),
     host-eviction=kvhint (the host tier honours Retain and Pin)
  B: host=40 blocks, file=ROOT, peer a (vLLM's LRU host policy)

Recompute references come from the same engine with a fresh `cache_salt` (block
hashes no tier holds). The session-wide plain engine of conftest (no tiers)
serves the no-tier negative case, so this file starts at most three engines.
The last test stops A and B and checks that a clean shutdown leaves nothing in
/dev/shm or the (ephemeral) tier directory.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from engine_support import Engine, release, retain, session_sel, tokens
from events_support import Collector
from offload_shm import left_behind, mapped_regions

from engine_integration.served import EngineSpec, ServedEngine, free_port, reset_prefix_cache
from kvhint.v1 import kvhint_pb2 as pb
from kvhint.v1 import kvhint_pb2_grpc as pbg
from kvhint_client.openai_traffic import Completion

pytestmark = pytest.mark.engine

FULL = 704  # 22 full blocks of a 720-token prompt
NOW = pb.WatchEventsRequest(start=pb.WatchEventsRequest.START_NOW)
OP_DONE = (pb.Operation.STATE_SUCCEEDED, pb.Operation.STATE_FAILED)


# ---------------------------------------------------------------------- harness


class TierEngine(Engine):
    def reset(self, external: bool = True) -> None:
        """Empty G1 (and, with external, the host tier; files persist), retrying
        while a just-finished request still holds blocks."""
        reset_prefix_cache(self.http, external=external)

    def op(self, op_id: str) -> pb.Operation:
        return self.stub.GetOperation(pb.GetOperationRequest(operation_id=op_id), timeout=5).operation

    def wait_op(self, op_id: str, timeout: float = 30.0) -> tuple[pb.Operation, float]:
        """The completed operation and the seconds it took to see it complete."""
        t0 = time.monotonic()
        while True:
            op = self.op(op_id)
            if op.state in OP_DONE:
                return op, time.monotonic() - t0
            assert time.monotonic() - t0 < timeout, f"operation {op_id} still {pb.Operation.State.Name(op.state)}"
            time.sleep(0.01)

    def residency(self, selector: pb.Selector) -> list[pb.BlockInfo]:
        resp = self.stub.QueryResidency(pb.QueryResidencyRequest(selector=selector, page_size=1024), timeout=10)
        return list(resp.blocks)

    def session_tiers(self, session: str) -> list[set[int]]:
        return [set(b.tiers) for b in self.residency(session_sel(session))]

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.http + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:") and "_created" not in line:
                key, value = line.rsplit(" ", 1)
                name = key.split("{", 1)[0]
                if 'source="' in key:
                    name += ":" + key.split('source="', 1)[1].split('"', 1)[0]
                out[name] = out.get(name, 0.0) + float(value)
        return out

    def cached_by_source(self, before: dict[str, float], want: int, source: str) -> dict[str, float]:
        """Delta of prompt tokens cached per source since `before` (waits for the
        frontend to record the request's stats)."""
        deadline = time.monotonic() + 5
        while True:
            now = self.metrics()
            delta = {
                k.split(":", 2)[-1]: now[k] - before.get(k, 0.0)
                for k in now
                if k.startswith("vllm:prompt_tokens_cached_by_source_total:")
            }
            if delta.get(source, 0) >= want or time.monotonic() > deadline:
                delta["external_hits"] = now.get("vllm:external_prefix_cache_hits_total", 0) - before.get(
                    "vllm:external_prefix_cache_hits_total", 0
                )
                return delta
            time.sleep(0.1)


def _stop_all(engines: list[TierEngine]) -> None:
    threads = [threading.Thread(target=e.served.stop) for e in engines if e.served.proc is not None]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in engines:
        e.close()


class Pair:
    def __init__(self, a: TierEngine, b: TierEngine, root: Path, shm_before: set[str]) -> None:
        self.a, self.b, self.root, self.shm_before = a, b, root, shm_before
        self.stopped = False

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            _stop_all([self.a, self.b])


@pytest.fixture(scope="module")
def pair(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    root = tmp_path_factory.mktemp("kvtier") / "fs"
    port_a, port_b, port_down = free_port(), free_port(), free_port()
    env = {"VLLM_SERVER_DEV_MODE": "1"}

    def served(port: int, tiers: str, name: str) -> ServedEngine:
        log = tmp_path_factory.getbasetemp() / f"engine-{name}.log"
        return ServedEngine(EngineSpec(model=tiny_model, grpc_port=port, env=env, extra_args=["--kvhint-tiers", tiers]), log)

    shm_before = left_behind()
    sa = served(port_a, f"host=64,file={root},ephemeral,peer=b=127.0.0.1:{port_b},peer=down=127.0.0.1:{port_down},timeout=20"
                        ",host-eviction=kvhint", "a")
    sb = served(port_b, f"host=40,file={root},ephemeral,peer=a=127.0.0.1:{port_a}", "b")
    yield from serve_pair(sa, sb, root, shm_before)


def serve_pair(sa: ServedEngine, sb: ServedEngine, root: Path, shm_before: set[str]) -> Iterator[Pair]:
    """Start both engines at once, yield them as a Pair, stop both (a fixture's body)."""
    errors: list[BaseException] = []

    def start(s: ServedEngine) -> None:
        try:
            s.start()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,)) for s in (sa, sb)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    p = Pair(TierEngine(sa), TierEngine(sb), root, shm_before)
    try:
        if errors:
            raise errors[0]
        yield p
    finally:
        p.stop()


def demote(session: str, **kw: object) -> pb.Hint:
    return pb.Hint(selector=session_sel(session), demote=pb.DemoteAction(**kw))  # type: ignore[arg-type]


def prefetch(session: str, **kw: object) -> pb.Hint:
    return pb.Hint(selector=session_sel(session), prefetch=pb.PrefetchAction(**kw))  # type: ignore[arg-type]


def share(session: str, destination: str) -> pb.Hint:
    return pb.Hint(selector=session_sel(session), share=pb.ShareAction(destination=destination))


def recompute(engine: Engine, prompt: list[int]) -> Completion:
    """The same prompt computed from scratch on the same engine: a fresh
    cache_salt gives it block hashes no tier holds. (Compare within one engine
    configuration: an engine without a KV connector compiles a different graph,
    and its bf16 logits can differ enough to change a greedy token.) Used for
    prompts whose cached blocks were all computed by one prefill."""
    return engine.complete(prompt, max_tokens=8, extra_body={"cache_salt": f"recompute-{time.monotonic_ns()}"})


def _events(watch: Collector, kind: str) -> list:
    return [getattr(m, kind) for m in watch.messages if m.WhichOneof("payload") == kind]


def _wait_disk(engine: TierEngine, session: str, n: int, timeout: float = 20.0) -> None:
    _wait_tier(engine, session, n, pb.TIER_DISK, timeout)


def _wait_tier(engine: TierEngine, session: str, n: int, tier: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while sum(tier in t for t in engine.session_tiers(session)) < n:
        assert time.monotonic() < deadline, f"blocks never reached tier {pb.Tier.Name(tier)}"
        time.sleep(0.05)


# ------------------------------------------------------------------------ tests


def test_kvhint_tiers_flag_expands_into_vllm_flags() -> None:
    from engine_integration.launcher import expand_tiers_flag

    argv = expand_tiers_flag(["serve", "m", "--kvhint-tiers", "host=64,file=/kv,ephemeral,peer=b=10.0.0.2:50151,timeout=9"])
    assert argv[:2] == ["serve", "m"] and "--kvhint-tiers" not in argv
    cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    extra = cfg["kv_connector_extra_config"]
    assert cfg["kv_connector"] == "OffloadingConnector" and extra["num_host_blocks"] == 64
    assert extra["secondary_tiers"][0]["root_dir"] == "/kv" and extra["kvhint_remove_file_tier_on_shutdown"]
    assert extra["kvhint_share_peers"] == {"b": "10.0.0.2:50151"} and extra["kvhint_tier_op_timeout_s"] == 9
    assert argv[argv.index("--scheduler-cls") + 1] == "engine_integration.scheduler.KvHintScheduler"
    assert "--shutdown-timeout" in argv
    mine = expand_tiers_flag(["serve", "m", "--kvhint-tiers=host=8", "--shutdown-timeout", "3"])
    assert mine.count("--shutdown-timeout") == 1 and "secondary_tiers" not in mine[mine.index("--kv-transfer-config") + 1]
    assert expand_tiers_flag(["serve", "m"]) == ["serve", "m"]
    assert extra["eviction_policy"] == "lru" and "cache_policy_module_path" not in extra  # vLLM's host policy
    opted = expand_tiers_flag(["serve", "m", "--kvhint-tiers", "host=8,host-eviction=kvhint"])
    extra = json.loads(opted[opted.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra["eviction_policy"] == "KvHintHostPolicy" and extra["cache_policy_module_path"] == "engine_integration.tiers.host_policy"
    for bad in ("file=/kv", "host=8,peer=b=h:1", "host=8,bogus=1", "host=x", "host=8,host-eviction=mru", "host=0", "host=-5",
                "host-bytes=0", "host=8,timeout=nan", "host=8,timeout=inf", "host=8,timeout=0"):
        with pytest.raises(SystemExit):
            expand_tiers_flag(["serve", "m", "--kvhint-tiers", bad])


def test_capabilities_list_host_and_disk_tiers_and_tier_actions(pair: Pair) -> None:
    caps = pair.a.stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=10)
    tiers = {t.tier: t for t in caps.tiers}
    assert [t.tier for t in caps.tiers] == [pb.TIER_DEVICE, pb.TIER_HOST, pb.TIER_DISK]
    assert tiers[pb.TIER_HOST].medium == "CPU" and tiers[pb.TIER_HOST].capacity_blocks == 64
    assert not tiers[pb.TIER_HOST].shared and tiers[pb.TIER_HOST].honours_retention  # host-eviction=kvhint
    assert not tiers[pb.TIER_DEVICE].honours_retention and not tiers[pb.TIER_DISK].honours_retention
    assert tiers[pb.TIER_DISK].medium == "STORAGE" and tiers[pb.TIER_DISK].shared
    actions = {a.action: a for a in caps.actions}
    for action in (pb.ACTION_DEMOTE, pb.ACTION_PREFETCH, pb.ACTION_SHARE):
        assert actions[action].supported and pb.SELECTOR_KIND_SESSION in actions[action].selectors
    assert "host tier" in actions[pb.ACTION_PREFETCH].notes and "request" in actions[pb.ACTION_PREFETCH].notes
    assert set(caps.share_destinations) == {"b", "down"}
    caps_b = pair.b.stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=10)
    assert {t.tier: t.capacity_blocks for t in caps_b.tiers}[pb.TIER_HOST] == 40
    assert not {t.tier: t for t in caps_b.tiers}[pb.TIER_HOST].honours_retention  # vLLM's LRU, the default
    assert list(caps_b.share_destinations) == ["a"]


def test_demote_then_resume_reloads_the_prefix_from_the_host_tier(pair: Pair) -> None:
    a = pair.a
    a.reset()
    older = tokens("tier-older")
    a.complete(older, "tier-older")  # older than the demoted session: plain LRU would take it first
    prompt = tokens("tier-demote")
    first = a.complete(prompt, "tier-demote", max_tokens=24)  # 744 tokens: 23 full blocks, the last one
    assert first.cached_tokens == 0  # holds decode tokens, which the connector never offloads
    watch = Collector(a.grpc_address, pb.WatchEventsRequest(filter=pb.EventFilter(session_ids=["tier-demote"])))
    time.sleep(0.3)

    (result,) = a.apply(demote("tier-demote"))
    assert result.outcome == pb.OUTCOME_DEFERRED and result.operation_id, result
    assert {c.tier: c.blocks for c in result.affected_blocks} == {pb.TIER_DEVICE: 23}
    op, seconds = a.wait_op(result.operation_id)
    assert op.state == pb.Operation.STATE_SUCCEEDED, op
    assert op.action == pb.ACTION_DEMOTE and {c.tier: c.blocks for c in op.blocks} == {pb.TIER_HOST: 23}
    assert op.bytes_moved > 0  # the decode block was copied by the engine itself
    # Copy completion and reclamation are separate steps: still on G1, now also on G2.
    assert all({pb.TIER_DEVICE, pb.TIER_HOST} <= t for t in a.session_tiers("tier-demote"))

    a.complete(tokens("tier-demote-filler"))  # needs 23 blocks; 33 never-used blocks are free
    after = a.session_tiers("tier-demote")
    assert len(after) == 23, "session membership must survive the G1 eviction"
    assert all(pb.TIER_DEVICE not in t and pb.TIER_HOST in t for t in after), after
    assert all(pb.TIER_DEVICE in t for t in a.session_tiers("tier-older"))  # reclaimed first: the demoted copies

    watch.wait_for(lambda ms: any(m.HasField("blocks_removed") for m in ms))
    events = watch.stop()
    completed = [e.operation for e in _events(watch, "operation_completed")]
    assert [o.operation_id for o in completed] == [result.operation_id]
    transfers = [t for t in _events(watch, "tier_transfer_completed") if t.operation_id == result.operation_id]
    assert len(transfers) == 1 and transfers[0].to_tier == pb.TIER_HOST and len(transfers[0].block_hashes) == 23
    removed = [r for r in _events(watch, "blocks_removed") if r.tier == pb.TIER_DEVICE]
    assert sum(len(r.block_hashes) for r in removed) == 23
    assert all(r.cause == pb.REMOVAL_CAUSE_DEMOTED and not r.last_copy for r in removed)
    first_seq: dict[str | None, int] = {}
    for m in events:
        first_seq.setdefault(m.WhichOneof("payload"), m.sequence)
    assert first_seq["operation_completed"] < first_seq["blocks_removed"]  # reclaimed after the copy completed

    resume = prompt + list(first.token_ids)  # the session's next turn
    before = a.metrics()
    again = a.complete(resume, "tier-demote", max_tokens=8)
    assert again.cached_tokens == 23 * 32
    by_source = a.cached_by_source(before, 23 * 32, "host")
    assert by_source["host"] == 23 * 32 and by_source["external_hits"] == 23 * 32, by_source
    # Reference: the session replayed from scratch under a fresh cache_salt (turn 1
    # recomputed, the resume hits that KV in G1). The reloaded copies must give
    # exactly its tokens. (A single prefill of the whole resume prompt computes
    # the turn-1 decode tokens' KV differently and may differ in bf16, as for any
    # G1 prefix hit; see bench/tiers_resume.py.)
    salt = f"replay-{time.monotonic_ns()}"
    replay_first = a.complete(prompt, max_tokens=24, extra_body={"cache_salt": salt})
    assert replay_first.cached_tokens == 0 and replay_first.token_ids == first.token_ids
    reference = a.complete(resume, max_tokens=8, extra_body={"cache_salt": salt})
    assert reference.cached_tokens == 23 * 32
    assert again.token_ids == reference.token_ids
    print(f"\ndemote: op {seconds * 1000:.1f} ms, {op.bytes_moved} B moved; resume TTFT {again.ttft_s * 1000:.1f} ms "
          f"(same resume from G1 {reference.ttft_s * 1000:.1f} ms, turn 1 computed {first.ttft_s * 1000:.1f} ms)")


def _retained_beside_a_control(a: TierEngine, name: str) -> tuple[list[int], Completion]:
    """From an empty cache: session `name` and an unhinted `name`-control stored, each waited onto
    the host and file tiers, then `name` retained (priority 1, 120 s). Returns `name`'s prompt and
    first completion. (Host copies still being written to the file tier cannot be dropped yet, so
    each session's copies are on the file tier before the next store.)"""
    a.reset()
    prompt = tokens(name)
    first = a.complete(prompt, name, max_tokens=8)
    a.complete(tokens(f"{name}-control"), f"{name}-control", max_tokens=8)
    for session in (name, f"{name}-control"):
        _wait_tier(a, session, 22, pb.TIER_HOST)
        _wait_disk(a, session, 22)
    (result,) = a.apply(retain(name, priority=1, ttl=120))
    assert result.outcome == pb.OUTCOME_ACCEPTED, result
    return prompt, first


def _host_pressure(a: TierEngine, name: str) -> None:
    """88 newer blocks (four 22-block sessions) through G1 (80 blocks) and the 64-block host tier."""
    for i in range(4):
        a.complete(tokens(f"{name}-pressure-{i}"), f"{name}-p{i}")
        _wait_disk(a, f"{name}-p{i}", 22)


def test_a_retained_session_keeps_its_host_copies_through_host_pressure(pair: Pair) -> None:
    """TierInfo.honours_retention: the host tier drops unprotected copies first. Two sessions are
    stored, one is retained, then 88 newer blocks go through the 64-block host tier: an LRU host
    drops both older sessions' copies first; this one keeps the retained session's.

    Host copies still being written to the file tier cannot be dropped yet, and when only
    protected copies can, protected ones go (a store is never refused for a hint). So each
    session's copies are waited onto the file tier before the next store."""
    a = pair.a
    keep, first = _retained_beside_a_control(a, "tier-keep")
    _host_pressure(a, "tier-keep")
    kept = a.session_tiers("tier-keep")
    lost = [i for i, t in enumerate(kept) if pb.TIER_HOST not in t]
    assert len(kept) == 22 and not lost, f"blocks {lost} of the retained session lost their host copy"
    assert not any(pb.TIER_HOST in t for t in a.session_tiers("tier-keep-control"))  # the unhinted one went
    again = a.complete(keep, "tier-keep", max_tokens=8)
    assert again.cached_tokens == FULL and again.token_ids == first.token_ids
    (done,) = a.apply(release("tier-keep"))
    assert done.outcome == pb.OUTCOME_ACCEPTED, done


def test_a_retained_session_demoted_off_the_device_keeps_its_host_copies_and_its_grant(pair: Pair) -> None:
    """RetainAction: a retained block evicted from the device (here: reclaimed after a Demote)
    keeps its retained grant while the host tier, which honours retention, holds a copy, so
    the grant still orders the host's eviction when the host copy is the only one left. With
    grants ending at the device copy, the host's LRU dropped these copies first under the same
    pressure (the older session's)."""
    a = pair.a
    keep, first = _retained_beside_a_control(a, "tier-held")
    (demoted,) = a.apply(demote("tier-held"))
    assert demoted.outcome == pb.OUTCOME_DEFERRED, demoted
    assert a.wait_op(demoted.operation_id)[0].state == pb.Operation.STATE_SUCCEEDED
    _host_pressure(a, "tier-held")
    blocks = a.residency(session_sel("tier-held"))
    assert len(blocks) == 22 and not any(pb.TIER_DEVICE in b.tiers for b in blocks)  # off the device
    lost = [b.position for b in blocks if pb.TIER_HOST not in b.tiers]
    assert not lost, f"blocks {lost} of the retained session lost their host copy"
    assert {b.retention.retention_class for b in blocks} == {pb.RetentionState.CLASS_RETAINED}
    assert not any(pb.TIER_HOST in t for t in a.session_tiers("tier-held-control"))
    (refreshed,) = a.apply(retain("tier-held", priority=1, ttl=120))  # reaches the host-only blocks
    assert {c.tier: c.blocks for c in refreshed.affected_blocks} == {pb.TIER_HOST: 22}, refreshed
    before = a.metrics()
    again = a.complete(keep, "tier-held", max_tokens=8)
    assert again.cached_tokens == FULL and again.token_ids == first.token_ids
    assert a.cached_by_source(before, FULL, "host")["host"] == FULL
    (done,) = a.apply(release("tier-held"))
    assert done.outcome == pb.OUTCOME_ACCEPTED, done


def test_prefetch_of_a_resident_session_is_an_accepted_noop(pair: Pair) -> None:
    pair.a.complete(tokens("tier-resident"), "tier-resident")
    (result,) = pair.a.apply(prefetch("tier-resident"))
    assert result.outcome == pb.OUTCOME_ACCEPTED and not result.operation_id, result
    assert {c.tier: c.blocks for c in result.affected_blocks} == {pb.TIER_DEVICE: 22}


def test_prefetch_warms_the_host_tier_from_files_and_the_resume_is_a_host_hit(pair: Pair) -> None:
    a = pair.a
    a.reset()
    warm, cold = tokens("tier-warm"), tokens("tier-cold")
    first = a.complete(warm, "tier-warm", max_tokens=8)
    first_cold = a.complete(cold, "tier-cold", max_tokens=8)
    _wait_disk(a, "tier-warm", 22)
    _wait_disk(a, "tier-cold", 22)
    a.fill("tier-pf", n=4)  # 88 more blocks: evicts both sessions from G1 (80) and the host tier (64)
    for session in ("tier-warm", "tier-cold"):
        t = a.session_tiers(session)
        assert len(t) == 22 and all(x == {pb.TIER_DISK} for x in t), t  # membership kept by the file copies

    (result,) = a.apply(prefetch("tier-warm"))
    assert result.outcome == pb.OUTCOME_DEFERRED, result
    op, seconds = a.wait_op(result.operation_id)
    assert op.state == pb.Operation.STATE_SUCCEEDED, op
    assert {c.tier: c.blocks for c in op.blocks} == {pb.TIER_HOST: 22} and op.bytes_moved > 0
    assert all(t == {pb.TIER_HOST, pb.TIER_DISK} for t in a.session_tiers("tier-warm"))

    before = a.metrics()
    again = a.complete(warm, "tier-warm", max_tokens=8)
    assert again.cached_tokens == FULL and again.token_ids == first.token_ids == recompute(a, warm).token_ids
    assert a.cached_by_source(before, FULL, "host")["host"] == FULL  # loaded from host memory

    before = a.metrics()
    again_cold = a.complete(cold, "tier-cold", max_tokens=8)  # no Prefetch: the connector reads the files
    assert again_cold.cached_tokens == FULL and again_cold.token_ids == first_cold.token_ids
    assert a.cached_by_source(before, FULL, "disk")["disk"] == FULL
    print(f"\nprefetch: op {seconds * 1000:.1f} ms, {op.bytes_moved} B; resume TTFT after Prefetch "
          f"{again.ttft_s * 1000:.1f} ms, without {again_cold.ttft_s * 1000:.1f} ms")


def test_share_makes_a_session_only_a_computed_a_prefix_hit_on_b(pair: Pair) -> None:
    a, b = pair.a, pair.b
    prompt = tokens("tier-share")
    first = a.complete(prompt, "tier-share", max_tokens=8)
    assert first.cached_tokens == 0
    hashes = [blk.block_hash for blk in a.residency(session_sel("tier-share"))]
    assert len(hashes) == 22
    by_hash = pb.Selector(block_hashes=pb.BlockHashSelector(block_hashes=hashes))
    assert not any(set(blk.tiers) & {pb.TIER_DEVICE, pb.TIER_HOST} for blk in b.residency(by_hash))
    watch_a = Collector(a.grpc_address, NOW)
    watch_b = Collector(b.grpc_address, NOW)
    time.sleep(0.3)

    (result,) = a.apply(share("tier-share", "b"))
    assert result.outcome == pb.OUTCOME_DEFERRED, result
    op, seconds = a.wait_op(result.operation_id)
    # Completion means visibility: B already holds every block in its host tier.
    on_b = b.residency(by_hash)
    assert op.state == pb.Operation.STATE_SUCCEEDED, op
    assert op.action == pb.ACTION_SHARE and op.destination == "b"
    assert {c.tier: c.blocks for c in op.blocks} == {pb.TIER_DISK: 22, pb.TIER_REMOTE: 22}
    assert len(on_b) == 22 and all(pb.TIER_HOST in blk.tiers for blk in on_b)
    watch_b.wait_for(lambda ms: any(m.HasField("operation_completed") for m in ms))
    b_ops = [e.operation for e in _events(watch_b, "operation_completed")]
    b_op = next(o for o in b_ops if o.hint_id == f"kvhint-share-{result.operation_id}")
    assert b_op.action == pb.ACTION_PREFETCH and b_op.state == pb.Operation.STATE_SUCCEEDED
    assert b_op.completed_at.ToNanoseconds() <= op.completed_at.ToNanoseconds()
    watch_a.wait_for(lambda ms: any(m.HasField("operation_completed") for m in ms))
    hops = [(t.from_tier, t.to_tier) for t in _events(watch_a, "tier_transfer_completed")
            if t.operation_id == result.operation_id]
    assert hops[-1] == (pb.TIER_DISK, pb.TIER_REMOTE)
    watch_a.stop()
    watch_b.stop()

    before = b.metrics()
    on_b_resume = b.complete(prompt, "tier-share", max_tokens=8)
    assert on_b_resume.cached_tokens == FULL
    assert on_b_resume.token_ids == first.token_ids  # identical to A's (computed) output
    assert on_b_resume.token_ids == recompute(b, prompt).token_ids
    assert b.cached_by_source(before, FULL, "host")["host"] == FULL
    assert len(b.session_tiers("tier-share")) == 22  # B now knows the session too
    print(f"\nshare: op {seconds * 1000:.1f} ms, {op.bytes_moved} B; B resume TTFT {on_b_resume.ttft_s * 1000:.1f} ms "
          f"(A first TTFT {first.ttft_s * 1000:.1f} ms)")


def test_tier_failures_are_rejections_or_failed_operations_never_hangs(pair: Pair, engine: Engine) -> None:
    a, b = pair.a, pair.b
    # No tiers configured: advertised as unsupported, and rejected as such.
    caps = engine.stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=10)
    assert [t.tier for t in caps.tiers] == [pb.TIER_DEVICE]
    assert not {x.action: x for x in caps.actions}[pb.ACTION_DEMOTE].supported
    for hint in (demote("anything"), prefetch("anything"), share("anything", "b")):
        (r,) = engine.apply(hint)
        assert r.outcome == pb.OUTCOME_REJECTED and r.reason == pb.REASON_UNSUPPORTED, r

    (r,) = a.apply(share("tier-resident", "nowhere"))
    assert r.outcome == pb.OUTCOME_REJECTED and r.reason == pb.REASON_UNKNOWN_DESTINATION, r
    (r,) = a.apply(demote("no-such-session"))
    assert r.outcome == pb.OUTCOME_MISSING, r

    # A selection larger than the host tier (B: 40 blocks) is RESOURCE_EXHAUSTED up front.
    b.complete(tokens("tier-big-1"), "tier-big")
    b.complete(tokens("tier-big-2"), "tier-big")  # 44 blocks on G1
    (r,) = b.apply(demote("tier-big"))
    assert r.outcome == pb.OUTCOME_REJECTED and r.reason == pb.REASON_RESOURCE_EXHAUSTED, r
    (r,) = b.apply(pb.Hint(selector=session_sel("tier-big"), demote=pb.DemoteAction(), max_blocks=40))
    assert r.outcome == pb.OUTCOME_DEFERRED, r
    op, _ = b.wait_op(r.operation_id)
    assert op.state == pb.Operation.STATE_SUCCEEDED and {c.tier: c.blocks for c in op.blocks} == {pb.TIER_HOST: 40}, (op.state, op.reason, op.message, op.bytes_moved)

    # A Share to a peer that does not answer fails with a reason, quickly.
    a.complete(tokens("tier-down"), "tier-down")
    (r,) = a.apply(share("tier-down", "down"))
    assert r.outcome == pb.OUTCOME_DEFERRED, r
    op, seconds = a.wait_op(r.operation_id, timeout=25)
    assert op.state == pb.Operation.STATE_FAILED and op.reason == pb.REASON_OPERATION_FAILED, op
    assert "down" in op.message and seconds < 25

    # A Prefetch that cannot finish by its deadline fails DEADLINE_EXCEEDED.
    a.complete(tokens("tier-deadline"), "tier-deadline")
    _wait_disk(a, "tier-deadline", 22)
    a.fill("tier-deadline", n=4)
    assert all(t == {pb.TIER_DISK} for t in a.session_tiers("tier-deadline"))
    (r,) = a.apply(prefetch("tier-deadline", deadline={"nanos": 1_000_000}))
    assert r.outcome == pb.OUTCOME_DEFERRED, r
    op, _ = a.wait_op(r.operation_id, timeout=10)
    assert op.state == pb.Operation.STATE_FAILED and op.reason == pb.REASON_DEADLINE_EXCEEDED, op
    assert a.stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=5)  # still serving


def test_clean_shutdown_leaves_no_shared_memory_or_tier_files(pair: Pair) -> None:
    assert any(pair.root.rglob("*.bin")), "the tests wrote no file-tier blocks"
    groups = {e.served.proc.pid for e in (pair.a, pair.b) if e.served.proc is not None}
    ours = mapped_regions(groups)
    assert len(ours) == 2, f"each engine's host tier maps one shared memory file: {ours}"
    pair.stop()
    assert pair.a.served.proc is None and pair.b.served.proc is None
    assert not [p for p in ours if os.path.exists(p)], ours
    assert left_behind() <= pair.shm_before
    left = [p for p in pair.root.rglob("*") if p.is_file()]
    assert not left, left[:5]
    with grpc.insecure_channel(pair.a.grpc_address) as channel, pytest.raises(grpc.RpcError):
        pbg.KvHintServiceStub(channel).GetCapabilities(pb.GetCapabilitiesRequest(), timeout=2)
