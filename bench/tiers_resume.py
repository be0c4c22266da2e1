"""Resume TTFT of a long session after a pause under cache pressure, four ways.

Three `vllm serve` engines with the KvHint scheduler run side by side on the
generated `bench` model (hidden 512, 4 layers: prefill dominates TTFT):

  E0  no KV tiers                                         -> variant "no hint"
  A   --kvhint-tiers host=H,file=ROOT,peer=b=<B>          -> "Demote", "Demote + Prefetch"
  B   --kvhint-tiers host=H,file=ROOT,peer=a=<A>          -> destination of "Share"

Every repetition runs each variant on a fresh session (random tokens) and a
cleared cache (G1 and host tier; the file tier persists, fresh tokens never hit it):

  turn 1     the session's prompt (P tokens) plus 16 generated tokens
  hint       variant-specific (below), completion awaited through GetOperation
  pressure   F filler prompts of P tokens on the session's engine: the session
             leaves G1 and, with the default sizes, the host tier too
  pause      --pause seconds
  [prefetch] Demote + Prefetch only: Prefetch, awaited (off the TTFT path)
  resume     turn 2 = turn-1 prompt + its output + 64 new tokens; TTFT measured
             at the client (streaming), then checked token for token against the
             session replayed on the same engine under a fresh cache_salt (turn 1
             recomputed, resume from G1), and against one full prefill

  no hint            E0: evicted -> recompute
  Demote             A: Demote after turn 1; resume reloads what the tiers kept
  Demote + Prefetch  A: Demote after turn 1, Prefetch before the resume
  Share              A: Share to B after turn 1 (pressure on A); resume on B

Bytes moved: "hint" is the sum of the operations' bytes_moved (G1->host copies
the engine made, host->file writes it forced, file->host promotions, and for
Share the destination's promotion); "resume" is what the resuming request
itself loaded: vllm:kv_offload_load_bytes (host->G1) plus
vllm:kv_offload_tiering_read_bytes (file->host) on that engine.

  python -m bench.tiers_resume                  # full run, writes bench/results/tiers_resume.md
  python -m bench.tiers_resume --fast           # CI smoke: tiny model, 1 repetition
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from engine_integration.served import EngineSpec, ServedEngine, default_model, free_port, reset_prefix_cache
from kvhint.v1 import kvhint_pb2 as pb
from kvhint.v1 import kvhint_pb2_grpc as pbg
from kvhint_client.openai_traffic import Completion, complete

VARIANTS = ("no hint (recompute)", "Demote", "Demote + Prefetch", "Share -> B")
RESULTS = Path(__file__).resolve().parent / "results" / "tiers_resume.md"


def _tokens(seed: str, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randint(3, 4000) for _ in range(n)]


class Node:
    """One served engine: HTTP (OpenAI API, metrics, dev reset) + KvHint gRPC."""

    def __init__(self, name: str, served: ServedEngine) -> None:
        self.name, self.served = name, served
        self.channel: grpc.Channel | None = None
        self.stub: pbg.KvHintServiceStub | None = None

    def connect(self) -> None:
        self.channel = grpc.insecure_channel(self.served.grpc_address)
        self.stub = pbg.KvHintServiceStub(self.channel)

    @property
    def http(self) -> str:
        return self.served.http_url

    def complete(self, prompt: list[int], session: str | None = None, max_tokens: int = 1) -> Completion:
        return complete(self.http, prompt, session_id=session, max_tokens=max_tokens, timeout=600)

    def recompute(self, prompt: list[int], max_tokens: int, salt: str | None = None) -> Completion:
        """The prompt computed on this engine under a cache_salt (fresh unless
        given): block hashes that no tier holds."""
        salt = salt or f"recompute-{time.monotonic_ns()}"
        return complete(self.http, prompt, max_tokens=max_tokens, timeout=600, extra_body={"cache_salt": salt})

    def reset(self) -> None:
        """Empty G1 and the host tier (retrying while a finished request still holds blocks)."""
        reset_prefix_cache(self.http, external=True)

    def hint(self, hint: pb.Hint) -> pb.HintResult:
        assert self.stub is not None
        (result,) = self.stub.ApplyHints(pb.ApplyHintsRequest(hints=[hint]), timeout=30).results
        return result

    def run_op(self, hint: pb.Hint, timeout: float = 120.0) -> tuple[pb.Operation | None, float, pb.HintResult]:
        """Apply a tier hint and wait for its operation; (operation, seconds, result)."""
        assert self.stub is not None
        t0 = time.perf_counter()
        result = self.hint(hint)
        if result.outcome != pb.OUTCOME_DEFERRED:
            return None, time.perf_counter() - t0, result
        deadline = time.monotonic() + timeout
        while True:
            op = self.stub.GetOperation(pb.GetOperationRequest(operation_id=result.operation_id), timeout=10).operation
            if op.state in (pb.Operation.STATE_SUCCEEDED, pb.Operation.STATE_FAILED):
                return op, time.perf_counter() - t0, result
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: operation {result.operation_id} did not finish")
            time.sleep(0.005)

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.http + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line.startswith("vllm:") or "_created" in line:
                continue
            key, value = line.rsplit(" ", 1)
            name = key.split("{", 1)[0]
            if 'source="' in key:
                name += ":" + key.split('source="', 1)[1].split('"', 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
        return out

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def _settled_metrics(node: Node, before: dict[str, float], cached_tokens: int) -> dict[str, float]:
    """Metrics once the frontend recorded the resume's cached tokens (stats are async)."""
    deadline = time.monotonic() + 5
    while True:
        now = node.metrics()
        got = sum(_delta(before, now, k) for k in now if k.startswith("vllm:prompt_tokens_cached_by_source_total:"))
        if got >= cached_tokens or time.monotonic() > deadline:
            time.sleep(0.2)  # connector transfer stats arrive with the same or the next step
            return node.metrics()
        time.sleep(0.05)


