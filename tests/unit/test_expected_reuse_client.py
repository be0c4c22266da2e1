"""Client builders for expected_reuse_in: the value reaches the wire exactly, and what the proto
calls malformed (a negative duration) is refused before sending."""

from __future__ import annotations

import datetime as dt

import pytest

from kvhint_client import session


def test_retain_and_pin_carry_expected_reuse() -> None:
    hint = session("s").retain(ttl=60, priority=3, expected_reuse_in=2.5)
    assert (hint.retain.expected_reuse_in.seconds, hint.retain.expected_reuse_in.nanos) == (2, 500_000_000)
    pin = session("s").pin(ttl=60, expected_reuse_in=dt.timedelta(seconds=7))
    assert pin.pin.expected_reuse_in.seconds == 7
    zero = session("s").retain(ttl=60, expected_reuse_in=0)
    assert zero.retain.HasField("expected_reuse_in") and zero.retain.expected_reuse_in.ToNanoseconds() == 0


def test_unset_expected_reuse_stays_unset() -> None:
    assert not session("s").retain(ttl=60).retain.HasField("expected_reuse_in")
    assert not session("s").pin(ttl=60).pin.HasField("expected_reuse_in")


@pytest.mark.parametrize("bad", [-1, -0.001, float("nan"), "3"])
def test_invalid_expected_reuse_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="expected_reuse_in"):
        session("s").retain(ttl=60, expected_reuse_in=bad)  # type: ignore[arg-type]
