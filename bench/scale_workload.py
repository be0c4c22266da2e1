"""The agentic workload of `bench.scale`: sessions that share system prompts and grow turn by turn.

Pure and deterministic (no vLLM import): the same `Shape` and seed give the same arrivals,
prompts and hints, so a stock and a KvHint scheduler can be fed identical work.

  * `system_prompts` shared system prompts of `system_tokens` tokens; session i uses prompt
    i % system_prompts (prefix sharing across sessions).
  * Every session starts with `first_context_tokens` private tokens. A turn's prompt is the
    system prompt + the session's context + `new_tokens_per_turn` new tokens; the turn decodes
    `max_tokens` tokens, and the prompt and output become the next turn's context (so a resumed
    session hits its own prefix while it is resident).
  * A session whose next turn would not fit `max_model_len` ends; a new session (new id, same
    slot and system prompt) takes its place, so the live population stays at `sessions`.
  * Each step, `arrivals_per_step` idle sessions, drawn uniformly, send their next turn.
  * Hints (KvHint side only, `hints_per_step` per step): Retain for sessions that just finished
    a turn (a tool call pauses the agent), Pin for a few idle sessions about to resume, Release
    for idle sessions and for sessions that end.

Output tokens are what `engine_integration.inproc.default_sample` samples for the request id, so
the workload knows a turn's output without reading it back from the engine.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Shape:
    """One configuration of the scale benchmark."""

    pool_blocks: int
    sessions: int
    steps: int = 300  # measured steady-state steps (after `warmup_steps`)
    warmup_steps: int = 30
    quiet_rounds: int = 4  # rounds of "nothing changes" steps (see bench.scale)
    block_size: int = 16
    max_model_len: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    arrivals_per_step: int = 8
    new_tokens_per_turn: int = 64
    max_tokens: int = 24
    system_prompts: int = 16
    system_tokens: int = 1024
    first_context_tokens: int = 128
    hints_per_step: int = 0
    # Hints only in the warm-up steps: the measured steps then run with the grants they left in
    # effect and no hint changing (the state of an engine that retains paused sessions).
    hints_in_warmup_only: bool = False
    # Retention TTLs in steps (Retain 3x this, Pin 1x): long enough, with hints_in_warmup_only,
    # for the warm-up's grants to outlast the measured steps.
    hint_ttl_steps: int = 100
    step_seconds: float = 0.02  # simulated GPU step: 50 steps/s (hint rate and TTLs use it)
    seed: int = 0
    # The stock side publishes vLLM's own KV cache events (ZMQ), as a router that follows
    # them needs; the KvHint side does not (its WatchEvents stream replaces them).
    stock_kv_events: bool = False
    # Both sides run vLLM's AsyncScheduler (the GPU default) instead of the Scheduler.
    async_scheduling: bool = False
    # KvHint's residency bookkeeping (ServerConfig.residency_bookkeeping): "auto" is what
    # KvHintScheduler picks (deferred under async scheduling), or "inline" / "deferred".
    bookkeeping: str = "auto"
    # Deferred bookkeeping settled by the journal's own settler thread, as on an engine, instead
    # of by the driver after each unit (its CPU then is not in kv_settle_ns; waits for the GIL
    # show in the wall times).
    settler_thread: bool = False
    # In each side's step, sleep this long with the GIL free where EngineCore waits for the
    # model's output (between schedule() and update_from_output(); inproc.step): the device's
    # share of a step on a GPU engine, in which a settler thread runs.
    gpu_wait_s: float = 0.0
    # The pool's KV-cache layout: one full-attention group (a dense model), or a hybrid model's
    # two groups sharing it, full attention (group 0) and a sliding window of
    # `sliding_window` tokens (group 1), as vLLM builds for Gemma 2 (inproc.make_kv_cache_config).
    hybrid: bool = False
    sliding_window: int = 128

    @property
    def deferred(self) -> bool:
        """The KvHint side books residency deferred (what KvHintScheduler's "auto" picks: deferred
        under async scheduling)."""
        return self.bookkeeping == "deferred" or (self.bookkeeping == "auto" and self.async_scheduling)

    @property
    def label(self) -> str:
        hints = f", {self.hints_per_step / self.step_seconds:.0f} hints/s" if self.hints_per_step else ""
        if self.hints_per_step and self.hints_in_warmup_only:
            hints = f", retention grants in effect (from {self.hints_per_step / self.step_seconds:.0f} hints/s in the warm-up), no hint changing"
        events = ", against stock with vLLM's KV events on" if self.stock_kv_events else ""
        mode = ", async scheduling" if self.async_scheduling else ""
        if self.async_scheduling and not self.deferred:
            mode += ", inline bookkeeping"
        elif self.deferred:
            mode += ", deferred bookkeeping" + (" (settler thread)" if self.settler_thread else "")
        if self.gpu_wait_s:
            mode += f", {self.gpu_wait_s * 1e3:.0f} ms device wait per step"
        layout = f", hybrid layout (full attention + {self.sliding_window}-token sliding window)" if self.hybrid else ""
        return f"{self.pool_blocks} blocks{layout}, {self.sessions} sessions{hints}{events}{mode}"


def tokens(seed: object, n: int) -> list[int]:
    rng = random.Random(str(seed))
    return [rng.randint(3, 4000) for _ in range(n)]


@dataclass
class Session:
    slot: int
    generation: int
    context: list[int]
    turn: int = 0
    running: bool = False

    @property
    def session_id(self) -> str:
        return f"s{self.slot}.{self.generation}"


@dataclass(frozen=True)
class Turn:
    """One request: `request_id`, the prompt, the session and the continuation it continues."""

    request_id: str
    prompt: list[int]
    session_id: str
    continuation_id: str
    max_tokens: int


@dataclass(frozen=True)
class HintPlan:
    """One hint to send: action in {"retain", "pin", "release"}, the session, TTL and priority."""

    action: str
    session_id: str
    ttl_s: float = 0.0
    priority: int = 0


@dataclass
class Workload:
    shape: Shape
    sample: Callable[[str, int], int]  # (request_id, index of the output token) -> token id
    sessions: list[Session] = field(init=False)
    _rng: random.Random = field(init=False)
    _system: list[list[int]] = field(init=False)
    _ended: list[str] = field(default_factory=list)
    _finished: list[str] = field(default_factory=list)
    _turns: dict[str, tuple[Session, Turn]] = field(default_factory=dict)
    _recent: list[Session] = field(default_factory=list)

    def __post_init__(self) -> None:
        s = self.shape
        self._rng = random.Random(s.seed)
        self._system = [tokens(f"system-{k}", s.system_tokens) for k in range(s.system_prompts)]
        self.sessions = [Session(i, 0, tokens(f"ctx-{i}.0", s.first_context_tokens)) for i in range(s.sessions)]

    # ------------------------------------------------------------ turns

    def prompt_of(self, session: Session) -> list[int]:
        s = self.shape
        new = tokens(f"user-{session.session_id}-{session.turn}", s.new_tokens_per_turn)
        return self._system[session.slot % s.system_prompts] + session.context + new

    def first_turns(self) -> list[Turn]:
        """Every session's first context (system prompt + private context), as prefill-only turns."""
        out = []
        for session in self.sessions:
            prompt = self._system[session.slot % self.shape.system_prompts] + session.context
            out.append(Turn(f"{session.session_id}-fill", prompt, session.session_id, f"{session.session_id}/0", 1))
        return out

    def arrivals(self) -> list[Turn]:
        """The turns that arrive this step (sessions become running)."""
        s = self.shape
        idle = [x for x in self.sessions if not x.running]
        picked = self._rng.sample(idle, min(s.arrivals_per_step, len(idle)))
        out = []
        for session in picked:
            prompt = self.prompt_of(session)
            if len(prompt) + s.max_tokens > s.max_model_len:
                self._ended.append(session.session_id)
                session.generation += 1
                session.turn = 0
                session.context = tokens(f"ctx-{session.session_id}", s.first_context_tokens)
                prompt = self.prompt_of(session)
            session.running = True
            turn = Turn(f"{session.session_id}-t{session.turn}", prompt, session.session_id,
                        f"{session.session_id}/{session.turn + 1}", s.max_tokens)
            self._turns[turn.request_id] = (session, turn)
            out.append(turn)
        return out

    def finished(self, request_id: str) -> None:
        """A turn finished: its prompt and output become the session's context."""
        session, turn = self._turns.pop(request_id)
        output = [self.sample(request_id, i) for i in range(turn.max_tokens)]
        session.context = turn.prompt[self.shape.system_tokens:] + output
        session.turn += 1
        session.running = False
        self._finished.append(session.session_id)
        self._recent.append(session)
        del self._recent[: -4 * self.shape.arrivals_per_step * self.shape.max_tokens]

    def recently_finished(self, n: int) -> list[Session]:
        """Up to n idle sessions, the most recently finished first."""
        out: list[Session] = []
        for session in reversed(self._recent):
            if not session.running and session not in out:
                out.append(session)
                if len(out) == n:
                    break
        return out

    # ------------------------------------------------------------ hints

    def hints(self) -> list[HintPlan]:
        """This step's hints: Retain the sessions that just paused, Release the ended ones, then
        Pin / Release idle sessions until `hints_per_step`. Empty when hints_per_step is 0."""
        n = self.shape.hints_per_step
        finished, ended = self._finished, self._ended
        self._finished, self._ended = [], []
        if not n:
            return []
        rng = self._rng
        ttl = self.shape.hint_ttl_steps * self.shape.step_seconds
        plans = [HintPlan("release", sid) for sid in ended[:n]]
        plans += [HintPlan("retain", sid, ttl_s=3 * ttl, priority=rng.randrange(4)) for sid in finished[: n - len(plans)]]
        while len(plans) < n:
            session = self.sessions[rng.randrange(len(self.sessions))]
            if rng.random() < 0.3:
                plans.append(HintPlan("pin", session.session_id, ttl_s=ttl))
            else:
                plans.append(HintPlan("release", session.session_id))
        return plans
