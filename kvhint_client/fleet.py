"""FleetClient: send hints to the engines that hold what they select.

    fleet = FleetClient({"e1": "10.0.0.1:50151", "e2": "10.0.0.2:50151"}, follower=follower)
    out = fleet.apply(session("agent-7").pin(ttl=30))
    out.per_engine["e1"].all_accepted

Routing of each hint (by its selector):
- With a ResidencyIndex (an EventFollower's, or one passed directly; engine names must match the
  endpoint names): a session selector goes to the live engines holding blocks of that session
  (most blocks first); a block-hash selector to the live engines holding any of the hashes.
  Selectors the index cannot resolve (continuations, include_children) and selections the index
  finds nowhere (e.g. a session that holds only retention, or an engine not yet synced) are
  resolved by asking the engines.
- Without an index, or for those selectors: a session selector (without include_children) goes
  to the engines whose ListSessions has that exact session (which includes sessions holding
  only retention); other selectors to the engines whose QueryResidency finds at least one block.
- `broadcast=True` skips routing and sends every hint to every engine.

Data parallelism: an engine started with `--data-parallel-size N` runs N engine cores, each with
its own KV-cache pool and its own KvHint server on port + rank. Treat the ranks as engines:
`FleetClient(data_parallel_endpoints("10.0.0.1:50151"))` (and the same mapping for an
EventFollower) routes each session's hints to the rank that served it.

Each engine receives one ApplyHints batch holding its hints in request order (same hint_id on
every engine, so per-engine retries stay idempotent). Engines that fail (routing or apply) are
reported in `errors`; hints that no engine holds are reported in `unrouted` and sent nowhere.
`apply(timeout=...)` bounds the whole call, routing and applying together (default: the longest
of the engines' `default_timeout`s): each call gets the time left, an engine that failed to answer
while routing is not asked again in the same call, and an engine whose batch the deadline leaves
no time for reports DEADLINE_EXCEEDED in `errors` without being sent anything. The engines are
asked in parallel (each about every hint the index does not resolve, in turn), and routing may
take at most half of the time left (ROUTING_SHARE), so one engine that does not answer (hung,
partitioned) cannot leave the engines that did answer without time for their batches: it reports
DEADLINE_EXCEEDED in `errors`, and a hint no engine that answered holds is reported in `unrouted`.
A batch over an engine's known GetCapabilities limits raises ValueError before any engine is sent
anything.
"""

from __future__ import annotations

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
from .config import ConnectionConfig, as_config
from .errors import KvHintError
from .follower import EnginesLike, EventFollower, ResidencyIndex, _named_engines
from .results import ApplyResult

_T = TypeVar("_T")

#: The share of the time left that FleetClient.apply's routing may take (the rest is the batches').
ROUTING_SHARE = 0.5


