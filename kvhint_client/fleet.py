"""FleetClient: send hints to the engines that hold what they select.

    fleet = FleetClient({"e1": "10.0.0.1:50151", "e2": "10.0.0.2:50151"}, follower=follower)
    out = fleet.apply(session("agent-7").pin(ttl=30))
    out.per_engine["e1"].all_accepted

Routing of each hint (by its selector):
- With a ResidencyIndex (an EventFollower's, or one passed directly; engine names must match the
  endpoint names: ValueError at construction when the follower's engines, or the engines the
  index has heard of, share no name with the endpoints, and a warning logged once when only some
  differ; an index that has heard of no engine yet is not checked): a session selector goes to
  the live engines holding blocks of that session (most blocks first); a block-hash selector to
  the live engines holding any of the hashes. The index cannot speak for the engines of the
  fleet that are not live in it (not yet synced, reconnecting, resyncing): those are asked as
  well, and the ones holding the selection are added (after the index's). Selectors the index
  cannot resolve (continuations, include_children) and selections the index finds nowhere (e.g.
  a session that holds only retention, or an engine not yet synced) are resolved by asking
  every engine.
- Without an index, or for those selectors: a session selector (without include_children) goes
  to the engines whose ListSessions has that exact session (which includes sessions holding
  only retention); other selectors to the engines whose QueryResidency finds at least one block.
- `broadcast=True` skips routing and sends every hint to every engine.
- Engines that failed to answer are skipped for a while (failure memory, a circuit breaker): an
  engine that did not answer a call (UNAVAILABLE or DEADLINE_EXCEEDED, while routing or
  applying) is not asked by later apply() calls for `breaker_backoff` seconds (default 1 s,
  doubling with each consecutive failure up to `breaker_max_backoff`, default 30 s; 0 disables
  it); after that one apply() call asks it again (the probe; other calls keep skipping it while
  it runs), and an answer of any status other than those two ends the backoff. The breaker only
  skips an engine asked because the index cannot speak for it: an engine not live in the index,
  in a call whose every hint is one the index places on live engines (those engines get the
  hint whatever the breaker says). Every other engine is asked whatever the breaker says: the
  engines the index places a hint on, and every engine asked about a selector the index does
  not resolve or finds nowhere, or asked without an index (there, not asking an engine that may
  be a hint's only holder would leave the hint in `unrouted`, as if no engine held it; an engine
  that fails there keeps costing each call its share of the deadline). `broadcast=True` sends to
  every engine whatever the breaker says. Every call sent to an engine updates its breaker (a
  failure starts or doubles its backoff, an answer ends it). An engine skipped is reported in
  `FleetApplyResult.skipped` (why, and when it may be asked again), never in `errors`: nothing
  was sent to it, and no route names it. engines_for() and apply_to() ask whatever the breaker
  says and do not update it.

Data parallelism: an engine started with `--data-parallel-size N` runs N engine cores, each with
its own KV-cache pool and its own KvHint server on port + rank. Treat the ranks as engines:
`FleetClient(data_parallel_endpoints("10.0.0.1:50151"))` (and the same mapping for an
EventFollower) routes each session's hints to the rank that served it.

Each engine receives one ApplyHints batch holding its hints in request order (same hint_id on
every engine, so per-engine retries stay idempotent). Hint ids must be unique within one call
(results and routes are keyed by them): a repeated non-empty hint_id raises ValueError before
anything is sent. Engines that fail (routing or apply) are reported in `errors`; hints that no
engine holds are reported in `unrouted` and sent nowhere.
`apply(timeout=...)` bounds the whole call, routing and applying together (default: the longest
of the engines' `default_timeout`s): each call gets the time left, an engine that failed to answer
while routing is not asked again in the same call, and an engine whose batch the deadline leaves
no time for reports DEADLINE_EXCEEDED in `errors` without being sent anything. The engines are
asked in one parallel round (each about every hint it is asked about, in turn), and routing may
take at most half of the time left (ROUTING_SHARE), so one engine that does not answer (hung,
partitioned) cannot leave the engines that did answer without time for their batches: it reports
DEADLINE_EXCEEDED in `errors`, and a hint no engine that answered holds is reported in `unrouted`.
The calls run on the FleetClient's thread pool; one that was still waiting for a worker when its
deadline passed (every worker busy with other threads' apply() calls) was not sent, and its
DEADLINE_EXCEEDED says so. A batch over an engine's known GetCapabilities limits raises
ValueError before any engine is sent anything.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as _wait_futures
from dataclasses import dataclass, field
from typing import Callable, Optional, TypeVar, Union, overload

import grpc

from kvhint.v1 import kvhint_pb2

from . import _rpc
from .builders import Target
from .client import KvHintClient
from .config import ConnectionConfig, as_config, check_timeout
from .errors import KvHintError
from .follower import AsyncEventFollower, EnginesLike, EventFollower, ResidencyIndex, _named_engines
from .results import ApplyResult

_T = TypeVar("_T")

log = logging.getLogger(__name__)

#: The share of the time left that FleetClient.apply's routing may take (the rest is the batches').
ROUTING_SHARE = 0.5
#: FleetClient's default max_workers, per engine: how many apply() calls (from as many threads) run
#: at once without any of them waiting for a worker. Threads are started only when calls need them.
CALLS_IN_PARALLEL = 16
#: FleetClient's default breaker_backoff: seconds an engine that failed to answer is not asked by
#: later apply() calls (unless routing needs it; module doc), doubled per consecutive failure.
BREAKER_BACKOFF = 1.0
#: FleetClient's default breaker_max_backoff: the longest such backoff, in seconds.
BREAKER_MAX_BACKOFF = 30.0
#: The status codes that count as an engine failing to answer (what opens its breaker).
BREAKER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


@dataclass(frozen=True)
class FleetApplyResult:
    """Per-engine outcomes of one FleetClient.apply()."""

    per_engine: dict[str, ApplyResult] = field(default_factory=dict)
    #: Engines that were asked (routing or apply) and failed, or that the deadline left no time to
    #: be sent their batch. Never an engine in `skipped`.
    errors: dict[str, KvHintError] = field(default_factory=dict)
    #: hint_id -> engines the hint was routed to. An engine in `errors` did not apply its batch
    #: (its error says whether the batch was sent: one not sent before the deadline says so).
    routes: dict[str, list[str]] = field(default_factory=dict)
    #: Hints no engine holds (sent nowhere).
    unrouted: list[kvhint_pb2.Hint] = field(default_factory=list)
    #: engine -> why it was not asked at all in this call: the breaker skipped it (it failed to
    #: answer earlier calls; the text says how often, the last failure, and in how many seconds it
    #: may be asked again). Not an error: nothing was sent to it, and it is in neither `errors` nor
    #: any route. Only an engine not live in the index is skipped, and only when the index places
    #: every hint of the call on live engines (each hint went to those); still, the skipped engine
    #: may hold what a hint selects too: a hint that must reach every holder (a Release) is not
    #: known to have reached them all while this is non-empty.
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def all_accepted(self) -> bool:
        """No engine failed (`errors` is empty), every hint went somewhere (`unrouted` is empty),
        and every result is ACCEPTED. Engines in `skipped` do not count against it (they were not
        asked; each hint went to the live engines the index places it on); check `skipped` too
        when a hint must reach every engine holding its selection."""
        return not self.errors and not self.unrouted and all(r.all_accepted for r in self.per_engine.values())

    def results_for(self, hint_id: str) -> dict[str, kvhint_pb2.HintResult]:
        """engine -> result of the hint with this id."""
        out = {}
        for engine, result in self.per_engine.items():
            found = result.result_for(hint_id)
            if found is not None:
                out[engine] = found
        return out


@overload
def data_parallel_endpoints(
    address: str, size: Optional[int] = None, *, name: str = "dp", timeout: Optional[float] = 10.0
) -> dict[str, str]: ...


@overload
def data_parallel_endpoints(
    address: ConnectionConfig, size: Optional[int] = None, *, name: str = "dp", timeout: Optional[float] = 10.0
) -> dict[str, ConnectionConfig]: ...


def data_parallel_endpoints(
    address: Union[str, ConnectionConfig], size: Optional[int] = None, *, name: str = "dp", timeout: Optional[float] = 10.0
) -> Union[dict[str, str], dict[str, ConnectionConfig]]:
    """{"dp0": "host:port", "dp1": "host:port+1", ...}: the KvHint servers of a data-parallel engine.

    `address` is rank 0's server (the engine's KVHINT_GRPC_ADDRESS), as a "host:port" string or a
    ConnectionConfig. Given a ConnectionConfig (TLS, a bearer token: what a server listening
    beyond loopback requires), every rank is reached with its settings and the mapping holds a
    copy of it per rank, with the rank's address; given a string, plain addresses. Without
    `size`, rank 0's GetCapabilities.data_parallel_size says how many ranks there are (0 from an
    older server: one). Every rank's GetCapabilities must name its own rank; KvHintError
    otherwise (e.g. the port range overlaps another engine's)."""
    base = as_config(address)
    host, port = base.address.rsplit(":", 1)
    if size is None:
        with KvHintClient(base) as client:
            size = max(1, client.capabilities(timeout=timeout).data_parallel_size)
    configs = {f"{name}{rank}": base.replace(address=f"{host}:{int(port) + rank}") for rank in range(size)}
    for rank, config in enumerate(configs.values()):
        rank_address = config.address
        with KvHintClient(config) as client:
            caps = client.capabilities(timeout=timeout)
        if caps.data_parallel_rank != rank or max(1, caps.data_parallel_size) != size:
            raise KvHintError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"GetCapabilities names rank {caps.data_parallel_rank} of {caps.data_parallel_size}, "
                f"expected rank {rank} of {size}",
                method="GetCapabilities",
                address=rank_address,
            )
    if isinstance(address, ConnectionConfig):
        return configs
    return {rank_name: config.address for rank_name, config in configs.items()}


