"""SessionPolicy: turns agent lifecycle signals into kvhint.v1 hints.

Embed one per router (or agent runtime). Feed it `signals` with `observe`,
call `flush(sink)` (or `await flush_async(sink)`) after each batch of
signals and on a timer (a few times a second is plenty), and it sends:

* a paused session (tool call, idle, waiting for its children): Retain at
  `session_priority` with `expected_reuse_in` = its predicted next use,
  learned online per tool name and session class: with `ranking="quantile"`
  (the default) the conditional `quantile` of the remaining pause; with
  `ranking="index"` `PauseModel.reuse_index`, the smallest expected cache
  space-time per hit, which ranks a usually-quick, sometimes-slow call by
  its likely quick return and re-predicts at the horizon where that chance
  is spent. All paused sessions share one priority, so the engine
  orders them by expected reuse: the one expected back last is evicted first.
  When the prediction passes (or its horizon does) and the session is still
  paused, the policy re-predicts from the time already waited and refreshes
  the hint (an engine treats a passed expectation as plain LRU).
* engines without `supports_expected_reuse`: the same ranking as priority
  bands below `session_priority` (nearer resume, higher priority).
* a predicted pause >= `demote_after_s` on an engine with lower tiers (and
  `use_tiers`): Demote instead of Retain, and Prefetch `prefetch_margin_s`
  before the predicted resume.
* optionally (`pin_within_s`) a Pin for a session predicted back within that
  many seconds, while the engine's pin budget (GetCapabilities) has room for
  its blocks.
* a declared template: Retain at `template_priority` (above every session),
  refreshed at half its TTL. A template whose blocks are not resident yet
  (MISSING: declared before its first request) is retried after 1, 2, 4 ...
  seconds, up to that refresh period. A template id declared again with
  another target releases the old one (unless another template declares it:
  templates on one target share its grant), as TemplateRetired does; declared
  again with the same target, it is refreshed.
* a request sent after a pause (`keep_while_running`): Retain "due in
  `resume_s`", and as that passes, due within as long as the request has
  waited (1, 2, 4, ... s), until it completes (for at most `resume_wait_s`).
  The engine reads the session's blocks when it admits the request, and a
  busy engine queues it; the pause's expectation would by then be passed or
  later than now, ranking those blocks among the first evicted.
* a session ended (or a dead branch): Release; a parent's unjoined children
  are released with it, and a joined child is done: released when the parent
  collects it. When a waiting parent's last child joins, its next request is
  imminent and it is kept due as after a finished tool call. The pause it ended counts as one that never came back
  (`PauseModel.observe_end`).
* a paused session predicted never to come back (more than 1 - `quantile` of
  the pauses like it that lasted this long ended their session, typically an
  idle session after an answer with no tool call, whose user left), or not
  within the longest TTL the engine grants: Release, once, so its blocks are
  the first evicted instead of protected above every running session's
  blocks. Nothing more is sent for it until it sends a request. (Without
  this, one abandoned session in four made the policy recompute more than
  LRU on a held-out trace: docs/design-notes.md.)

A session no signal has mentioned for `forget_after_s` (two hours) after every
hint sent for it expired, with no children and nothing queued or in flight,
is forgotten, as if it had ended but with no Release (nothing it was granted
is left): a router whose agents just stop, and that never sends SessionEnded,
would otherwise keep every session it ever saw (about a kilobyte each).

It never sends more than `max_hints_per_s` hints in any one-second interval,
nor more than `burst` at once (`HintRateLimit`). Hints waiting for the limit
are coalesced: a newer hint for the same target replaces the older one, and a
Release cancels pending hints for its session. A sink that raises (the RPC
failed) leaves the hints it did not answer queued for the next flush, unless a
newer hint for the same target was queued meanwhile, and the error propagates.
Results feed back (`record`): MISSING marks a session cold (nothing resident,
no refreshes until it runs again) and retries a template soon; REJECTED
UNSUPPORTED turns the feature off (expected reuse -> priority bands, tiers ->
Retain); any other REJECTED Demote (the engine could not take it: no room on
the lower tier, too many operations in flight) protects the session on the
device instead, with a Retain, for the rest of that pause; CLIPPED PIN_BUDGET
stops pinning until a pin ends; CLIPPED TTL_CAPPED caps every later TTL at the
granted one, and the capped keep counts as ending when the granted TTL does
(`effective_ttl` after it was sent): the session is kept again, and a template
refreshed at half of it, by then.

Warm start: what the pause model learned (`policy.model.export()`, plain
JSON) can seed a new policy (`SessionPolicy(config, pause_state=state)`), so a
restarted router or a new replica predicts from the traffic an earlier one saw
instead of from the prior.

Not thread-safe: call it from one thread or one event loop.
"""

from __future__ import annotations

import itertools
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from kvhint.v1 import kvhint_pb2 as pb

from ..builders import Target, session
from ..durations import duration_to_seconds
from .estimator import LogNormalPrior, PauseModel
from .signals import (
    ChildJoined,
    ChildSpawned,
    RequestCompleted,
    RequestSent,
    SessionEnded,
    Signal,
    TemplateDeclared,
    TemplateRetired,
    ToolCallFinished,
    ToolCallStarted,
)
from .sinks import AsyncHintSink, HintRateLimit, HintSink

