"""Time values the client accepts (seconds as int/float, or timedelta) and their protobuf forms.

Contract: conversions are exact to the nanosecond for every value a float prints exactly
(`0.1` becomes 100 ms, not 99.999999 ms), and invalid values raise ValueError naming the field,
among them values past google.protobuf.Duration's range (+-315,576,000,000 s, about 10,000 years),
which a server refuses as a malformed Duration.
"""

from __future__ import annotations

import datetime as _dt
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation
from typing import Union

from google.protobuf import duration_pb2

#: Seconds (int or float), a timedelta, or an already built Duration.
Seconds = Union[int, float, _dt.timedelta, duration_pb2.Duration]

_NANOS = 1_000_000_000
#: google.protobuf.Duration's range: seconds within +-315,576,000,000 (about 10,000 years).
MAX_DURATION_SECONDS = 315_576_000_000
_ONE_NANO = Decimal("1e-9")


def to_decimal_seconds(value: Seconds, *, name: str = "duration") -> Decimal:
    """`value` in seconds as an exact Decimal (nanosecond resolution)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number of seconds or a timedelta, got {value!r}")
    if isinstance(value, duration_pb2.Duration):
        return Decimal(value.seconds) + Decimal(value.nanos) * _ONE_NANO
    if isinstance(value, _dt.timedelta):
        micros = (value.days * 86_400 + value.seconds) * 1_000_000 + value.microseconds
        return Decimal(micros) / Decimal(1_000_000)
    if isinstance(value, int):
        return Decimal(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"{name} must be finite, got {value!r}")
        # float's repr() is the shortest decimal that reads back as the same float (float(), for
        # subclasses such as numpy.float64, whose own repr reads "np.float64(0.1)").
        try:
            return Decimal(repr(float(value))).quantize(_ONE_NANO, rounding=ROUND_HALF_EVEN)
        except InvalidOperation:  # more digits than Decimal's context holds: far out of any range
            raise ValueError(f"{name} {value!r} is out of range") from None
    raise ValueError(f"{name} must be a number of seconds or a timedelta, got {value!r}")


def duration_from_decimal(seconds: Decimal) -> duration_pb2.Duration:
    """A Duration for an exact number of seconds (rounded to the nanosecond)."""
    total_nanos = int((seconds / _ONE_NANO).to_integral_value(rounding=ROUND_HALF_EVEN))
    secs, nanos = divmod(abs(total_nanos), _NANOS)
    sign = -1 if total_nanos < 0 else 1
    return duration_pb2.Duration(seconds=sign * secs, nanos=sign * nanos)


def check_duration_range(seconds: Decimal, name: str, value: object) -> None:
    """ValueError naming `name` when `seconds` (given as `value`) is past google.protobuf.Duration's
    range (a server refuses such a Duration as malformed)."""
    if abs(seconds) >= MAX_DURATION_SECONDS + 1:
        raise ValueError(f"{name} must be at most {MAX_DURATION_SECONDS} seconds (google.protobuf.Duration's range), "
                         f"got {value!r}")


def to_duration(value: Seconds, *, name: str = "duration", positive: bool = True) -> duration_pb2.Duration:
    """Convert `value` to a Duration; with `positive`, reject values <= 0."""
    seconds = to_decimal_seconds(value, name=name)
    if positive and seconds <= 0:
        raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
    check_duration_range(seconds, name, value)
    return duration_from_decimal(seconds)


def duration_to_decimal(duration: duration_pb2.Duration) -> Decimal:
    """Exact seconds of a Duration."""
    return Decimal(duration.seconds) + Decimal(duration.nanos) * _ONE_NANO


def duration_to_seconds(duration: duration_pb2.Duration) -> float:
    """Seconds of a Duration as a float (for display and arithmetic)."""
    return duration.seconds + duration.nanos / _NANOS


def to_float_seconds(value: Seconds, *, name: str = "duration") -> float:
    """`value` as float seconds."""
    return float(to_decimal_seconds(value, name=name))
