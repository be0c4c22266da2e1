"""Cases as data: the Case record, the registry, statuses and results.

A case is `Case(id, statement, requires, since, run)`:

* `id` is `suite/area/kebab-name`, for example `kvhint.v1/retention/pinned-session-survives-pressure`.
* `statement` is the MUST-worded requirement the case checks, quoted in reports.
* `requires` names the capabilities the target must advertise (GetCapabilities) for the case
  to apply; see `conformance.target.Target.capabilities` for the vocabulary. A case whose
  capability is not advertised is SKIPPED, and the report says which capability was missing,
  unless the claimed profile (`conformance.profiles`, `--profile`) requires that capability:
  then the case FAILS.
* `needs` names target requirements the suite cannot negotiate (an OpenAI endpoint, a pool
  small enough to put under pressure). They are checked by the `requirements/*` cases; a
  case whose need is unmet is SKIPPED with the requirement's reason, and the requirement
  case itself FAILS, so the run does not pass silently.
* `since` is the suite release that introduced the case.
* `run(ctx)` raises `CaseFailed` (or any exception) to fail, `CaseSkipped` to skip at run time
  (for example: nothing unadvertised to check), and returns normally to pass.

The golden list (`golden_case_ids.txt`) pins the set of ids; `tests/conformance` fails when a
case is added or removed without updating it (`kvhint-conformance --list > ...`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .target import CaseContext

SUITE = "kvhint.v1"
RELEASE = "v1.0"
_ID = re.compile(r"^[a-z0-9.]+/[a-z0-9-]+/[a-z0-9]+(?:-[a-z0-9]+)*$")
_MUST = re.compile(r"\bMUST( NOT)?\b")


class CaseFailed(AssertionError):
    """A conformance violation. The message is the one-line reason shown on the FAILED: line."""


class CaseSkipped(Exception):
    """Raised by a case at run time when it does not apply to the target."""


class Status(str, enum.Enum):
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"
    # Listed in --known-failing and failed as expected: does not fail the run.
    KNOWN_FAILING = "known-failing"
    # Listed in --known-failing but passed: the list is stale, which fails the run.
    STALE = "stale"


@dataclass(frozen=True)
class Case:
    id: str
    statement: str
    run: Callable[["CaseContext"], None]
    requires: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    since: str = RELEASE

    @property
    def area(self) -> str:
        return self.id.split("/")[1]

    @property
    def name(self) -> str:
        return self.id.split("/")[2]


@dataclass
class CaseResult:
    case: Case
    status: Status
    reason: str = ""
    duration_s: float = 0.0
    # Longer diagnostics (traceback, observed values) for the junit report.
    details: str = ""

    @property
    def failed(self) -> bool:
        return self.status in (Status.FAILED, Status.STALE)


@dataclass
class Registry:
    cases: list[Case] = field(default_factory=list)

    def add(self, case: Case) -> Case:
        if not _ID.match(case.id) or not case.id.startswith(SUITE + "/"):
            raise ValueError(f"case id {case.id!r} is not {SUITE}/area/kebab-name")
        if not _MUST.search(case.statement):
            raise ValueError(f"case {case.id}: the statement must be MUST-worded: {case.statement!r}")
        if any(c.id == case.id for c in self.cases):
            raise ValueError(f"duplicate case id {case.id}")
        self.cases.append(case)
        return case

    def case(
        self, area: str, name: str, statement: str, *, requires: Iterable[str] = (), needs: Iterable[str] = (), since: str = RELEASE
    ) -> Callable[[Callable[["CaseContext"], None]], Callable[["CaseContext"], None]]:
        """Decorator: register `fn` as the case `SUITE/area/name`."""

        def register(fn: Callable[["CaseContext"], None]) -> Callable[["CaseContext"], None]:
            self.add(Case(f"{SUITE}/{area}/{name}", " ".join(statement.split()), fn, tuple(requires), tuple(needs), since))
            return fn

        return register

    def ids(self) -> list[str]:
        return [c.id for c in self.cases]

    def by_id(self) -> dict[str, Case]:
        return {c.id: c for c in self.cases}


def check(condition: Any, message: str) -> None:
    """Fail the case with `message` unless `condition` holds."""
    if not condition:
        raise CaseFailed(message)
