"""Engine tests: KV tiers on the CPU backend (engine_integration.tiers).

Each engine runs in a child process: this file doubles as the child script
(`python test_tier_spec.py <mode> ...`), so pytest itself never imports vLLM
engines, and a crashed engine cannot leave state in the test process. Children
run with a small block pool (80 blocks of 32 tokens) so four 720-token filler
prompts evict a 720-token prompt (22 full blocks = 704 tokens) from G1.

* host-tier round trip (in-process engine, TierControl for white-box checks):
  evicted from G1, reloaded from G2: 704 cached tokens, identical logprobs;
  negative control: garbage in the host copies changes the output.
* two-process file-tier share: engine A (default multiprocess engine) computes a
  prompt into a shared `fs` root; engine B (separate process, in-process engine)
  sees the files from its scheduler side, prefetches half of them into its host
  tier without a request, and serves the prompt with 704 cached tokens and
  logprobs identical to A's, while A is still running.
"""

from __future__ import annotations

import glob
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from offload_shm import left_behind

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
N_TOKENS, N_BLOCKS = 720, 22
ENGINE_KW = dict(gpu_memory_utilization=0.1, block_size=32, num_gpu_blocks_override=80,
                 max_model_len=1024, enforce_eager=True)


# ------------------------------------------------------------------ children
def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 4000) for _ in range(N_TOKENS)] for _ in range(n)]


def _run(llm, rid: str, ids: list[int]) -> dict:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    llm.llm_engine.add_request(rid, {"prompt_token_ids": ids}, sp, session_id=f"s-{rid}")
    while True:
        for out in llm.llm_engine.step():
            if out.request_id == rid and out.finished:
                lp = out.outputs[0].logprobs[0]
                return {"cached": out.num_cached_tokens, "tokens": list(out.outputs[0].token_ids),
                        "logprobs": {str(k): v.logprob for k, v in lp.items()}}


