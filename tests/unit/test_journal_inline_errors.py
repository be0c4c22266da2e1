"""`ResidencyJournal.errors` (the kvhint_residency_bookkeeping_errors metric) counts a residency
booking that raises whether the bookkeeping runs inline (the CPU platform's default, and every
booking inside an exclusive section) or deferred: the same failure counts the same in both
modes. Inline the error still reaches the caller (as an inline hook's would)."""

from __future__ import annotations

import pytest

from kvhint_server.config import ServerConfig
from kvhint_server.core import KvHintCore


class BookingFailed(Exception):
    pass


def _boom() -> None:
    raise BookingFailed("index out of step")


@pytest.mark.parametrize("deferred", [False, True], ids=["inline", "deferred"])
def test_a_failing_booking_counts_once_in_either_mode(deferred: bool) -> None:
    core = KvHintCore(ServerConfig())
    journal = core.journal
    if deferred:
        journal.start(thread=False)
        core.record(_boom)  # journaled: the settler's (here: settle's) to log
        core.settle()
    else:
        with pytest.raises(BookingFailed):
            core.record(_boom)  # inline: the hook's caller sees it
    assert journal.errors == 1
    journal.stop()


def test_a_booking_that_fails_inside_an_exclusive_section_is_counted() -> None:
    """A deferring journal books an exclusive section's own changes inline (KvHintCore.exclusive):
    one that fails is counted as the same booking deferred would be."""
    core = KvHintCore(ServerConfig())
    core.journal.start(thread=False)
    with core.exclusive(), pytest.raises(BookingFailed):
        core.record(_boom)
    assert core.journal.errors == 1
    core.journal.stop()
