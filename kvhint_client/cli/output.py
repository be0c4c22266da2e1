"""Plain-text tables and short renderings for the CLI's human output."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Optional

from google.protobuf import duration_pb2, timestamp_pb2

from kvhint.v1 import kvhint_pb2

from ..durations import duration_to_seconds
from ..names import enum_name, reason_name, tier_name


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Left-aligned columns separated by two spaces; empty cells print as "-"."""
    cells = [[str(h) for h in headers]] + [[("-" if c is None or c == "" else str(c)) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in cells]
    return "\n".join(lines)


def short_hash(raw: bytes, width: int = 16) -> str:
    text = raw.hex()
    return text if len(text) <= width else text[:width] + "…"


def hashes_text(hashes: Sequence[bytes], limit: int = 3) -> str:
    shown = ",".join(short_hash(h) for h in hashes[:limit])
    return shown + (f",+{len(hashes) - limit}" if len(hashes) > limit else "")


def seconds_text(duration: duration_pb2.Duration) -> str:
    return f"{duration_to_seconds(duration):g}s"


def time_text(ts: timestamp_pb2.Timestamp) -> str:
    if not ts.seconds and not ts.nanos:
        return ""
    return ts.ToDatetime().strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"


def counts_text(counts: Iterable[kvhint_pb2.TierBlockCount]) -> str:
    return " ".join(f"{tier_name(c.tier)}={c.blocks}" for c in counts)


def retention_text(state: Optional[kvhint_pb2.RetentionState]) -> str:
    if state is None or state.retention_class in (0, kvhint_pb2.RetentionState.CLASS_ORDINARY):
        return ""
    name = enum_name(kvhint_pb2.RetentionState.Class, "CLASS_", state.retention_class).lower()
    if state.retention_class == kvhint_pb2.RetentionState.CLASS_RETAINED:
        name += f"(p={state.priority})"
    expires = time_text(state.expires_at)
    return f"{name} until {expires}" if expires else name


def result_detail(result: kvhint_pb2.HintResult) -> str:
    parts = []
    if result.message:
        parts.append(result.message)
    for clip in result.clips:
        parts.append(clip.detail or reason_name(clip.reason))
    if result.HasField("effective_ttl"):
        parts.append(f"ttl {seconds_text(result.effective_ttl)}")
    if result.replayed:
        parts.append("replayed")
    return "; ".join(dict.fromkeys(parts))
