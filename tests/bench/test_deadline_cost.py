"""bench.deadline_cost: its two structures agree, and its committed table comes from its raw data."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.deadline_cost import OUT, HashedWheel, markdown
from kvhint_server.deadlines import DeadlineQueue


@settings(max_examples=100, deadline=None)
@given(
    deadlines=st.lists(st.floats(0.0, 400.0), min_size=1, max_size=40),
    steps=st.lists(st.floats(0.0, 120.0), min_size=1, max_size=20),
)
def test_the_rejected_wheel_and_the_queue_expire_the_same_keys(deadlines, steps):
    """The benchmark compares equivalent structures: at every advance both hand back the same
    due keys (the wheel in tick order, the queue earliest first)."""
    queue: DeadlineQueue[int] = DeadlineQueue()
    wheel: HashedWheel[int] = HashedWheel()
    for key, d in enumerate(deadlines):
        queue.schedule(key, d)
        wheel.schedule(key, d)
    now = 0.0
    for dt in steps:
        now += dt
        assert sorted(queue.advance(now)) == sorted(wheel.advance(now))


def test_committed_table_comes_from_its_raw_results():
    raw = json.loads(Path(OUT + ".json").read_text())
    text = Path(OUT + ".md").read_text()
    assert "\n".join(markdown(raw["rows"])) in text
    assert f"Command: `{raw['command']}`" in text