Key = tuple[str, ...]
#: How many recently ended session ids a policy remembers, to ignore late signals about them.
ENDED_MEMORY = 65536
#: Owner prefix of a template target's intents (session ids are owners as they are).
_TEMPLATE = "template:"


def _template_owner(target: Target) -> str:
    """The owner of the intents for a template target: one per target, however many template
    ids declare it (the engine holds one grant per selector owner, which they share)."""
    return _TEMPLATE + repr(target)


@dataclass(frozen=True)
class PolicyConfig:
    """Tuning knobs; the defaults need no knowledge of a particular workload."""

    session_priority: int = 10
    template_priority: int = 1000
    template_ttl_s: float = 600.0
    #: Retain TTL = clamp(ttl_factor x predicted pause, min_ttl_s, max_ttl_s (and the engine's max_ttl)).
    ttl_factor: float = 4.0
    min_ttl_s: float = 30.0
    max_ttl_s: float = 3600.0
    #: Prior for pauses nothing is known about (log-normal).
    prior: LogNormalPrior = field(default_factory=LogNormalPrior)
    #: Declared duration classes -> nominal upper bound (s); a call declared in a class gets a
    #: prior with median bound/3 until its keys have data.
    declared_classes: Mapping[str, float] = field(default_factory=dict)
    #: How a paused session's next use is predicted: "quantile" (the conditional `quantile` of
    #: the remaining pause) or "index" (`PauseModel.reuse_index`, the smallest expected
    #: space-time per hit, re-predicted at its horizon). On the benchmark's generated presets and
    #: seeds the two tie within noise (bench/results/policy/sweep.md); "quantile" 0.7 had the
    #: higher mean there, "index" the better worst case.
    ranking: str = "quantile"
    #: Conditional quantile of the remaining pause with ranking="quantile" (0.7 was the best
    #: of 0.5-0.8 there: mixtures of short and long pauses favour a cautious estimate).
    quantile: float = 0.7
    #: Observations per key kept, pseudo-observations of the prior, observations before a key
    #: is used (a key's own observations are blended with the prior, so one already counts).
    window: int = 256
    prior_weight: float = 2.0
    min_samples: int = 1
    #: Refresh a paused session's hint this long before its expectation passes.
    refresh_lead_s: float = 0.25
    #: Expected reuse sent when a tool call finished or children were spawned (the next request,
    #: or the children's first, is imminent). It is re-sent every resume_s until that request
    #: arrives, for at most resume_wait_s: a request queued behind others in a busy engine comes
    #: later than "imminent", and an expectation that passes ranks the blocks first for eviction.
    resume_s: float = 1.0
    resume_wait_s: float = 60.0
    #: A request sent after a pause reads the session's blocks when the engine admits it, which a
    #: busy engine's queue delays; until then the pause's expectation (passed, or later than now)
    #: ranks those blocks among the first evicted. With this on, the session is kept due from the
    #: send until the request completes: expected reuse resume_s, then, each time that passes,
    #: within as long as the request has waited (a few refreshes per request however long it
    #: runs), for at most resume_wait_s. Nothing changes where requests are admitted at once; on
    #: the default trace's slower recorded engine timelines it raised the share of the
    #: overlapped Belady's savings (bench/results/policy/timeline.md).
    keep_while_running: bool = True
    release_on_end: bool = True
    #: Tiers: Demote a pause predicted at least this long; Prefetch this margin before the resume.
    #: Demote hands the device copies to eviction first, which the expected-reuse order already
    #: does for long pauses; with a host tier that stores every block anyway, demoting only the
    #: longest pauses recomputed least in the benchmark's tier simulation (docs/design-notes.md).
    use_tiers: bool = False
    demote_after_s: float = 60.0
    prefetch_margin_s: float = 2.0
    #: Pin sessions predicted back within this many seconds (None: never pin).
    pin_within_s: Optional[float] = None
    #: Rate limit: at most max_hints_per_s hints in any one-second interval, burst at once.
    max_hints_per_s: float = 100.0
    burst: int = 50
    #: A session with no signal for this long, after every hint sent for it has expired, with no
    #: children and nothing queued or in flight for it, is forgotten (as if it ended, but with
    #: no Release: nothing it was granted is left). Routers that never send SessionEnded (or
    #: whose agents just stop) would otherwise keep every session ever seen. A later signal
    #: about it starts a new session. inf: never.
    forget_after_s: float = 7200.0
    #: A template whose Retain found nothing resident (MISSING) is retried after this long,
    #: doubling up to template_ttl_s / 2 (its regular refresh).
    template_retry_s: float = 1.0