@dataclass(frozen=True)
class FleetApplyResult:
    """Per-engine outcomes of one FleetClient.apply()."""

    per_engine: dict[str, ApplyResult] = field(default_factory=dict)
    errors: dict[str, KvHintError] = field(default_factory=dict)
    #: hint_id -> engines the hint was sent to.
    routes: dict[str, list[str]] = field(default_factory=dict)
    #: Hints no engine holds (sent nowhere).
    unrouted: list[kvhint_pb2.Hint] = field(default_factory=list)

    @property
    def all_accepted(self) -> bool:
        """No engine failed, every hint went somewhere, and every result is ACCEPTED."""
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
    """Typed fan-out over several KvHint servers (blocking; calls run in parallel threads)."""

    def __init__(
        self,
        endpoints: EnginesLike,
        *,
        follower: Optional[Union[EventFollower, ResidencyIndex]] = None,
        max_workers: Optional[int] = None,
    ) -> None:
        self._configs = _named_engines(endpoints)
        self._clients = {name: KvHintClient(cfg) for name, cfg in self._configs.items()}
        self._index = follower.index if isinstance(follower, EventFollower) else follower
        self._pool = ThreadPoolExecutor(max_workers=max_workers or len(self._clients), thread_name_prefix="kvhint-fleet")

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
        late: Optional[Callable[[str], KvHintError]] = None,
    ) -> tuple[dict[str, _T], dict[str, KvHintError]]:
        """Run call(name, client) for each engine in parallel; KvHintErrors are collected per engine.
        With `until` (and `late`), waits no longer than that deadline: an engine whose call has not
        returned by then gets late(name) in the errors (its call is abandoned, not awaited)."""
        futures = {engine: self._pool.submit(call, engine, self._clients[engine]) for engine in engines}
        results: dict[str, _T] = {}
        errors: dict[str, KvHintError] = {}
        wait_s = None if until is None or late is None else until.left()
        if wait_s is not None:
            _wait_futures(list(futures.values()), timeout=wait_s)
        for engine, future in futures.items():
            if wait_s is not None and late is not None and not future.done():
                future.cancel()  # not started yet: never runs; running: its result is ignored
                errors[engine] = late(engine)
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
        self, hints: list[kvhint_pb2.Hint], routing: "_Deadline"
    ) -> tuple[dict[str, list[str]], dict[str, KvHintError]]:
        """hint_id -> the engines holding it, asking each engine about every hint in turn (the
        engines in parallel) and waiting no longer than `routing`: an engine that has not answered
        by then, or fails, is reported and not asked further (the answers it gave still count)."""
        answers: dict[str, list[str]] = {engine: [] for engine in self.engines}
        asking: dict[str, str] = {engine: self._asks_with(hints[0]) for engine in self.engines}

        def ask(name: str, client: KvHintClient) -> None:
            def timeout() -> Optional[float]:
                return routing.call_timeout(asking[name], client)

            for hint in hints:
                asking[name] = self._asks_with(hint)
                try:
                    held = self._holds(client, hint, timeout)
                except KvHintError as error:
                    if error.code == grpc.StatusCode.DEADLINE_EXCEEDED and routing.left() == 0.0:
                        raise routing.exceeded(asking[name], client) from error
                    raise
                if held:
                    answers[name].append(hint.hint_id)

        _, errors = self._fan_out(
            self.engines, ask, until=routing, late=lambda e: routing.exceeded(asking[e], self._clients[e])
        )
        held_by = {engine: set(answers[engine]) for engine in self.engines}  # what a late engine answers after this is not read
        return {h.hint_id: [e for e in self.engines if h.hint_id in held_by[e]] for h in hints}, errors

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

    def engines_for(self, hint: kvhint_pb2.Hint, *, timeout: Optional[float] = None) -> tuple[list[str], dict[str, KvHintError]]:
        """The engines a hint is routed to, and errors from engines that could not be asked."""
        found = self._from_index(hint)
        if found:
            return found, {}
        held, errors = self._fan_out(self.engines, lambda _, c: self._holds(c, hint, lambda: timeout))
        return [e for e in self.engines if held.get(e)], errors

    # -- apply --------------------------------------------------------------------------------------

    def apply(self, *hints: kvhint_pb2.Hint, broadcast: bool = False, timeout: Optional[float] = None) -> FleetApplyResult:
        """Route each hint (see module doc), then apply one batch per engine, in parallel. `timeout`
        bounds the whole call (module doc; routing takes at most ROUTING_SHARE of it); default: the
        longest of the engines' default_timeout (None, no deadline, when one of them has none)."""
        prepared = _rpc.prepare_hints(hints)
        if timeout is not None and timeout <= 0:
            raise ValueError("timeout must be > 0")
        deadline = _Deadline(timeout if timeout is not None else self._default_timeout())
        batches: dict[str, list[kvhint_pb2.Hint]] = {}
        routes: dict[str, list[str]] = {}
        unrouted: list[kvhint_pb2.Hint] = []
        errors: dict[str, KvHintError] = {}
        found = {} if broadcast else {hint.hint_id: self._from_index(hint) for hint in prepared}
        to_ask = [hint for hint in prepared if not broadcast and not found[hint.hint_id]]
        asked: dict[str, list[str]] = {}
        if to_ask:
            asked, errors = self._ask_all(to_ask, deadline.routing())
        for hint in prepared:
            engines = self.engines if broadcast else found[hint.hint_id] or asked[hint.hint_id]
            routes[hint.hint_id] = engines
            if not engines:
                unrouted.append(hint)
            for engine in engines:
                batches.setdefault(engine, []).append(hint)
        order = [e for e in self.engines if e in batches]
        for engine in order:  # ValueError before any engine applies anything
            _rpc.check_limits(batches[engine], self._clients[engine].limits)

        def send(name: str, client: KvHintClient) -> ApplyResult:
            left = deadline.left()
            if left == 0.0:
                raise deadline.exceeded("ApplyHints", client)
            return client.apply(*batches[name], timeout=left)

        per_engine, apply_errors = self._fan_out(order, send)
        errors.update(apply_errors)
        return FleetApplyResult(per_engine=per_engine, errors=errors, routes=routes, unrouted=unrouted)

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

    def exceeded(self, method: str, client: KvHintClient) -> KvHintError:
        if self._whole is not None:
            details = (
                f"FleetClient.apply's deadline ({self._whole.timeout:g}s) leaves routing {ROUTING_SHARE:.0%} of it "
                f"({self.timeout:.3g}s), which passed before this engine answered {method}"
            )
        else:
            details = f"FleetClient.apply's deadline ({self.timeout:g}s) passed before this engine was sent {method}"
        return KvHintError(grpc.StatusCode.DEADLINE_EXCEEDED, details, method=method, address=client.address)


__all__ = ["FleetApplyResult", "FleetClient", "data_parallel_endpoints"]
