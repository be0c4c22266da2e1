"""bench.events_throughput's lag verdict (no engine): it compares delivery lag, so it can fail."""

from __future__ import annotations

import math

from bench.events_throughput import PARITY_TOLERANCE_MS, lag_summary, parity, percentile


def test_percentiles_are_nearest_rank() -> None:
    xs = [float(i) for i in range(1, 101)]
    assert lag_summary(xs) == (50.0, 99.0)
    assert percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))


def test_parity_needs_both_percentiles_within_tolerance_and_no_loss() -> None:
    zmq = (2.0, 5.0)
    assert parity((2.0 + PARITY_TOLERANCE_MS, 5.0), zmq, lost=0)
    assert not parity((2.0, 5.0 + 2 * PARITY_TOLERANCE_MS), zmq, lost=0)  # slower tail
    assert not parity((2.0 + 2 * PARITY_TOLERANCE_MS, 5.0), zmq, lost=0)  # slower median
    assert not parity((1.0, 4.0), zmq, lost=1)  # faster but lossy
    assert not parity((math.nan, math.nan), zmq, lost=0)  # nothing received
