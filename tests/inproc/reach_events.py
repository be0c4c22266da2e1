"""What the retention order's random tests reach (opt-in, for measuring).

    KVHINT_HYPOTHESIS_REACH=1 python3 -m pytest -p no:cacheprovider tests/inproc --hypothesis-show-statistics

With the variable set, tests/inproc/conftest.py adds `reach_events`, an autouse fixture that wraps
KvHint's methods to note, per Hypothesis example, as a Hypothesis event: a block was protected
(filed as retained or pinned), retained blocks were reclaimed, a pin was broken, a grant expired.
The statistics then give the share of each test's examples that got there: a random test whose
examples rarely protect a block checks the retention order's invariants on few of them.
test_hypothesis_reach.py holds the main random tests to floors of those shares.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from hypothesis import event
from hypothesis.errors import InvalidArgument

from engine_integration.protected import ProtectedFreeBlocks
from kvhint_server.core import KvHintCore

# What the current example reached (test_hypothesis_reach clears it before each example).
REACHED: set[str] = set()


def _note(label: str) -> None:
    REACHED.add(label)
    try:
        event(label)
    except InvalidArgument:  # outside a Hypothesis test: nothing to count
        pass


def counting(monkeypatch: pytest.MonkeyPatch, note: Callable[[str], None] = _note) -> None:
    """Wrap the methods whose calls mean the retention order did something (undone by
    `monkeypatch` at the test's end)."""
    take_victims, add, expire = ProtectedFreeBlocks.take_victims, ProtectedFreeBlocks.add, KvHintCore.expire_retention

    def counted_take_victims(self, n):  # type: ignore[no-untyped-def]
        retained, pinned = take_victims(self, n)
        if retained:
            note("reclaimed retained blocks")
        if pinned:
            note("broke a pin")
        return retained, pinned

    def counted_add(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        note("protected a block")
        return add(self, *args, **kwargs)

    def counted_expire(self):  # type: ignore[no-untyped-def]
        grants = len(self.ledger.grants)
        expire(self)
        if len(self.ledger.grants) < grants:
            note("a grant expired")

    monkeypatch.setattr(ProtectedFreeBlocks, "take_victims", counted_take_victims)
    monkeypatch.setattr(ProtectedFreeBlocks, "add", counted_add)
    monkeypatch.setattr(KvHintCore, "expire_retention", counted_expire)


@pytest.fixture(autouse=True)
def reach_events(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    counting(monkeypatch)
    yield
