"""Causal replay schedule of a trace (`build_plan`) for `bench.agentic_engine`.

Every session runs in its own causal chain: a request may be sent ``delay``
trace seconds after its ``anchor`` completed, and never before its ``deps``
(the requests whose outputs its prompt contains, its session's previous
request, a resuming parent's children). Each signal is delivered when the
request it follows completes; signals no request precedes are timed.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from bench.trace import Out, Request, Signal, Trace


@dataclass
class ReplayPlan:
    """Causal schedule of a trace: when each request may be sent and which
    signals it releases when it completes."""

    requests: list[Request]
    deps: list[set[int]]  # requests that must complete first
    anchor: list[int | None]  # send `delay` after this one completed (None: at `t`)
    delay: list[float]  # trace seconds
    signals_after: list[list[Signal]]  # delivered when the request completes
    timed_signals: list[Signal]  # signals no request precedes: delivered at their `t`
    closed_loop: bool

    @property
    def dependents(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.requests]
        for i, ds in enumerate(self.deps):
            for d in ds:
                out[d].append(i)
        return out


def build_plan(trace: Trace) -> ReplayPlan:
    reqs = trace.requests()
    idx = {r.request_id: i for i, r in enumerate(reqs)}
    n = len(reqs)
    deps: list[set[int]] = [set() for _ in range(n)]
    anchor: list[int | None] = [None] * n
    delay = [0.0] * n
    closed_loop = any(r.after is not None for r in reqs)
    by_session: dict[str, list[int]] = {}
    prev_in_session: list[int | None] = [None] * n
    for i, r in enumerate(reqs):
        lst = by_session.setdefault(r.session_id, [])
        prev_in_session[i] = lst[-1] if lst else None
        lst.append(i)
    first_of = {s: lst[0] for s, lst in by_session.items()}
    children_of: dict[str, list[str]] = {}
    for s, first in first_of.items():
        parent = reqs[first].parent_session_id
        if parent is not None:
            children_of.setdefault(parent, []).append(s)

    for i, r in enumerate(reqs):
        p = prev_in_session[i]
        if p is not None:
            deps[i].add(p)
        for seg in r.prompt:
            if isinstance(seg, Out) and seg.request_id in idx:
                deps[i].add(idx[seg.request_id])
        # a parent resuming after its sub-agents waits for all of them
        for c in children_of.get(r.session_id, ()):
            f = first_of[c]
            if (p is None or f > p) and f < i:
                deps[i].add(by_session[c][-1])
        if r.after is not None and r.after in idx:
            a = idx[r.after]
            anchor[i] = a
            deps[i].add(a)
            if r.delay_s is not None:
                delay[i] = r.delay_s
            else:
                done = reqs[a].t_done
                delay[i] = max(0.0, r.t - (done if done is not None else reqs[a].t))

    # Map each signal to the request it follows: the latest request of its
    # session (the parent's, for child_spawned) issued no later than the signal.
    signals_after: list[list[Signal]] = [[] for _ in range(n)]
    timed: list[Signal] = []
    times = {s: [reqs[i].t for i in lst] for s, lst in by_session.items()}
    for sig in trace.signals():
        sid = sig.parent_session_id if sig.kind == "child_spawned" else sig.session_id  # type: ignore[union-attr]
        lst = by_session.get(sid)
        k = bisect.bisect_right(times[sid], sig.t) - 1 if lst else -1
        if k >= 0:
            signals_after[lst[k]].append(sig)  # type: ignore[index]
        else:
            timed.append(sig)

    # Closed-loop session starts: a top-level session that starts after another
    # ended is anchored on that end (the i-th such start on the i-th end; every
    # start is at or after its end, so the pairing is causal).
    if closed_loop:
        ends: list[tuple[float, int]] = []
        for s, lst in by_session.items():
            if reqs[lst[0]].parent_session_id is not None:
                continue
            last = lst[-1]
            end_sig = [g for g in signals_after[last] if g.kind == "session_ended" and g.session_id == s]  # type: ignore[union-attr]
            if end_sig:
                ends.append((end_sig[0].t, last))
        ends.sort()
        starts = sorted(
            (reqs[i].t, i) for i in range(n) if anchor[i] is None and prev_in_session[i] is None and reqs[i].parent_session_id is None
        )
        j = 0
        pending: list[tuple[float, int]] = []
        for t, i in starts:
            while j < len(ends) and ends[j][0] <= t:
                pending.append(ends[j])
                j += 1
            if pending:
                end_t, last = pending.pop(0)
                if last != i and i not in deps[last]:
                    anchor[i] = last
                    deps[i].add(last)
                    delay[i] = t - end_t
    return ReplayPlan(reqs, deps, anchor, delay, signals_after, timed, closed_loop)