@dataclass
class _Session:
    sid: str
    cls: Optional[str] = None
    state: str = "running"  # running | paused | waiting | resuming | ended (then forgotten)
    pause_start: float = 0.0
    keys: tuple[Key, ...] = ()
    prior: Optional[LogNormalPrior] = None
    reuse_at: Optional[float] = None  # the expectation last queued/sent (absolute)
    review_at: Optional[float] = None  # re-predict then if still paused (absolute)
    ttl_until: float = math.inf
    demoted: bool = False
    no_demote: bool = False  # a Demote of this pause was refused: keep it on the device until it runs again
    prefetch_at: Optional[float] = None
    cold: bool = False
    children: set[str] = field(default_factory=set)
    unstarted: set[str] = field(default_factory=set)  # children spawned that sent no request yet
    parent: Optional[str] = None
    blocks: int = 0  # device blocks the last keep hint reported
    pinned_blocks: int = 0  # blocks its pin holds (reserved when queued, then as reported)
    pin_until: float = -math.inf
    due_since: float = -math.inf  # when its next request became imminent (resuming, children spawned, or sent)
    awaiting: bool = False  # running a request sent after a pause: kept due until it completes
    let_go: bool = False  # predicted never to come back: released, nothing more until its next request
    last_signal: float = -math.inf  # the latest signal about it
    granted_until: float = -math.inf  # the latest expiry of a keep sent for it (Retain TTL, Pin TTL)


def _idle_keys(s: _Session) -> tuple[Key, ...]:
    """The keys of an idle pause: after an answer with no tool call."""
    return (("idle", s.cls or ""), ("idle",))


@dataclass
class _Template:
    target: Target
    refresh_at: float  # absolute: re-send then
    retry_s: float = 0.0  # the back-off after a MISSING result (0: none pending)


@dataclass
class _Intent:
    kind: str  # "release" | "keep" | "demote" | "prefetch"
    owner: str  # session id or _template_owner(target)
    hint: pb.Hint
    order: float  # drain order within a kind (lower first)
    seq: int = 0  # when it was queued (later intents have higher numbers)
    sent_at: float = -math.inf  # when drain last took it (what the engine grants counts from then)


_KIND_ORDER = {"release": 0, "keep": 1, "demote": 2, "prefetch": 3}


