"""The sidecar's Prometheus metrics, as an operator scraping them would see them."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from kvhint_server.metrics import KvHintMetrics, MetricsExporter
from kvhint_unit_support import Harness, gate_engine_steps, h, pin, retain

from kvhint.v1 import kvhint_pb2 as pb


def _exporter(harness: Harness) -> tuple[CollectorRegistry, MetricsExporter]:
    registry = CollectorRegistry()
    hub = harness.server.servicer.hub
    exporter = MetricsExporter(
        harness.core, KvHintMetrics(registry),
        subscribers=lambda: (hub.subscribers if hub is not None else 0, 0),
    )
    return registry, exporter


def test_hint_outcomes_protected_blocks_and_pins_broken_are_counted(harness: Harness) -> None:
    registry, exporter = _exporter(harness)
    harness.engine.store([h(1), h(2), h(3)], session="agent-1")
    harness.engine.store([h(4), h(5)], session="agent-2")
    assert harness.apply(pin("agent-1", 30)).results[0].outcome == 1
    assert harness.apply(retain("agent-2", 30, priority=3)).results[0].outcome == 1
    harness.apply(pin("nobody", 30))
    exporter.poll()

    value = registry.get_sample_value
    assert value("kvhint_hints_total", {"action": "pin", "outcome": "accepted", "reason": "unspecified"}) == 1
    assert value("kvhint_hints_total", {"action": "retain", "outcome": "accepted", "reason": "unspecified"}) == 1
    assert value("kvhint_hints_total", {"action": "pin", "outcome": "missing", "reason": "not_resident"}) == 1
    assert value("kvhint_protected_blocks", {"class": "pinned"}) == 3
    assert value("kvhint_protected_blocks", {"class": "retained"}) == 2
    assert value("kvhint_pin_budget_used_blocks") == 3
    assert value("kvhint_events_published_total", {"kind": "blocks_stored"}) == 2
    assert value("kvhint_events_published_total", {"kind": "hint_applied"}) == 3

    harness.engine.run(lambda: harness.core.on_pin_broken([h(1), h(2)], 2))
    exporter.poll()
    assert value("kvhint_pins_broken_total") == 2
    assert value("kvhint_metrics_events_skipped_total") == 0


def test_no_label_carries_a_session_id(harness: Harness) -> None:
    registry, exporter = _exporter(harness)
    harness.engine.store([h(1)], session="secret-session-7", continuation="secret-session-7/turn-1")
    harness.apply(pin("secret-session-7", 30))
    exporter.poll()
    text = generate_latest(registry).decode()
    assert "kvhint_hints_total" in text
    assert "secret-session-7" not in text


def test_an_exporter_that_falls_behind_the_replay_window_counts_what_it_skipped() -> None:
    harness = Harness(event_replay_window=8)
    try:
        registry, exporter = _exporter(harness)
        for i in range(20):
            harness.engine.store([h(100 + i)], session=f"s{i}")
        exporter.poll()
        published = registry.get_sample_value("kvhint_events_published_total", {"kind": "blocks_stored"})
        skipped = registry.get_sample_value("kvhint_metrics_events_skipped_total")
        assert published == 8
        assert skipped == 12
    finally:
        harness.close()


def test_watch_subscribers_counts_streams_still_taking_their_snapshot(harness: Harness) -> None:
    """kvhint_watch_subscribers is the open WatchEvents streams, the number the stream bound
    (KVHINT_MAX_WATCH_STREAMS) refuses at: a stream still taking its snapshot (a busy engine, a
    large index) is open and holds a place, so the gauge counts it."""
    registry = CollectorRegistry()
    hub = harness.server.servicer.hub
    assert hub is not None
    exporter = MetricsExporter(harness.core, KvHintMetrics(registry), subscribers=hub.lag)  # as KvHintServer wires it
    live = harness.stub.WatchEvents(pb.WatchEventsRequest(), timeout=10)
    harness.wait_subscribers(1)
    steps = gate_engine_steps(harness)
    steps.clear()  # the engine is in a long step: the snapshots wait for it
    time.sleep(0.05)
    snapshots = [harness.stub.WatchEvents(pb.WatchEventsRequest(start=pb.WatchEventsRequest.START_SNAPSHOT), timeout=10)
                 for _ in range(2)]
    deadline = time.monotonic() + 5
    while harness.core.pending_tasks() < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    try:
        exporter.poll()
        assert registry.get_sample_value("kvhint_watch_subscribers") == 3
    finally:
        steps.set()
        for call in (live, *snapshots):
            call.cancel()
