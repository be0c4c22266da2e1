"""kvhint.v1 conformance suite: a black-box runner any engine serving kvhint.v1 can be checked with.

    kvhint-conformance --target HOST:PORT --openai-url URL

See conformance/README.md. Cases live in conformance/cases/ (one module per area), the checked-in
list of case ids in conformance/golden_case_ids.txt.
"""

from .model import RELEASE, SUITE, Case, CaseFailed, CaseResult, CaseSkipped, Registry, Status

__all__ = ["RELEASE", "SUITE", "Case", "CaseFailed", "CaseResult", "CaseSkipped", "Registry", "Status"]