@dataclass
class Sample:
    variant: str
    ttft_s: float
    cached: int
    prompt: int
    sources: dict[str, int]
    hint_bytes: int
    resume_bytes: int
    prep_s: float  # hint operations before the resume (off the TTFT path)
    identical: bool      # = the session replayed under a fresh cache_salt, resume from G1 (bitwise the same KV)
    same_as_full: bool   # = one full prefill of the resume prompt (differs only by vLLM's numerics, see notes)
    ops: list[tuple[str, float]] = field(default_factory=list)  # (action, seconds until the operation completed)


def session_selector(session: str) -> pb.Selector:
    return pb.Selector(session=pb.SessionSelector(session_id=session))


def run_variant(variant: str, rep: int, args: argparse.Namespace, e0: Node, a: Node, b: Node) -> Sample:
    session = f"tiers-{args.seed}-{rep}-{VARIANTS.index(variant)}"
    prompt = _tokens(f"{args.seed}-{session}", args.prompt_tokens)
    home = e0 if variant == VARIANTS[0] else a
    resume_on = b if variant == VARIANTS[3] else home
    for node in (e0, a, b):
        node.reset()
    turn1 = home.complete(prompt, session, max_tokens=16)
    hint_bytes, prep_s, ops = 0, 0.0, []

    def op(node: Node, hint: pb.Hint) -> None:
        nonlocal hint_bytes, prep_s
        done, seconds, result = node.run_op(hint)
        if done is None:
            raise RuntimeError(f"{variant}: {pb.Outcome.Name(result.outcome)} {result.message}")
        if done.state != pb.Operation.STATE_SUCCEEDED:
            raise RuntimeError(f"{variant}: operation failed: {pb.Reason.Name(done.reason)} {done.message}")
        hint_bytes += done.bytes_moved
        prep_s += seconds
        ops.append((pb.Action.Name(done.action)[7:].lower(), seconds))

    if variant in (VARIANTS[1], VARIANTS[2]):
        op(a, pb.Hint(selector=session_selector(session), demote=pb.DemoteAction()))
    elif variant == VARIANTS[3]:
        op(a, pb.Hint(selector=session_selector(session), share=pb.ShareAction(destination="b")))
    for i in range(args.fillers):
        home.complete(_tokens(f"{args.seed}-filler-{session}-{i}", args.prompt_tokens))
    time.sleep(args.pause)
    if variant == VARIANTS[2]:
        op(a, pb.Hint(selector=session_selector(session), prefetch=pb.PrefetchAction()))

    resume = prompt + list(turn1.token_ids) + _tokens(f"{args.seed}-{session}-turn2", 64)
    before = resume_on.metrics()
    out = resume_on.complete(resume, session, max_tokens=args.max_tokens)
    after = _settled_metrics(resume_on, before, out.cached_tokens)
    sources = {
        k.split(":", 2)[-1]: int(_delta(before, after, k))
        for k in after
        if k.startswith("vllm:prompt_tokens_cached_by_source_total:") and _delta(before, after, k)
    }
    resume_bytes = int(
        _delta(before, after, "vllm:kv_offload_load_bytes_total")
        + _delta(before, after, "vllm:kv_offload_tiering_read_bytes_total")
    )
    full = resume_on.recompute(resume, args.max_tokens)
    if variant == VARIANTS[0]:
        identical = out.token_ids == full.token_ids  # the resume itself was a recompute
    else:
        # Replay the session on the resuming engine under a fresh salt: turn 1
        # recomputed, then the resume hits that KV in G1. A reload from the tiers
        # must give exactly these tokens (the copies are bitwise the KV computed).
        salt = f"replay-{time.monotonic_ns()}"
        resume_on.recompute(prompt, 16, salt)
        replay = resume_on.recompute(resume, args.max_tokens, salt)
        # A resume that missed the tiers (cached 0) was itself a full prefill.
        identical = out.token_ids == (replay.token_ids if out.cached_tokens else full.token_ids)
    return Sample(variant, out.ttft_s, out.cached_tokens, len(resume), sources, hint_bytes, resume_bytes, prep_s,
                  identical, out.token_ids == full.token_ids and full.cached_tokens == 0, ops)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def report(samples: list[Sample], args: argparse.Namespace, command: str, setup: str) -> str:
    lines = [
        "# Resume TTFT after a pause under pressure: no hint / Demote / Demote + Prefetch / Share",
        "",
        f"Command: `{command}`",
        "",
        setup,
        "",
        "| variant | resume TTFT median (ms) | min-max (ms) | cached tokens / prompt | cached from | "
        "hint bytes (MiB) | resume bytes (MiB) | total moved (MiB) | hint operations (median time to complete) | "
        "tokens = G1-resident replay | tokens = full prefill |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = None
    for variant in VARIANTS:
        rows = [s for s in samples if s.variant == variant]
        if not rows:
            continue
        ttft = [s.ttft_s * 1000 for s in rows]
        med = statistics.median(ttft)
        base = med if base is None else base
        cached = statistics.median(s.cached for s in rows)
        sources: dict[str, int] = {}
        for s in rows:
            for k, v in s.sources.items():
                sources[k] = sources.get(k, 0) + v
        src = ", ".join(f"{k} {v // len(rows)}" for k, v in sorted(sources.items())) or "-"
        hint_b = statistics.median(s.hint_bytes for s in rows)
        resume_b = statistics.median(s.resume_bytes for s in rows)
        names = list(dict.fromkeys(name for s in rows for name, _ in s.ops))
        ops = "; ".join(
            f"{name} {statistics.median(sec for s in rows for n, sec in s.ops if n == name) * 1000:.0f} ms" for name in names
        ) or "-"
        same = "yes" if all(s.identical for s in rows) else f"NO ({sum(not s.identical for s in rows)} of {len(rows)})"
        full_same = f"{sum(s.same_as_full for s in rows)} of {len(rows)}"
        speed = f" ({base / med:.1f}x)" if variant != VARIANTS[0] and med > 0 else ""
        lines.append(
            f"| {variant} | {med:.1f}{speed} | {min(ttft):.1f}-{max(ttft):.1f} | {cached:.0f} / {rows[0].prompt} | {src} | "
            f"{_mib(hint_b)} | {_mib(resume_b)} | {_mib(hint_b + resume_b)} | {ops} | {same} | "
            f"{full_same} |"
        )
    lines += [
        "",
        "Notes:",
        "- TTFT is measured at the client (streamed /v1/completions, localhost), median over the repetitions;",
        "  (Nx) is the speed-up over the recompute. Hint operations run before the resume and are not in TTFT.",
        "  The machine (2 cores) is shared with other workloads: see min-max for the noise.",
        "- Demote: the copy it guarantees went to the host tier and, by vLLM's cascade, to the file tier; the",
        "  pressure then pushed it out of the host tier, so the resume reads the files (the connector promotes them",
        "  file -> host -> G1 inside the request). Resumed right after the pressure (--pause 0), that promotion",
        "  can find no evictable host chunk (chunks pinned by the fillers' file writes) and vLLM then reports a miss:",
        "  the resume recomputes. Prefetch retries until the host tier can take the copies, before the resume.",
        "- vLLM's OffloadingConnector loads KV into G1 only for a request it admits: Prefetch stages the copies",
        "  in the host tier (file -> host), so the resume's load is a host hit instead of a file read.",
        "- The Share variant applies the pressure on A and resumes on B, which got the session through the",
        "  shared file tier and its own Prefetch (Share completes only after B's Prefetch succeeded).",
        "- \"tokens = G1-resident replay\": the session replayed on the resuming engine under a fresh cache_salt",
        "  (turn 1 recomputed, the resume hits that KV in G1) gives exactly the reloaded resume's tokens: the tier",
        "  copies are bitwise the KV the engine computed. For \"no hint\" the column compares with a full prefill.",
        "- \"tokens = full prefill\" (how many repetitions): one prefill of the whole resume prompt. It computes",
        "  the turn-1 decode tokens' KV (and chunk boundaries) differently from the original turn, so in bf16 a",
        "  greedy token can differ, exactly as for a plain G1 prefix hit (stock vLLM prefix caching). Engines with",
        "  and without a KV connector also compile different graphs, so compare tokens within one configuration.",
    ]
    return "\n".join(lines) + "\n"


def start_engines(args: argparse.Namespace, root: Path, log_dir: Path) -> tuple[Node, Node, Node]:
    model = default_model(args.preset)
    port_a, port_b = free_port(), free_port()
    base = dict(model=model, block_size=32, num_gpu_blocks=args.gpu_blocks, max_model_len=args.max_model_len,
                env={"VLLM_SERVER_DEV_MODE": "1"})
    tiers = f"host={args.host_blocks},file={root},ephemeral"
    specs = {
        "E0": EngineSpec(**base),  # type: ignore[arg-type]
        "A": EngineSpec(**base, grpc_port=port_a, extra_args=["--kvhint-tiers", f"{tiers},peer=b=127.0.0.1:{port_b}"]),  # type: ignore[arg-type]
        "B": EngineSpec(**base, grpc_port=port_b, extra_args=["--kvhint-tiers", f"{tiers},peer=a=127.0.0.1:{port_a}"]),  # type: ignore[arg-type]
    }
    nodes = {name: Node(name, ServedEngine(spec, log_dir / f"{name}.log")) for name, spec in specs.items()}
    errors: list[BaseException] = []

    def start(node: Node) -> None:
        try:
            node.served.start(timeout=600)
            node.connect()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(n,)) for n in nodes.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        stop_engines(list(nodes.values()))
        raise errors[0]
    return nodes["E0"], nodes["A"], nodes["B"]