class SessionPolicy:
    """See the module doc. `clock` gives "now" for signals and calls without a time.

    `model`: the pause model to use (default: a new one from `config`). `pause_state`: start the
    new model from a `PauseModel.export()` of an earlier one (warm start; ValueError when it is
    malformed, see `PauseModel.load`); not together with `model`."""

    def __init__(
        self,
        config: PolicyConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        model: PauseModel | None = None,
        pause_state: Mapping[str, Any] | None = None,
        id_prefix: str | None = None,
    ) -> None:
        self.config = c = config or PolicyConfig()
        self.clock = clock
        if c.ranking not in ("index", "quantile"):
            raise ValueError(f"PolicyConfig.ranking must be 'index' or 'quantile', got {c.ranking!r}")
        if not c.forget_after_s > 0:
            raise ValueError(f"PolicyConfig.forget_after_s must be > 0 (inf: never forget), got {c.forget_after_s!r}")
        if model is not None and pause_state is not None:
            raise ValueError("pass a model or a pause_state to start it from, not both (use model.load(state))")
        self.model = model or PauseModel(c.prior, window=c.window, prior_weight=c.prior_weight, min_samples=c.min_samples)
        if pause_state is not None:
            self.model.load(pause_state)
        self.bucket = HintRateLimit(c.max_hints_per_s, c.burst)
        self.sessions: dict[str, _Session] = {}
        self.templates: dict[str, _Template] = {}
        self.stats: dict[str, int] = {}
        self._outbox: dict[tuple[str, str], _Intent] = {}
        self._ids = itertools.count()
        self._id_prefix = id_prefix if id_prefix is not None else "p" + secrets.token_hex(3) + "-"
        self._sent: dict[str, _Intent] = {}  # hint id -> intent, until its result is recorded
        # What the engine supports (configure() narrows it; results narrow it further).
        self.expected_reuse = True
        self.tiers = c.use_tiers
        self.max_ttl_s = c.max_ttl_s
        self.pin_budget_blocks: Optional[int] = None
        self.max_batch = 64
        self._pins_blocked_until = -math.inf  # after CLIPPED/PIN_BUDGET: until the pins then held expire
        self._last_t = -math.inf
        # Recently ended session ids, oldest first (at most ENDED_MEMORY): late signals about them are ignored.
        self._ended: OrderedDict[str, None] = OrderedDict()

    # ------------------------------------------------------------ engine capabilities

    def configure(self, caps: pb.GetCapabilitiesResponse) -> None:
        """Adopt the engine's limits and feature support (GetCapabilities)."""
        support = {a.action: a for a in caps.actions}
        retain = support.get(pb.ACTION_RETAIN)
        self.expected_reuse = bool(retain and retain.supports_expected_reuse)
        tiers = all(support.get(a) is not None and support[a].supported for a in (pb.ACTION_DEMOTE, pb.ACTION_PREFETCH))
        self.tiers = self.config.use_tiers and tiers
        if caps.limits.HasField("max_ttl"):
            self.max_ttl_s = min(self.config.max_ttl_s, duration_to_seconds(caps.limits.max_ttl))
        self.pin_budget_blocks = caps.limits.pin_budget_blocks or None
        if caps.limits.max_hints_per_batch:
            self.max_batch = caps.limits.max_hints_per_batch

    # ------------------------------------------------------------ signals

    def observe(self, signal: Signal) -> None:
        """Update the state with one signal (in time order) and queue the hints it calls for."""
        now = self._time(signal.t)
        if isinstance(signal, RequestSent):
            self._ended.pop(signal.session_id, None)  # a new request revives an ended session id
            self._on_request(signal, now)
        elif self._is_late(signal):
            self._count("late_signals")  # about a session that already ended: nothing to protect
        elif isinstance(signal, RequestCompleted):
            s = self._session(signal.session_id)
            if s.state == "running":
                self._pause(s, now, "paused", _idle_keys(s), None)
        elif isinstance(signal, ToolCallStarted):
            s = self._session(signal.session_id)
            self._pause(s, now, "paused", self._tool_keys(s, signal), self._tool_prior(signal))
        elif isinstance(signal, ToolCallFinished):
            s = self._session(signal.session_id)
            if s.state == "paused":
                self.model.observe(s.keys, now - s.pause_start)
                self._resuming(s, now)
        elif isinstance(signal, ChildSpawned):
            parent = self._session(signal.parent_session_id)
            child = self._session(signal.child_session_id)
            child.parent = parent.sid
            parent.children.add(child.sid)
            if not parent.unstarted:
                parent.due_since = now
            parent.unstarted.add(child.sid)
            if parent.state != "waiting":
                parent.state, parent.pause_start = "waiting", now
                parent.keys, parent.prior = (("children", parent.cls or ""), ("children",)), None
            # The child's first request reads the parent's context: the parent's blocks are due now.
            self._bring_back(parent, now)
            self._keep(parent, now, self.config.resume_s)
        elif isinstance(signal, ChildJoined):
            self._joined(signal.parent_session_id, signal.child_session_id, now)
        elif isinstance(signal, SessionEnded):
            self._end(signal.session_id)
        elif isinstance(signal, TemplateDeclared):
            self._declare(signal.template_id, signal.target, now)
        elif isinstance(signal, TemplateRetired):
            entry = self.templates.pop(signal.template_id, None)
            if entry is not None:
                self._release_template(entry.target)
        else:
            raise TypeError(f"not a policy signal: {signal!r}")

    def _declare(self, template_id: str, target: Target, now: float) -> None:
        """Keep `target` for the template from now on. Declared again with another target, the old
        one is released as at TemplateRetired; with the same target, it is a refresh."""
        old = self.templates.get(template_id)
        self.templates[template_id] = _Template(target, now + self._template_ttl() / 2)
        if old is not None and old.target != target:
            self._release_template(old.target)
        self._queue_template(target)

    def _release_template(self, target: Target) -> None:
        """Release a template target no declared template keeps any more (one still declared by
        another template id keeps the grant they share)."""
        if any(t.target == target for t in self.templates.values()):
            return
        owner = _template_owner(target)
        self._unqueue(owner, "keep")
        self._queue("release", owner, target.release(), 0.0)

    def _resuming(self, s: _Session, now: float) -> None:
        """`s`'s next request is imminent (its tool call returned, its last child joined): keep
        it due, and bring a demoted session's blocks back from the lower tier now."""
        s.state, s.due_since = "resuming", now
        self._bring_back(s, now)
        self._keep(s, now, self.config.resume_s)

    def _bring_back(self, s: _Session, now: float) -> None:
        """`s`'s blocks are about to be read: a demoted session's are prefetched now instead of at
        its predicted resume."""
        if s.demoted and self.tiers:
            s.prefetch_at = None
            self._queue("prefetch", s.sid, session(s.sid).prefetch(), now)
        s.demoted = False

    def _joined(self, parent_id: str, child_id: str, now: float) -> None:
        """The parent collected the child's result: the child is done (released like an ended
        session), and a waiting parent whose last child joined is about to send its request."""
        parent = self.sessions.get(parent_id)
        if parent is not None:
            parent.children.discard(child_id)
            parent.unstarted.discard(child_id)
        if child_id in self.sessions or child_id not in self._ended:
            self._end(child_id)
        if parent is not None and parent.state == "waiting" and not parent.children:
            self.model.observe(parent.keys, now - parent.pause_start)
            self._resuming(parent, now)

    def _is_late(self, signal: Signal) -> bool:
        """A signal about an ended session (a request that completes after its SessionEnded, a
        child spawned by it): it must not bring the session back as a paused one that nothing
        would ever release. Only a new RequestSent revives an ended session id."""
        ended = self._ended
        if not ended:
            return False
        if isinstance(signal, (RequestCompleted, ToolCallStarted, ToolCallFinished)):
            return signal.session_id in ended
        if isinstance(signal, (ChildSpawned, ChildJoined)):
            return signal.parent_session_id in ended
        if isinstance(signal, SessionEnded):
            return signal.session_id in ended and signal.session_id not in self.sessions
        return False

    def _time(self, t: Optional[float]) -> float:
        now = self.clock() if t is None else t
        if now < self._last_t:
            raise ValueError(f"signals must arrive in time order ({now} < {self._last_t})")
        self._last_t = now
        return now

    def _session(self, sid: str) -> _Session:
        s = self.sessions.get(sid)
        if s is None:
            s = self.sessions[sid] = _Session(sid)
        s.last_signal = self._last_t  # (called for the signal being observed)
        return s

    def _on_request(self, signal: RequestSent, now: float) -> None:
        s = self._session(signal.session_id)
        if signal.session_class and not s.cls:
            s.cls = signal.session_class
        if s.state in ("paused", "waiting"):
            self.model.observe(s.keys, now - s.pause_start)
        parent = self.sessions.get(s.parent) if s.parent else None
        if parent is not None and s.sid in parent.unstarted:
            parent.unstarted.discard(s.sid)
            if not parent.unstarted and parent.state == "waiting":  # every child has read it: the wait begins
                self._predict_and_keep(parent, now)
        paused = s.state in ("paused", "waiting", "resuming")
        s.state, s.cold, s.demoted, s.prefetch_at, s.let_go, s.no_demote = "running", False, False, None, False, False
        self._unqueue(s.sid, "demote", "prefetch")
        if paused and self.config.keep_while_running:
            # Its blocks are read when the engine admits the request: due now until it completes.
            s.awaiting, s.due_since = True, now
            self._keep(s, now, self.config.resume_s)

    def _tool_keys(self, s: _Session, signal: ToolCallStarted) -> tuple[Key, ...]:
        keys: list[Key] = []
        cls = s.cls or ""
        if signal.tools:
            name = "+".join(sorted(set(signal.tools)))
            keys += [("tool", name, cls), ("tool", name)]
        if signal.expected_class:
            keys.append(("declared", signal.expected_class))
        keys += [("class", cls), ("all",)]
        return tuple(keys)

    def _tool_prior(self, signal: ToolCallStarted) -> Optional[LogNormalPrior]:
        sigma = self.config.prior.sigma
        if signal.expected_duration_s is not None and signal.expected_duration_s > 0:
            return LogNormalPrior(signal.expected_duration_s, min(sigma, 0.75))
        bound = self.config.declared_classes.get(signal.expected_class or "")
        if bound:
            return LogNormalPrior(bound / 3, sigma)
        return None

    def _pause(self, s: _Session, now: float, state: str, keys: tuple[Key, ...], prior: Optional[LogNormalPrior]) -> None:
        s.state, s.pause_start, s.keys, s.prior, s.awaiting = state, now, keys, prior, False
        # A MISSING answer made it cold; the request that ran since stored its blocks again, so
        # this pause is kept (re-predicted, refreshed, prefetched, released) like any other.
        s.cold = False
        self._predict_and_keep(s, now)

    def _end(self, sid: str) -> None:
        self._ended[sid] = None
        self._ended.move_to_end(sid)
        if len(self._ended) > ENDED_MEMORY:
            self._ended.popitem(last=False)
        s = self.sessions.get(sid)
        if s is None:
            if self.config.release_on_end:  # unknown to this policy (started late): release anyway
                self._queue("release", sid, session(sid).release(), 0.0)
            return
        self._observe_gone(s)
        s.state = "ended"
        self._unqueue(sid, "keep", "demote", "prefetch")
        if self.config.release_on_end:
            self._queue("release", sid, session(sid).release(), 0.0)
        for child in list(s.children):  # unjoined children are dead branches
            self._end(child)
        self._forget(s)

    def _observe_gone(self, s: _Session) -> None:
        """`s` will not send again: its pause never came back (a running session ended with its
        last answer, done or in flight: an idle pause that never came back)."""
        if s.state in ("paused", "waiting") and s.keys:
            self.model.observe_end(s.keys)
        elif s.state == "running":
            self.model.observe_end(_idle_keys(s))

    def _forget(self, s: _Session) -> None:
        """Drop `s`, and its place among its parent's children."""
        parent = self.sessions.get(s.parent) if s.parent is not None else None
        if parent is not None:
            parent.children.discard(s.sid)
            parent.unstarted.discard(s.sid)
        del self.sessions[s.sid]

    # ------------------------------------------------------------ predictions and hints

    def forecast(self, s: _Session, now: float) -> tuple[float, float]:
        """(expected reuse in, re-predict in): the paused session `s`'s predicted next use and
        when to predict again if it is still paused then (seconds from `now`)."""
        if self.config.ranking == "index":
            return self.model.reuse_index(s.keys, now - s.pause_start, s.prior)
        r = self.model.residual(s.keys, now - s.pause_start, s.prior, self.config.quantile)
        return r, r

    def residual(self, s: _Session, now: float) -> float:
        """Predicted seconds until the paused session `s` sends its next request (what the
        engine is told; see `PolicyConfig.ranking`)."""
        return self.forecast(s, now)[0]

    def predicted_resume(self, session_id: str, now: Optional[float] = None) -> Optional[float]:
        """Absolute predicted time of the session's next request; None when it is running or
        unknown, inf when it is predicted never to come back."""
        s = self.sessions.get(session_id)
        if s is None or s.state not in ("paused", "waiting", "resuming"):
            return None
        if s.state == "resuming":
            return s.reuse_at
        if s.let_go:
            return math.inf
        now = self.clock() if now is None else now
        return now + self.residual(s, now)

    def ranking(self, now: Optional[float] = None) -> list[tuple[str, float]]:
        """Paused sessions by predicted resume, soonest first (what the engine will keep longest)."""
        now = self.clock() if now is None else now
        out = [(sid, self.predicted_resume(sid, now)) for sid in self.sessions]
        return sorted(((sid, t) for sid, t in out if t is not None), key=lambda item: item[1])

    def _predict_and_keep(self, s: _Session, now: float) -> None:
        c = self.config
        residual, review = self.forecast(s, now)
        if residual >= self.max_ttl_s:  # never back (inf), or not within any TTL we may ask for
            self._let_go(s)
            return
        if self.tiers and residual >= c.demote_after_s and not s.no_demote:
            s.prefetch_at = now + max(0.0, residual - c.prefetch_margin_s)
            s.reuse_at = now + residual
            s.review_at = s.reuse_at - c.refresh_lead_s
            if not s.demoted:
                s.demoted = True
                self._unqueue(s.sid, "keep")
                self._queue("demote", s.sid, session(s.sid).demote(), now)
            return
        s.demoted = False  # (re-)protect what is left on the device; a scheduled Prefetch still goes out
        self._keep(s, now, residual, review)

    def _let_go(self, s: _Session) -> None:
        """Stop protecting a paused session predicted not to come back: one Release."""
        s.reuse_at = s.review_at = s.prefetch_at = None
        s.ttl_until, s.pin_until, s.pinned_blocks = math.inf, -math.inf, 0  # Release drops its pin too
        s.demoted = False
        if s.let_go:
            return
        s.let_go = True
        self._unqueue(s.sid, "keep", "demote", "prefetch")
        self._queue("release", s.sid, session(s.sid).release(), 0.0)

    def _keep(self, s: _Session, now: float, residual: float, review: Optional[float] = None) -> None:
        """Queue a Retain (or Pin) of `s` expecting reuse in `residual` seconds; re-predict after
        `review` seconds if that comes before the expectation passes (else just before it does)."""
        c = self.config
        if s.let_go:  # protected again (children spawned, a new pause): a Release not yet sent is moot
            s.let_go = False
            self._unqueue(s.sid, "release")
        ttl = min(self.max_ttl_s, max(c.min_ttl_s, c.ttl_factor * residual, residual + c.refresh_lead_s))
        s.reuse_at, s.ttl_until = now + residual, now + ttl
        lead = residual - c.refresh_lead_s
        s.review_at = now + (review - c.refresh_lead_s if review is not None and review < residual else lead)
        target = session(s.sid)
        reuse = min(residual, ttl) if self.expected_reuse else None
        if self._may_pin(s, now, residual):
            pin_ttl = max(residual * 2, 1.0)
            s.pinned_blocks, s.pin_until = s.blocks, now + pin_ttl
            s.granted_until = max(s.granted_until, now + pin_ttl)
            hint = target.pin(ttl=pin_ttl, expected_reuse_in=reuse)
        else:
            s.granted_until = max(s.granted_until, now + ttl)
            hint = target.retain(ttl=ttl, priority=self._priority(residual), expected_reuse_in=reuse)
        self._queue("keep", s.sid, hint, residual)

    def _priority(self, residual: float) -> int:
        if self.expected_reuse:
            return self.config.session_priority
        # No expected reuse on this engine: nearer resumes get higher priority bands.
        return self.config.session_priority - min(30, int(math.log2(1.0 + max(residual, 0.0))))

    def _may_pin(self, s: _Session, now: float, residual: float) -> bool:
        """Pin only sessions of known size that fit the budget left by unexpired pins."""
        limit = self.config.pin_within_s
        if limit is None or residual > limit or not s.blocks or self.pin_budget_blocks is None:
            return False
        if now < self._pins_blocked_until:
            return False
        used = sum(x.pinned_blocks for x in self.sessions.values() if x.pin_until > now and x is not s)
        return used + s.blocks <= self.pin_budget_blocks

    def _queue_template(self, target: Target) -> None:
        c = self.config
        hint = target.retain(ttl=self._template_ttl(), priority=c.template_priority)
        self._queue("keep", _template_owner(target), hint, -1.0)

    def _unqueue(self, owner: str, *kinds: str) -> None:
        """Drop the hints of these kinds queued for `owner` and not sent yet."""
        for kind in kinds:
            self._outbox.pop((kind, owner), None)

    def _queue(self, kind: str, owner: str, hint: pb.Hint, order: float) -> None:
        seq = next(self._ids)
        hint.hint_id = f"{self._id_prefix}{seq}"
        self._outbox[(kind, owner)] = _Intent(kind, owner, hint, order, seq)

    # ------------------------------------------------------------ time passing

    def tick(self, now: Optional[float] = None) -> None:
        """Queue refreshes that are due at `now`: passed expectations, TTLs running
        out, Prefetches before a predicted resume, template refreshes."""
        now = self._time(now)
        lead = self.config.refresh_lead_s
        for s in self.sessions.values():
            if s.cold or s.let_go:
                continue
            if s.state == "resuming" or (s.state == "waiting" and s.unstarted):
                # Due now until its (or its children's first) request comes: keep it due.
                if s.review_at is not None and now >= s.review_at and now - s.due_since <= self.config.resume_wait_s:
                    self._keep(s, now, self.config.resume_s)
                continue
            if s.state == "running" and s.awaiting:
                # A sent request, admitted or not: due within as long as it has waited (so one
                # running for a minute costs about six refreshes, not sixty).
                waited = now - s.due_since
                if s.review_at is not None and now >= s.review_at and waited <= self.config.resume_wait_s:
                    self._keep(s, now, max(self.config.resume_s, waited))
                continue
            if s.state not in ("paused", "waiting"):
                continue
            if s.prefetch_at is not None and now >= s.prefetch_at:
                s.prefetch_at = None
                self._queue("prefetch", s.sid, session(s.sid).prefetch(), s.reuse_at or now)
            overdue = s.review_at is not None and now >= s.review_at
            if overdue or (not s.demoted and now >= s.ttl_until - lead):
                self._predict_and_keep(s, now)  # still paused: re-predict from the time waited
        self._forget_quiet(now)
        for template in self.templates.values():
            if now >= template.refresh_at:
                template.refresh_at = now + self._template_ttl() / 2
                self._queue_template(template.target)

    def _forget_quiet(self, now: float) -> None:
        """Forget sessions quiet for forget_after_s since their last signal and the expiry of
        every keep sent for them, with no children and nothing queued or in flight (see
        PolicyConfig.forget_after_s). Their pause counts as one that did not come back, as
        at SessionEnded; they are not remembered as ended (a later request starts afresh)."""
        after = self.config.forget_after_s
        if not math.isfinite(after):
            return
        quiet = [
            s for s in self.sessions.values()
            if now - max(s.last_signal, s.granted_until) >= after and not s.children and not s.unstarted
        ]
        if not quiet:
            return
        busy = {i.owner for i in self._outbox.values()} | {i.owner for i in self._sent.values()}
        for s in quiet:
            if s.sid not in busy:
                self._observe_gone(s)  # as at SessionEnded
                self._forget(s)
                self._count("forgotten")

    def drain(self, now: Optional[float] = None) -> list[pb.Hint]:
        """Take the queued hints the rate limit allows now: Releases first, then keeps
        soonest-resume first, then Demotes and Prefetches."""
        now = self.clock() if now is None else now
        if not self._outbox:
            return []
        allowed = self.bucket.take(len(self._outbox), now)
        if allowed <= 0:
            return []
        ordered = sorted(self._outbox.values(), key=lambda i: (_KIND_ORDER[i.kind], i.order))[:allowed]
        for intent in ordered:
            del self._outbox[(intent.kind, intent.owner)]
            intent.sent_at = now
            self._sent[intent.hint.hint_id] = intent
        self._count("sent", len(ordered))
        return [i.hint for i in ordered]

    @property
    def pending(self) -> int:
        """Hints queued and not yet sent (waiting for rate-limit tokens)."""
        return len(self._outbox)

    # ------------------------------------------------------------ results

    def record(self, hints: Sequence[pb.Hint], results: Sequence[pb.HintResult]) -> None:
        """Feed back the engine's results for hints returned by `drain`."""
        for hint, result in zip(hints, results):
            intent = self._sent.pop(hint.hint_id, None)
            self._count(pb.Outcome.Name(result.outcome) if result.outcome in pb.Outcome.values() else "OUTCOME_UNKNOWN")
            if intent is None:
                continue
            s = self.sessions.get(intent.owner)
            action = hint.WhichOneof("action")
            blocks = sum(c.blocks for c in result.affected_blocks if c.tier == pb.TIER_DEVICE)
            if intent.owner.startswith(_TEMPLATE):
                self._template_result(intent, result)
            if result.outcome == pb.OUTCOME_MISSING and s is not None and intent.kind == "keep":
                s.cold = True
            elif result.outcome == pb.OUTCOME_REJECTED and result.reason == pb.REASON_UNSUPPORTED:
                self._unsupported(action, s)
            elif result.outcome == pb.OUTCOME_REJECTED and action == "demote" and s is not None:
                self._demote_refused(s)
            if s is not None and intent.kind == "keep" and result.outcome in (pb.OUTCOME_ACCEPTED, pb.OUTCOME_CLIPPED):
                s.blocks = blocks
                if action == "pin":
                    s.pinned_blocks = blocks
            if any(clip.reason == pb.REASON_PIN_BUDGET for clip in result.clips):
                held = [x.pin_until for x in self.sessions.values() if x.pinned_blocks]
                self._pins_blocked_until = max(held, default=self._last_t)
            if any(clip.reason == pb.REASON_TTL_CAPPED for clip in result.clips) and result.HasField("effective_ttl"):
                self._ttl_capped(intent, s, duration_to_seconds(result.effective_ttl))

    def _ttl_capped(self, intent: _Intent, s: Optional[_Session], granted_s: float) -> None:
        """The engine granted `granted_s` of the TTL `intent` asked for (CLIPPED/TTL_CAPPED): no
        later TTL asks for more, and what the keep protects ends `granted_s` after it was sent, so
        the session is kept again (`ttl_until`), and its template refreshed at half of it, by then."""
        self.max_ttl_s = min(self.max_ttl_s, granted_s)
        if intent.kind != "keep":
            return
        if s is not None:
            s.ttl_until = min(s.ttl_until, intent.sent_at + granted_s)
        for template in self._templates_of(intent.owner):
            template.refresh_at = min(template.refresh_at, intent.sent_at + granted_s / 2)

    def _templates_of(self, owner: str) -> list[_Template]:
        """The declared templates whose target's intents `owner` names."""
        return [t for t in self.templates.values() if _template_owner(t.target) == owner]

    def _template_ttl(self) -> float:
        """A template Retain's TTL: template_ttl_s, within the engine's max_ttl. Refreshes come
        at half of it (with the uncapped value they came after the Retain had ended)."""
        return min(self.config.template_ttl_s, self.max_ttl_s)

    def _template_result(self, intent: _Intent, result: pb.HintResult) -> None:
        """A template's Retain found nothing resident (declared before its first request, or
        evicted before it was declared): retry after template_retry_s, doubling up to the regular
        refresh period, until it is protected. (A result for a target no template declares any
        more, declared again elsewhere meanwhile, concerns none.)"""
        if intent.kind != "keep":
            return
        for template in self._templates_of(intent.owner):
            if result.outcome != pb.OUTCOME_MISSING:
                template.retry_s = 0.0
                continue
            period = self._template_ttl() / 2
            template.retry_s = min(period, template.retry_s * 2 if template.retry_s else self.config.template_retry_s)
            template.refresh_at = min(template.refresh_at, self._last_t + template.retry_s)

    def _demote_refused(self, s: _Session) -> None:
        """The engine could not take this pause's Demote (its Retain was dropped for it): protect the
        session on the device instead, and demote nothing more until it runs again. (A refusal that
        arrives after the session sent its next request concerns a pause that is over.)"""
        if s.state not in ("paused", "waiting"):
            return
        s.no_demote = True
        if s.demoted:
            s.demoted, s.prefetch_at = False, None
            self._unqueue(s.sid, "prefetch")
            self._predict_and_keep(s, self._last_t)

    def _unsupported(self, action: Optional[str], s: Optional[_Session]) -> None:
        if action in ("retain", "pin") and self.expected_reuse:
            self.expected_reuse = False
        elif action in ("demote", "prefetch"):
            self.tiers = False
        else:
            return
        if s is not None and s.state in ("paused", "waiting"):
            s.demoted = False
            self._predict_and_keep(s, self._last_t)

    def _count(self, name: str, n: int = 1) -> None:
        self.stats[name] = self.stats.get(name, 0) + n

    # ------------------------------------------------------------ sending

    def flush(self, sink: HintSink, now: Optional[float] = None) -> list[tuple[pb.Hint, pb.HintResult]]:
        """tick + drain + send through `sink` + record. Returns (hint, result) pairs."""
        hints = self.due(now)
        out: list[tuple[pb.Hint, pb.HintResult]] = []
        for i, batch in enumerate(batches := self._batches(hints)):
            try:
                results = list(sink.apply(batch))
            except BaseException:
                self.requeue([h for b in batches[i:] for h in b])
                raise
            self.record(batch, results)
            out.extend(zip(batch, results))
        return out

    async def flush_async(self, sink: AsyncHintSink, now: Optional[float] = None) -> list[tuple[pb.Hint, pb.HintResult]]:
        """`flush` for an asyncio sink (`AsyncClientSink`)."""
        hints = self.due(now)
        out: list[tuple[pb.Hint, pb.HintResult]] = []
        for i, batch in enumerate(batches := self._batches(hints)):
            try:
                results = list(await sink.apply(batch))
            except BaseException:
                self.requeue([h for b in batches[i:] for h in b])
                raise
            self.record(batch, results)
            out.extend(zip(batch, results))
        return out

    def requeue(self, hints: Sequence[pb.Hint]) -> None:
        """Hints taken with `due` (or `drain`) that got no result (the RPC failed): queued again,
        under the same id, unless a newer hint for the same target was queued meanwhile, or the
        target was let go meanwhile (the session ended, a Release of it was queued after it: a
        template retired, a session predicted not to come back), which only its Release still
        needs. (A hint queued after a Release, for a session id used again or a template declared
        again, goes out after that Release again.)
        Their sends still count against the rate limit."""
        for hint in hints:
            intent = self._sent.pop(hint.hint_id, None)
            if intent is None:
                continue
            release = self._outbox.get(("release", intent.owner))
            if intent.kind != "release" and (intent.owner in self._ended or (release is not None and release.seq > intent.seq)):
                continue  # (a keep, Demote or Prefetch of a target let go meanwhile is moot; one queued
                # after a Release, of a session revived or a template declared again, is not)
            self._outbox.setdefault((intent.kind, intent.owner), intent)
            self._count("requeued")

    def due(self, now: Optional[float] = None) -> list[pb.Hint]:
        """`tick` and `drain`: the hints to send now, for a caller with its own transport (what
        `flush` does with a sink). Send them, then feed their results to `record`, or give them
        back with `requeue` when the send failed."""
        now = max(self.clock() if now is None else now, self._last_t)
        self.tick(now)
        return self.drain(now)

    def _batches(self, hints: list[pb.Hint]) -> list[list[pb.Hint]]:
        n = max(1, self.max_batch)
        return [hints[i : i + n] for i in range(0, len(hints), n)]