class FleetClient:
    """Typed fan-out over several KvHint servers (blocking; calls run in parallel threads).

    Thread-safe: apply(), engines_for() and apply_to() may be called from several threads at once.
    The calls share one KvHintClient (one channel) per engine and one thread pool of `max_workers`
    threads (default CALLS_IN_PARALLEL per engine, started as needed); each apply() occupies up
    to one worker per engine, so up to max_workers / len(engines) calls run without waiting. A
    call to an engine that waited for a worker until its deadline passed is not sent and reports
    DEADLINE_EXCEEDED saying the pool was busy (raise max_workers).

    `breaker_backoff` / `breaker_max_backoff`: the failure memory (module doc): seconds an engine
    that failed to answer is skipped by later apply() calls where routing can do without it (an
    engine not live in the index, in a call whose every hint the index places on live engines),
    doubling per consecutive failure up to the max (defaults BREAKER_BACKOFF, BREAKER_MAX_BACKOFF;
    breaker_backoff=0 disables it). The state is shared by every thread calling apply() (guarded
    by a lock); an engine's backoff starts when the call that saw it fail ends.
    `follower`: its engines (or the engines the index has heard of) must share at least one name
    with `endpoints` (ValueError naming both otherwise; a warning logged once when some differ)."""

    def __init__(
        self,
        endpoints: EnginesLike,
        *,
        follower: Optional[Union[EventFollower, AsyncEventFollower, ResidencyIndex]] = None,
        max_workers: Optional[int] = None,
        breaker_backoff: float = BREAKER_BACKOFF,
        breaker_max_backoff: float = BREAKER_MAX_BACKOFF,
    ) -> None:
        if max_workers is not None and max_workers < 1:
            raise ValueError(f"max_workers must be >= 1 (or None: {CALLS_IN_PARALLEL} per engine), got {max_workers!r}")
        breaker = _Breaker(breaker_backoff, breaker_max_backoff)  # ValueError for bad values, before any channel
        follower_engines: list[str] = []
        # Either follower's index (ResidencyIndex is thread-safe: an AsyncEventFollower's loop
        # updates it while apply() reads it on the caller's thread). Anything else is refused
        # here; it used to fail at the first apply() with an AttributeError.
        if isinstance(follower, (EventFollower, AsyncEventFollower)):
            follower_engines = follower.engines
            follower = follower.index
        if follower is not None and not isinstance(follower, ResidencyIndex):
            raise TypeError(f"follower must be an EventFollower, an AsyncEventFollower or a ResidencyIndex, "
                            f"got {type(follower).__name__}")
        self._configs = _named_engines(endpoints)
        if follower is not None:
            _check_names(list(self._configs), list(dict.fromkeys([*follower_engines, *follower.engines()])))
        self._clients = {name: KvHintClient(cfg) for name, cfg in self._configs.items()}
        self._index = follower
        self._breaker = breaker
        self._workers = max_workers or CALLS_IN_PARALLEL * len(self._clients)
        self._pool = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="kvhint-fleet")

    @property
    def engines(self) -> list[str]:
        return list(self._clients)

    def client(self, engine: str) -> KvHintClient:
        return self._clients[engine]

    def _fan_out(
        self,
        engines: list[str],
        call: Callable[[str, KvHintClient], _T],
        *,
        until: Optional["_Deadline"] = None,
        method: Callable[[str], str] = lambda _: "",
        abandon: bool = False,
    ) -> tuple[dict[str, _T], dict[str, KvHintError]]:
        """Run call(name, client) for each engine on the pool, in parallel; KvHintErrors are
        collected per engine. With `until`, a call that has not started when it passes never runs
        and reports DEADLINE_EXCEEDED (saying the pool was busy when it was submitted in time);
        `method(name)` names the RPC the call sends. With `abandon` too, waits no longer than
        `until`: an engine whose call is still running then gets until.exceeded in the errors (its
        call is abandoned, not awaited; what it returns later is ignored)."""
        submitted_in_time = until is None or until.left() != 0.0

        def unstarted(engine: str) -> KvHintError:
            assert until is not None
            client = self._clients[engine]
            if submitted_in_time:
                return until.not_started(method(engine), client, self._workers)
            return until.exceeded(method(engine), client)

        def run(engine: str, client: KvHintClient) -> _T:
            if until is not None and until.left() == 0.0:
                raise unstarted(engine)
            return call(engine, client)

        futures = {engine: self._pool.submit(run, engine, self._clients[engine]) for engine in engines}
        results: dict[str, _T] = {}
        errors: dict[str, KvHintError] = {}
        if abandon and until is not None:
            _wait_futures(list(futures.values()), timeout=until.left())
        for engine, future in futures.items():
            if abandon and until is not None and not future.done():
                # Not started yet: cancelled, it never runs. Running: abandoned, its result ignored.
                late = until.exceeded(method(engine), self._clients[engine])
                errors[engine] = unstarted(engine) if future.cancel() else late
                continue
            try:
                results[engine] = future.result()
            except KvHintError as error:
                errors[engine] = error
        return results, errors

    # -- routing ----------------------------------------------------------------------------------

    @staticmethod
    def _asks_with(hint: kvhint_pb2.Hint) -> str:
        """The RPC that asks an engine whether it holds what the hint selects."""
        selector = hint.selector
        if selector.WhichOneof("target") == "session" and not selector.session.include_children:
            return "ListSessions"
        return "QueryResidency"

    def _holds(self, client: KvHintClient, hint: kvhint_pb2.Hint, timeout: Callable[[], Optional[float]]) -> bool:
        """Whether the engine holds what the hint selects; timeout() gives each call's timeout."""
        selector = hint.selector
        if self._asks_with(hint) == "ListSessions":
            return self._holds_session(client, selector.session.session_id, timeout)
        return bool(client.query_residency_page(selector, page_size=1, timeout=timeout()).blocks)

    def _holds_session(self, client: KvHintClient, session_id: str, timeout: Callable[[], Optional[float]]) -> bool:
        tokens = _rpc.PageTokens("ListSessions", client.address)
        while True:
            page = client.list_sessions_page(prefix=session_id, page_token=tokens.token, timeout=timeout())
            for info in page.sessions:
                if info.session_id == session_id:
                    return True
                if info.session_id > session_id:
                    return False  # pages are ordered by session_id
            if not tokens.advance(page.next_page_token):
                return False

    def _ask_all(
        self, questions: dict[str, list[kvhint_pb2.Hint]], routing: "_Deadline", contacted: set[str]
    ) -> tuple[dict[str, list[str]], dict[str, KvHintError]]:
        """hint_id -> the engines holding it, asking each engine about its hints in `questions`,
        in turn (the engines in parallel) and waiting no longer than `routing`: an engine that has
        not answered by then, or fails, is reported and not asked further (the answers it gave
        still count). Adds to `contacted` each engine a call was sent to."""
        engines = [engine for engine in self.engines if questions.get(engine)]
        answers: dict[str, list[str]] = {engine: [] for engine in engines}
        asking: dict[str, str] = {engine: self._asks_with(questions[engine][0]) for engine in engines}

        def ask(name: str, client: KvHintClient) -> None:
            def timeout() -> Optional[float]:
                left = routing.call_timeout(asking[name], client)
                contacted.add(name)  # a call is sent with it
                return left

            for hint in questions[name]:
                asking[name] = self._asks_with(hint)
                try:
                    held = self._holds(client, hint, timeout)
                except KvHintError as error:
                    if error.code == grpc.StatusCode.DEADLINE_EXCEEDED and routing.left() == 0.0:
                        raise routing.exceeded(asking[name], client) from error
                    raise
                if held:
                    answers[name].append(hint.hint_id)

        _, errors = self._fan_out(engines, ask, until=routing, method=asking.__getitem__, abandon=True)
        held_by = {engine: set(answers[engine]) for engine in engines}  # what a late engine answers after this is not read
        hint_ids = dict.fromkeys(hint.hint_id for hints in questions.values() for hint in hints)
        return {hint_id: [e for e in engines if hint_id in held_by[e]] for hint_id in hint_ids}, errors

    def _from_index(self, hint: kvhint_pb2.Hint) -> list[str]:
        """The engines the index finds the hint's selection on ([]: ask the engines)."""
        if self._index is None:
            return []
        target = Target.from_selector(hint.selector)
        if target.session_id is not None and not target.include_children:
            return [r.engine for r in self._index.engines_for_session(target.session_id) if r.engine in self._clients]
        if target.block_hashes:
            holders: set[str] = set()
            for raw in target.block_hashes:
                holders |= self._index.engines_for_block(raw)
            return [e for e in self.engines if e in holders]
        return []

    def _questions(self, hints: list[kvhint_pb2.Hint], found: dict[str, list[str]]) -> dict[str, list[kvhint_pb2.Hint]]:
        """engine -> the hints to ask it about, given what the index `found` (hint_id -> engines):
        every engine about the hints the index does not resolve; the engines not live in the index
        (it cannot speak for them) about the hints it does resolve as well."""
        index = self._index
        unknown = [] if index is None else [e for e in self.engines if not index.is_live(e)]
        questions = {e: [h for h in hints if e in unknown or not found[h.hint_id]] for e in self.engines}
        return {engine: asked for engine, asked in questions.items() if asked}

    def engines_for(self, hint: kvhint_pb2.Hint, *, timeout: Optional[float] = None) -> tuple[list[str], dict[str, KvHintError]]:
        """The engines a hint is routed to (as apply() routes it: the index's, then those of the
        engines asked that hold it), and errors from engines that could not be asked."""
        found = self._from_index(hint)
        ask = list(self._questions([hint], {hint.hint_id: found}))
        held, errors = self._fan_out(ask, lambda _, c: self._holds(c, hint, lambda: timeout))
        return _merged(found, [e for e in ask if held.get(e)]), errors

    # -- apply --------------------------------------------------------------------------------------

    def apply(self, *hints: kvhint_pb2.Hint, broadcast: bool = False, timeout: Optional[float] = None) -> FleetApplyResult:
        """Route each hint (see module doc), then apply one batch per engine, in parallel. `timeout`
        bounds the whole call (module doc; routing takes at most ROUTING_SHARE of it); default: the
        longest of the engines' default_timeout (None, no deadline, when one of them has none).
        Engines the failure memory skips (module doc) are reported in `skipped`, not asked.
        ValueError, before anything is sent, for a bad timeout (config.check_timeout) or a hint_id
        that repeats an earlier hint's."""
        prepared = _rpc.prepare_hints(hints, self._id_limits())
        _check_unique_ids(prepared)
        if timeout is not None:
            check_timeout(timeout, "timeout")
        deadline = _Deadline(timeout if timeout is not None else self._default_timeout())
        batches: dict[str, list[kvhint_pb2.Hint]] = {}
        routes: dict[str, list[str]] = {}
        unrouted: list[kvhint_pb2.Hint] = []
        errors: dict[str, KvHintError] = {}
        skipped: dict[str, str] = {}
        probes: set[str] = set()  # engines this call probes (their backoff has passed)
        contacted: set[str] = set()  # engines sent a call: their outcome updates the breaker
        try:
            found = {} if broadcast else {hint.hint_id: self._from_index(hint) for hint in prepared}
            questions = {} if broadcast else self._questions(prepared, found)
            # The engines routing could do without: asked only about hints the index places on live
            # engines (so, not live themselves). Any other engine asked may be a hint's only holder.
            optional = [e for e, asked_about in questions.items() if all(found[h.hint_id] for h in asked_about)]
            for engine in optional:
                why = self._breaker.admit(engine)
                if why is None:
                    continue
                if why == _PROBE:
                    probes.add(engine)
                else:
                    skipped[engine] = why
                    del questions[engine]
            asked: dict[str, list[str]] = {}
            if questions:
                asked, errors = self._ask_all(questions, deadline.routing(), contacted)
            for hint in prepared:
                engines = self.engines if broadcast else _merged(found[hint.hint_id], asked.get(hint.hint_id, []))
                routes[hint.hint_id] = engines
                if not engines:
                    unrouted.append(hint)
                for engine in engines:
                    batches.setdefault(engine, []).append(hint)
            order = [e for e in self.engines if e in batches]
            for engine in order:  # ValueError before any engine applies anything
                _rpc.check_limits(batches[engine], self._clients[engine].limits)

            def send(name: str, client: KvHintClient) -> ApplyResult:
                call_timeout = deadline.call_timeout("ApplyHints", client)
                contacted.add(name)
                return client.apply(*batches[name], timeout=call_timeout)

            per_engine, apply_errors = self._fan_out(order, send, until=deadline, method=lambda _: "ApplyHints")
            errors.update(apply_errors)
        finally:
            # A copy (atomic): a routing call abandoned at its deadline may still be running.
            self._breaker.record(frozenset(contacted), errors, probes)
        return FleetApplyResult(per_engine=per_engine, errors=errors, routes=routes, unrouted=unrouted, skipped=skipped)

    def _id_limits(self) -> Optional[kvhint_pb2.Limits]:
        """The limits the ids apply() gives hints must fit (one id per hint, for every engine it is
        routed to): the shortest max_hint_id_length among the engines whose limits were read
        (KvHintClient.capabilities()); None when none was."""
        known = [c.limits.max_hint_id_length for c in self._clients.values()
                 if c.limits is not None and c.limits.max_hint_id_length]
        return kvhint_pb2.Limits(max_hint_id_length=min(known)) if known else None

    def _default_timeout(self) -> Optional[float]:
        timeouts = [cfg.default_timeout for cfg in self._configs.values()]
        return None if any(t is None for t in timeouts) else max(t for t in timeouts if t is not None)

    def apply_to(self, engine: str, *hints: kvhint_pb2.Hint, timeout: Optional[float] = None) -> ApplyResult:
        """Apply hints on one named engine."""
        return self._clients[engine].apply(*hints, timeout=timeout)

    # -- lifecycle ----------------------------------------------------------------------------------

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for client in self._clients.values():
            client.close()

    def __enter__(self) -> "FleetClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Deadline:
    """One call's deadline (None: none): the time left for each step of it."""

    def __init__(self, timeout: Optional[float], *, whole: Optional["_Deadline"] = None) -> None:
        self.timeout = timeout
        self._at = None if timeout is None else time.monotonic() + timeout
        self._whole = whole  # set on routing's share of a call's deadline: that call's deadline

    def left(self) -> Optional[float]:
        """Seconds left (None: no deadline; 0.0 once it has passed)."""
        return None if self._at is None else max(0.0, self._at - time.monotonic())

    def routing(self) -> "_Deadline":
        """The part of the time left that routing may take: ROUTING_SHARE of it."""
        left = self.left()
        return _Deadline(None if left is None else left * ROUTING_SHARE, whole=self)

    def call_timeout(self, method: str, client: KvHintClient) -> Optional[float]:
        """The time left for a call of `method` (None: no deadline); DEADLINE_EXCEEDED once passed."""
        left = self.left()
        if left == 0.0:
            raise self.exceeded(method, client)
        return left

    def _name(self) -> str:
        if self._whole is not None:
            return (
                f"FleetClient.apply's deadline ({self._whole.timeout:g}s) leaves routing {ROUTING_SHARE:.0%} of it "
                f"({self.timeout:.3g}s), which"
            )
        return f"FleetClient.apply's deadline ({self.timeout:g}s)"

    def exceeded(self, method: str, client: KvHintClient) -> KvHintError:
        """The engine did not answer `method` in time (routing), or was left no time to be sent it."""
        happened = f"answered {method}" if self._whole is not None else f"was sent {method}"
        details = f"{self._name()} passed before this engine {happened}"
        return KvHintError(grpc.StatusCode.DEADLINE_EXCEEDED, details, method=method, address=client.address)

    def not_started(self, method: str, client: KvHintClient, workers: int) -> KvHintError:
        """The call to `method` waited for a pool worker until the deadline passed: never sent."""
        details = (
            f"{self._name()} passed while the call to {method} waited for a worker of the FleetClient's thread "
            f"pool (max_workers={workers}, all busy with other apply() calls): it was not sent; the engine was not asked"
        )
        return KvHintError(grpc.StatusCode.DEADLINE_EXCEEDED, details, method=method, address=client.address)