def _llm(model: str, kv_transfer_config: dict, events: bool = False):
    from vllm import LLM

    kw = dict(ENGINE_KW)
    if events:
        kw["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "null"}
    return LLM(model=model, kv_transfer_config=kv_transfer_config, **kw)


def child_roundtrip(model: str, out_path: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # scheduler reachable for white-box checks
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from engine_integration.tiers.config import tier_kv_transfer_config
    from engine_integration.tiers.control import HostState, TierControl

    res: dict = {}
    t0 = time.time()
    llm = _llm(model, tier_kv_transfer_config(host_blocks=128))
    res["engine_start_s"] = time.time() - t0
    try:
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        ctl = TierControl(sched)
        P = _prompts(5, seed=1)
        ha = ctl.block_hashes(P[0])
        t1 = time.time()
        res["first"] = _run(llm, "a0", P[0])
        res["first_s"] = time.time() - t1
        res["fillers"] = [_run(llm, f"f{i}", P[i])["cached"] for i in range(1, 5)]
        res["a_in_g1"] = sum(ctl.g1_has(h) for h in ha)
        res["a_host_ready"] = sum(ctl.host_state(h) is HostState.READY for h in ha)
        res["demote_ready"] = len(ctl.demote_check(ha).ready)
        t1 = time.time()
        res["again"] = _run(llm, "a1", P[0])
        res["reload_s"] = time.time() - t1
        # negative control: garbage host copies must change the output
        worker = get_kv_transfer_group().connector_worker.worker
        for t in worker._host:
            t.copy_(torch.randint(-128, 127, t.shape, dtype=torch.int8))
        res["reset_g1"] = sched.reset_prefix_cache()
        res["garbage"] = _run(llm, "a2", P[0])
    finally:
        llm.llm_engine.engine_core.shutdown()
    Path(out_path).write_text(json.dumps(res))


def child_share_writer(model: str, root: str, out_path: str, stop_path: str) -> None:
    # Default engine mode: EngineCore and worker in their own processes.
    from engine_integration.tiers.config import tier_kv_transfer_config

    t0 = time.time()
    llm = _llm(model, tier_kv_transfer_config(host_blocks=128, file_root=root))
    try:
        res = {"engine_start_s": time.time() - t0, "a": _run(llm, "a0", _prompts(1, seed=2)[0])}
        Path(out_path).write_text(json.dumps(res))
        deadline = time.time() + 300
        while not os.path.exists(stop_path) and time.time() < deadline:
            time.sleep(0.2)
    finally:
        llm.llm_engine.engine_core.shutdown()


def child_share_reader(model: str, root: str, out_path: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from collections import Counter

    from engine_integration.tiers.config import tier_kv_transfer_config
    from engine_integration.tiers.control import HostState, Prefetch, TierControl

    res: dict = {}
    t0 = time.time()
    llm = _llm(model, tier_kv_transfer_config(host_blocks=128, file_root=root), events=True)
    res["engine_start_s"] = time.time() - t0
    try:
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        ctl = TierControl(sched)
        events: list = []
        ctl.tap_events(events.extend)
        ha = ctl.block_hashes(_prompts(1, seed=2)[0])
        res["visible"] = sum(ctl.file_has(h) for h in ha)
        res["host_before"] = sum(ctl.host_state(h) is HostState.READY for h in ha)
        t1 = time.time()
        pf = Prefetch(ctl, ha[: N_BLOCKS // 2])
        seen = [s.name for s in pf.state.values()]
        while not pf.poll():
            llm.llm_engine.step()
            seen += [s.name for s in pf.state.values()]
            if time.time() - t1 > 60:
                break
        seen += [s.name for s in pf.state.values()]
        res["prefetch"] = {"done": pf.closed, "hits": len(pf.hits), "misses": len(pf.misses),
                           "polls": pf.polls, "s": time.time() - t1, "states_seen": sorted(set(seen))}
        res["host_after_prefetch"] = sum(ctl.host_state(h) is HostState.READY for h in ha)
        res["b"] = _run(llm, "b0", _prompts(1, seed=2)[0])
        res["host_after_request"] = sum(ctl.host_state(h) is HostState.READY for h in ha)
        for _ in range(3):
            llm.llm_engine.step()
        res["events"] = {f"{n}/{m}": c for (n, m), c in Counter(
            (type(e).__name__, e.medium) for e in events).items()}
    finally:
        llm.llm_engine.engine_core.shutdown()
    Path(out_path).write_text(json.dumps(res))


# ------------------------------------------------------------------- helpers
def _env() -> dict:
    env = dict(os.environ)
    # Children choose their engine mode: the share writer needs vLLM's default (EngineCore in its
    # own process, whose busy loop finishes the file-tier stores while the writer waits); an
    # earlier import in this pytest process (bench.step_overhead) may have set in-process mode.
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def _child(*args: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *args]


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the child's own session: child + EngineCore + worker
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


@pytest.fixture(scope="session")
def tier_model(tmp_path_factory) -> str:
    """Own fixture (conftest.tiny_model serves `vllm serve`; these tests spawn offline engines)."""
    pytest.importorskip("vllm")
    from engine_integration.tiny_model import make_tiny_model

    path = os.environ.get("KVHINT_TINY_MODEL") or str(tmp_path_factory.mktemp("tiny"))
    make_tiny_model(path)
    return path


# --------------------------------------------------------------------- tests
@pytest.mark.engine
def test_tier_kv_transfer_config_shapes():
    from engine_integration.tiers.config import tier_kv_transfer_config

    cpu = tier_kv_transfer_config(host_blocks=64, platform="cpu")
    ec = cpu["kv_connector_extra_config"]
    assert cpu["kv_connector"] == "OffloadingConnector" and cpu["kv_role"] == "kv_both"
    assert ec["spec_name"] == "TorchCPUOffloadingSpec" and ec["num_host_blocks"] == 64
    assert ec["spec_module_path"] == "engine_integration.tiers.cpu_spec"
    tier = tier_kv_transfer_config(host_bytes=1 << 20, file_root="/x", platform="cpu")["kv_connector_extra_config"]
    assert tier["spec_name"] == "TorchTieringOffloadingSpec" and tier["cpu_bytes_to_use"] == 1 << 20
    assert tier["secondary_tiers"][0]["type"] == "fs" and tier["secondary_tiers"][0]["root_dir"] == "/x"
    gpu = tier_kv_transfer_config(host_blocks=10, platform="cuda", bytes_per_block=4096)["kv_connector_extra_config"]
    assert gpu == {"eviction_policy": "lru", "cpu_bytes_to_use": 40960, "spec_name": "CPUOffloadingSpec"}
    mine = tier_kv_transfer_config(host_blocks=10, platform="cuda", bytes_per_block=4096, eviction_policy="kvhint")
    assert mine["kv_connector_extra_config"] == {
        "eviction_policy": "KvHintHostPolicy", "cache_policy_module_path": "engine_integration.tiers.host_policy",
        "cpu_bytes_to_use": 40960, "spec_name": "CPUOffloadingSpec"}
    gpu = tier_kv_transfer_config(host_bytes=8192, file_root="/x", platform="cuda")["kv_connector_extra_config"]
    assert gpu["spec_name"] == "TieringOffloadingSpec" and "spec_module_path" not in gpu
    with pytest.raises(ValueError):
        tier_kv_transfer_config(host_blocks=10, platform="cuda")  # bytes unknown
    with pytest.raises(ValueError):
        tier_kv_transfer_config(host_blocks=1, host_bytes=1, platform="cpu")


@pytest.mark.engine
def test_host_tier_round_trip(tier_model, tmp_path):
    out = tmp_path / "rt.json"
    shm0 = left_behind()
    p = subprocess.run(_child("roundtrip", tier_model, str(out)), env=_env(), cwd=REPO,
                       capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["first"]["cached"] == 0
    assert r["a_in_g1"] == 0, "fillers did not evict the prompt from the block pool"
    assert r["a_host_ready"] == N_BLOCKS and r["demote_ready"] == N_BLOCKS
    assert r["again"]["cached"] == N_BLOCKS * 32  # 704 tokens from the host tier
    assert r["again"]["tokens"] == r["first"]["tokens"]
    assert r["again"]["logprobs"] == r["first"]["logprobs"]  # bit-identical
    assert r["reset_g1"] is True
    assert r["garbage"]["cached"] == N_BLOCKS * 32
    assert r["garbage"]["logprobs"] != r["first"]["logprobs"], "loaded KV is not used"
    assert left_behind() <= shm0


@pytest.mark.engine
def test_two_process_file_tier_share(tier_model, tmp_path):
    root, a_out, b_out, stop = (tmp_path / n for n in ("fs", "a.json", "b.json", "stop"))
    shm0 = left_behind()
    writer = subprocess.Popen(_child("share-writer", tier_model, str(root), str(a_out), str(stop)),
                              env=_env(), cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 300
        # Writer-side completion = every block's file exists (written to .tmp, then renamed).
        while time.time() < deadline and not (
                a_out.exists() and len(glob.glob(f"{root}/*_r0/*/*/*.bin")) >= N_BLOCKS):
            assert writer.poll() is None, writer.stderr.read()[-4000:]
            time.sleep(0.2)
        assert a_out.exists(), "writer produced no output"
        assert len(glob.glob(f"{root}/*_r0/*/*/*.bin")) == N_BLOCKS
        p = subprocess.run(_child("share-reader", tier_model, str(root), str(b_out)), env=_env(),
                           cwd=REPO, capture_output=True, text=True, timeout=400)
        assert p.returncode == 0, p.stderr[-4000:]
        assert writer.poll() is None, "writer must still be running while the reader is served"
        stop.touch()
        assert writer.wait(timeout=120) == 0, writer.stderr.read()[-4000:]
    finally:
        _kill_group(writer)
    a, b = json.loads(a_out.read_text()), json.loads(b_out.read_text())
    assert a["a"]["cached"] == 0
    assert b["visible"] == N_BLOCKS and b["host_before"] == 0
    pf = b["prefetch"]
    assert pf["done"] and pf["hits"] == N_BLOCKS // 2 and pf["misses"] == 0, pf
    assert "RETRY" in pf["states_seen"] and "HIT" in pf["states_seen"], pf
    assert b["host_after_prefetch"] == N_BLOCKS // 2
    assert b["b"]["cached"] == N_BLOCKS * 32
    assert b["b"]["tokens"] == a["a"]["tokens"] and b["b"]["logprobs"] == a["a"]["logprobs"]
    assert b["host_after_request"] == N_BLOCKS
    assert b["events"].get("BlockStored/CPU", 0) >= N_BLOCKS  # promotions into the host tier
    assert left_behind() <= shm0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    mode, *argv = sys.argv[1:]
    {"roundtrip": child_roundtrip, "share-writer": child_share_writer,
     "share-reader": child_share_reader}[mode](*argv)
