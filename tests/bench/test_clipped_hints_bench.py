"""bench.clipped_hints keeps working and its table says what the trim does: with it, a hybrid
layout's clipped Pin grants exactly what the resume hits; without it (the code before), the
one-turn session is granted 15 blocks and hits nothing. The dense layout is the same both ways."""

from __future__ import annotations

import json
from pathlib import Path

from bench import clipped_hints


def test_the_table_shows_the_trim_grants_what_a_resume_hits(tmp_path: Path) -> None:
    out = tmp_path / "clipped_hints.md"
    argv = ["--scenarios", "one turn", "pin budget", "--layouts", "dense", "hybrid", "--out", str(out)]
    assert clipped_hints.main(argv) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert "WINDOW_TAIL_MISSING 15->0" in out.read_text()
    by = {(r["scenario"], r["layout"], r["session"], r["mode"]): r for r in rows}
    for (scenario, layout, session, mode), r in by.items():
        twin = by[(scenario, layout, session, "with the trim" if mode == "without the trim" else "without the trim")]
        if layout == "dense":
            assert (r["granted"], r["hit"], r["clips"]) == (twin["granted"], twin["hit"], twin["clips"])
        elif mode == "with the trim" and r["granted"]:
            assert r["hit"] == r["granted"] * clipped_hints.BLOCK or session == "B"  # B: its 63-token hit cap
    assert (by[("one turn", "hybrid", "A", "without the trim")]["granted"], by[("one turn", "hybrid", "A", "without the trim")]["hit"]) == (15, 0)
    assert by[("pin budget", "hybrid", "B", "with the trim")]["outcome"] == "ACCEPTED"
    assert by[("pin budget", "hybrid", "B", "without the trim")]["granted"] == 0
