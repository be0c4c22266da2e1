"""The engines the test suite's fixtures take, started two at a time.

An engine start is mostly Python processes importing torch and vLLM, each on one core (the API
server, then EngineCore, which the tests fork rather than spawn: tests/conftest.py): about 19 s
per start (35 s spawned), and the whole suite starts about twenty-five. This project's machines have two cores, and two starts side by side take about as
long as one (bench/results/engine_starts.md). So when a fixture takes an engine that is not
running yet, the pool starts it and, beside it, the next engine the session's remaining tests
will need (the plan: `plan(items)`, from the collected tests); when that engine's fixture asks
for it, it is running. A fixture's engine is stopped in the background while the next tests run.

Engine-neutral: an entry is a `start()` that returns a running engine and a `stop(engine)`. The
pool knows nothing of vLLM or pytest beyond an item's `fixturenames` and `callspec` (`uses`).

With `side_by_side=1` nothing is started ahead and every stop finishes before `give_back`
returns: the behaviour of plain fixtures, for machines where engines must not start side by
side (a GPU's memory profiling counts a neighbour's memory).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

Predicate = Callable[[Any], bool]
_ANY = object()


def uses(fixture: str, param: object = _ANY) -> Predicate:
    """A test item needs the engine if `fixture` is in its fixture closure (and, given `param`,
    the item runs with that parameter of `fixture`)."""

    def needed(item: Any) -> bool:
        if fixture not in getattr(item, "fixturenames", ()):
            return False
        if param is _ANY:
            return True
        callspec = getattr(item, "callspec", None)
        return callspec is not None and callspec.params.get(fixture, _ANY) == param

    return needed


@dataclass
class _Entry:
    name: str
    start: Callable[[], Any]
    stop: Callable[[Any], None]
    needed_by: list[Predicate] = field(default_factory=list)
    future: Future[Any] | None = None  # started (running, or starting), not yet given back
    taken: bool = False


class EnginePool:
    def __init__(self, side_by_side: int = 2) -> None:
        if side_by_side < 1:
            raise ValueError(f"side_by_side must be >= 1, got {side_by_side}")
        self.side_by_side = side_by_side
        self._entries: dict[str, _Entry] = {}
        self._plan: list[str] = []
        self._lock = threading.Lock()
        self._stops: list[Future[None]] = []
        self._executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="engine-pool")

    # ------------------------------------------------------------------ registry

    def register(self, name: str, start: Callable[[], Any], stop: Callable[[Any], None], *needed_by: Predicate) -> None:
        """An engine the pool may start: `start()` returns it running, `stop(engine)` stops it.
        `needed_by` says which test items use it (more may be added with `needs`)."""
        with self._lock:
            if name in self._entries:
                raise ValueError(f"engine {name!r} is registered twice")
            self._entries[name] = _Entry(name, start, stop, list(needed_by))

    def needs(self, name: str, predicate: Predicate) -> None:
        """Another kind of test item that uses engine `name` (e.g. one that takes it by name
        through `request.getfixturevalue`, which pytest's fixture closure does not show)."""
        with self._lock:
            self._entry(name).needed_by.append(predicate)

    def plan(self, items: Iterable[Any]) -> list[str]:
        """Set (and return) the order in which the given test items, run in order, first need
        each registered engine. Engines no item needs are never started ahead."""
        order: list[str] = []
        with self._lock:
            for item in items:
                for e in self._entries.values():
                    if e.name not in order and any(p(item) for p in e.needed_by):
                        order.append(e.name)
            self._plan = order
        return list(order)

    # ------------------------------------------------------------------ use

    def take(self, name: str) -> Any:
        """Engine `name`, running; the caller owns it until `give_back`. If it is not started yet,
        it is started now, and with it (up to side_by_side engines at once) the next engines the
        plan needs that are not started. Raises what its start raised."""
        with self._lock:
            entry = self._entry(name)
            if entry.taken:
                raise RuntimeError(f"engine {name!r} is taken already (give it back first)")
            if entry.future is None:
                entry.future = self._executor.submit(entry.start)
                for ahead in self._ahead(self.side_by_side - 1):
                    ahead.future = self._executor.submit(ahead.start)
            entry.taken = True
            if name in self._plan:
                self._plan.remove(name)
            future = entry.future
        try:
            return future.result()
        except BaseException:
            with self._lock:
                entry.taken = False
                if future.done():  # the start failed: a later take starts it afresh
                    entry.future = None
                # else interrupted while it starts (Ctrl-C): close() stops it once it is up
            raise

    def give_back(self, name: str, engine: Any) -> None:
        """Stop engine `name` (in the background when engines may start side by side)."""
        with self._lock:
            entry = self._entry(name)
            entry.future, entry.taken = None, False
            if self.side_by_side > 1:
                self._stops.append(self._executor.submit(entry.stop, engine))
                return
        entry.stop(engine)

    @contextlib.contextmanager
    def engine(self, name: str) -> Iterator[Any]:
        """`take(name)` for a block (a fixture's lifetime), then `give_back`."""
        engine = self.take(name)
        try:
            yield engine
        finally:
            self.give_back(name, engine)

    def started(self) -> list[str]:
        """The engines started (or starting) and not given back, in registration order."""
        with self._lock:
            return [e.name for e in self._entries.values() if e.future is not None]

    def close(self) -> list[BaseException]:
        """Stop the engines started ahead that no fixture took, and wait for every stop. Returns
        the errors (a start ahead that failed and was never taken, or a stop that failed)."""
        errors: list[BaseException] = []
        with self._lock:
            leftover = [e for e in self._entries.values() if e.future is not None and not e.taken]
        for e in leftover:
            assert e.future is not None
            try:
                engine = e.future.result()
            except BaseException as exc:  # noqa: BLE001 - reported, not raised: nothing needed it
                errors.append(exc)
            else:
                self._stops.append(self._executor.submit(e.stop, engine))
            e.future = None
        for stop in self._stops:
            exc = stop.exception()
            if exc is not None:
                errors.append(exc)
        self._stops = []
        return errors

    # ------------------------------------------------------------------ internals

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"no engine {name!r} is registered (known: {', '.join(self._entries) or 'none'})") from None

    def _ahead(self, count: int) -> list[_Entry]:
        """Up to `count` entries the plan needs next that are not started (lock held)."""
        out: list[_Entry] = []
        for name in self._plan:
            if len(out) >= count:
                break
            e = self._entries[name]
            if e.future is None and not e.taken:
                out.append(e)
        return out