#: _Breaker.admit's answer for the call that probes an engine whose backoff has passed.
_PROBE = "probe"


@dataclass
class _Failing:
    """What _Breaker remembers of an engine that failed to answer."""

    failures: int  # consecutive failures
    until: float  # asked again from then on (the breaker's clock)
    probing: bool  # a call is probing it now
    last: str  # the last failure, for `skipped`'s text


class _Breaker:
    """FleetClient's per-engine failure memory (thread-safe). An engine fails when a call was sent
    to it and ended UNAVAILABLE or DEADLINE_EXCEEDED (BREAKER_CODES); after its n-th consecutive
    failure it is not admitted for min(max_backoff, backoff * 2**(n-1)) seconds, then admitted
    to one call at a time (the probe) until a call records its outcome. Any other outcome of a
    call sent to it (an answer, whatever its status) forgets its failures. backoff=0: admits
    every engine and records nothing."""

    def __init__(self, backoff: float, max_backoff: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not backoff >= 0 or backoff == float("inf"):
            raise ValueError(f"breaker_backoff must be a number of seconds >= 0 (0 disables the breaker), got {backoff!r}")
        if backoff and not backoff <= max_backoff:
            raise ValueError(f"breaker_max_backoff must be >= breaker_backoff ({backoff!r}), got {max_backoff!r}")
        self.backoff = backoff
        self.max_backoff = max_backoff
        self._clock = clock
        self._lock = threading.Lock()
        self._open: dict[str, _Failing] = {}

    def admit(self, engine: str) -> Optional[str]:
        """None: ask it (no failure remembered); _PROBE: ask it, this call probes it (record()
        must be given it); otherwise why it is skipped."""
        if not self.backoff:
            return None
        with self._lock:
            state = self._open.get(engine)
            if state is None:
                return None
            failures, last = state.failures, state.last
            wait = state.until - self._clock()
            if wait <= 0 and not state.probing:
                state.probing = True
                return _PROBE
        times = "1 call" if failures == 1 else f"{failures} calls in a row"
        why = f"not asked (FleetClient breaker): it failed to answer {times}, the last {last}; "
        if wait > 0:
            return why + f"it may be asked again in {wait:.3g}s (backoff {self._backoff(failures):g}s)"
        return why + "its backoff has passed and another apply() call is asking it again now"

    def _backoff(self, failures: int) -> float:
        return min(self.max_backoff, self.backoff * 2.0 ** min(failures - 1, 64))

    def record(self, contacted: frozenset[str], errors: dict[str, KvHintError], probes: set[str]) -> None:
        """One apply() call's outcomes: each engine in `contacted` failed (its error's code is in
        BREAKER_CODES) or answered; the probes of `probes` end (whether or not they were sent)."""
        if not self.backoff:
            return
        with self._lock:
            now = self._clock()
            for engine in contacted | probes:
                error = errors.get(engine)
                state = self._open.get(engine)
                if engine not in contacted:  # a probe never sent (the pool was busy): no outcome
                    if state is not None:
                        state.probing = False
                elif error is not None and error.code in BREAKER_CODES:
                    failures = (state.failures if state is not None else 0) + 1
                    last = f"{error.code.name} on {error.method or 'a call'}"
                    # Another call's probe (not this call's) keeps running: still one at a time.
                    probing = state is not None and state.probing and engine not in probes
                    self._open[engine] = _Failing(failures, now + self._backoff(failures), probing, last)
                else:
                    self._open.pop(engine, None)


def _check_names(endpoints: list[str], indexed: list[str]) -> None:
    """ValueError when the follower's engines (or the engines its index has heard of) share no name
    with the FleetClient's endpoints (the index would route nothing: every call would ask every
    engine); a warning when only some differ. Not checked while the index has heard of none."""
    if not indexed:
        return
    only_fleet = [e for e in endpoints if e not in indexed]
    only_index = [e for e in indexed if e not in endpoints]
    if len(only_fleet) == len(endpoints):
        raise ValueError(
            f"the follower's engines {indexed} share no name with the FleetClient's endpoints {endpoints}: "
            "its index could route no hint (name each engine the same in both, e.g. pass both the same mapping)"
        )
    if only_fleet or only_index:
        log.warning(
            "FleetClient: endpoints %s are not engines of the follower (its index cannot speak for them: every "
            "apply() call asks them), and the follower's engines %s are not endpoints (apply() ignores what the "
            "index places on them); name each engine the same in both",
            only_fleet, only_index,
        )


def _merged(first: list[str], then: list[str]) -> list[str]:
    """`first`, then the engines of `then` not in it."""
    return first + [engine for engine in then if engine not in first]


def _check_unique_ids(hints: list[kvhint_pb2.Hint]) -> None:
    """ValueError naming both positions when a hint_id repeats an earlier hint's (routes and
    results are keyed by hint_id; an engine sent both would reject the second)."""
    first: dict[str, int] = {}
    for i, hint in enumerate(hints):
        j = first.setdefault(hint.hint_id, i)
        if j != i:
            raise ValueError(
                f"hints[{i}].hint_id {hint.hint_id!r} repeats hints[{j}]'s: hint ids must be unique within one "
                "FleetClient.apply call"
            )


__all__ = ["FleetApplyResult", "FleetClient", "data_parallel_endpoints"]