def stop_engines(nodes: list[Node]) -> None:
    threads = [threading.Thread(target=n.served.stop) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for n in nodes:
        n.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fast", action="store_true", help="CI smoke: tiny model, short prompts, 1 repetition")
    p.add_argument("--preset", default=None, help="generated model preset (default bench; --fast: tiny)")
    p.add_argument("--reps", type=int, default=None, help="repetitions per variant (default 5; --fast: 1)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="turn-1 prompt length (default 3000; --fast 1400)")
    p.add_argument("--fillers", type=int, default=3, help="pressure prompts of the same length after turn 1")
    p.add_argument("--pause", type=float, default=None, help="seconds between pressure and resume (default 2; --fast 1)")
    p.add_argument("--gpu-blocks", type=int, default=None, help="G1 blocks (default 200; --fast 80)")
    p.add_argument("--host-blocks", type=int, default=None, help="host-tier blocks (default 128; --fast 64)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated by the resume")
    p.add_argument("--seed", default="0")
    p.add_argument("--out", type=Path, default=None, help=f"markdown table (default {RESULTS}; --fast: stdout only)")
    args = p.parse_args(argv)
    fast = args.fast
    defaults = {"preset": ("bench", "tiny"), "reps": (5, 1), "prompt_tokens": (3000, 1400), "pause": (2.0, 1.0),
                "gpu_blocks": (200, 80), "host_blocks": (128, 64), "max_model_len": (4096, 2048)}
    for key, (full, quick) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if fast else full)
    out_path = args.out if args.out is not None else (None if fast else RESULTS)
    command = "python -m bench.tiers_resume " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))

    blocks = args.prompt_tokens // 32
    setup = (
        f"Setup: model `{args.preset}` preset, block 32, G1 {args.gpu_blocks} blocks, host tier {args.host_blocks} blocks, "
        f"shared file tier (tmpfs/disk under {tempfile.gettempdir()}), session prompt {args.prompt_tokens} tokens "
        f"(~{blocks} blocks) + 16 generated, pressure {args.fillers} x {args.prompt_tokens} tokens, pause {args.pause:g} s, "
        f"{args.reps} repetitions; 3 engines on one machine."
    )
    print(setup, flush=True)
    with tempfile.TemporaryDirectory(prefix="kvhint-tiers-bench-") as tmp:
        root = Path(tmp) / "fs"
        t0 = time.perf_counter()
        e0, a, b = start_engines(args, root, Path(tmp))
        print(f"engines up in {time.perf_counter() - t0:.0f} s", flush=True)
        samples: list[Sample] = []
        try:
            for rep in range(args.reps):
                for variant in VARIANTS:
                    s = run_variant(variant, rep, args, e0, a, b)
                    samples.append(s)
                    print(f"rep {rep} {variant:22s} TTFT {s.ttft_s * 1000:7.1f} ms cached {s.cached:5d}/{s.prompt} "
                          f"{s.sources} hint {s.hint_bytes} B resume {s.resume_bytes} B identical={s.identical} "
                          f"full={s.same_as_full} "
                          f"{'; '.join(f'{n} {sec * 1000:.0f} ms' for n, sec in s.ops)}", flush=True)
        finally:
            stop_engines([e0, a, b])
    text = report(samples, args, command, setup)
    print(text)
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(text)
        print(f"wrote {out_path}")
    return 0 if all(s.identical for s in samples) else 1


if __name__ == "__main__":
    sys.exit(main())
