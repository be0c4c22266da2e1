"""Reports: the human summary and JUnit XML."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from .model import RELEASE, SUITE, CaseResult, Status


@dataclass
class RunInfo:
    target: str
    openai_url: str
    engine: str
    epoch: str
    plan: str
    duration_s: float
    nonce: str
    profile: str = ""


def one_line(text: str, limit: int = 400) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def counts(results: Sequence[CaseResult]) -> Counter[Status]:
    return Counter(r.status for r in results)


def summary(results: Sequence[CaseResult], info: RunInfo) -> str:
    """The human summary: a header, one line per non-passing case, and the totals."""
    c = counts(results)
    lines = [
        f"kvhint-conformance {SUITE} {RELEASE}: target {info.target}, OpenAI endpoint {info.openai_url or '(none)'}",
        f"  engine: {info.engine or '?'}  epoch: {info.epoch or '?'}  run nonce: {info.nonce}"
        + (f"  profile: {info.profile}" if info.profile else ""),
    ]
    if info.plan:
        lines.append(f"  plan: {info.plan}")
    skipped = [r for r in results if r.status is Status.SKIPPED]
    if skipped:
        lines.append("")
        for r in skipped:
            lines.append(f"SKIPPED: {r.case.id}: {one_line(r.reason)}")
    known = [r for r in results if r.status is Status.KNOWN_FAILING]
    if known:
        lines.append("")
        for r in known:
            lines.append(f"KNOWN FAILING: {r.case.id}: {one_line(r.reason)}")
    bad = [r for r in results if r.failed]
    if bad:
        lines.append("")
        for r in bad:
            lines.append(f"FAILED: {r.case.id}: {one_line(r.reason)}")
    lines.append("")
    verdict = "FAIL" if bad else "PASS"
    lines.append(
        f"{verdict}: {c[Status.PASSED]} passed, {c[Status.FAILED] + c[Status.STALE]} failed"
        + (f" ({c[Status.STALE]} stale known-failing)" if c[Status.STALE] else "")
        + f", {c[Status.SKIPPED]} skipped"
        + (f", {c[Status.KNOWN_FAILING]} known failing" if c[Status.KNOWN_FAILING] else "")
        + f" of {len(results)} cases in {info.duration_s:.1f}s"
    )
    return "\n".join(lines)


def junit_xml(results: Sequence[CaseResult], info: RunInfo) -> bytes:
    c = counts(results)
    total_time = sum(r.duration_s for r in results)
    suites = ET.Element("testsuites", name="kvhint-conformance", tests=str(len(results)),
                        failures=str(c[Status.FAILED] + c[Status.STALE]), errors="0",
                        skipped=str(c[Status.SKIPPED] + c[Status.KNOWN_FAILING]), time=f"{total_time:.3f}")
    suite = ET.SubElement(suites, "testsuite", name=SUITE, tests=str(len(results)),
                          failures=str(c[Status.FAILED] + c[Status.STALE]), errors="0",
                          skipped=str(c[Status.SKIPPED] + c[Status.KNOWN_FAILING]), time=f"{total_time:.3f}")
    # The run's identity, so a CI artifact says what passed: the claimed profile (a core pass is not a
    # tiers pass), the target and the engine it reported.
    props = ET.SubElement(suite, "properties")
    for key, value in (("release", RELEASE), ("profile", info.profile), ("target", info.target),
                       ("openai_url", info.openai_url), ("engine", info.engine), ("epoch", info.epoch),
                       ("plan", info.plan), ("nonce", info.nonce)):
        ET.SubElement(props, "property", name=key, value=value or "")
    for r in results:
        suite_name, area, name = r.case.id.split("/")
        case = ET.SubElement(suite, "testcase", classname=f"{suite_name}.{area}", name=name, time=f"{r.duration_s:.3f}")
        case_props = ET.SubElement(case, "properties")
        ET.SubElement(case_props, "property", name="id", value=r.case.id)
        ET.SubElement(case_props, "property", name="statement", value=r.case.statement)
        ET.SubElement(case_props, "property", name="since", value=r.case.since)
        if r.case.requires:
            ET.SubElement(case_props, "property", name="requires", value=" ".join(r.case.requires))
        if r.status is Status.FAILED:
            node = ET.SubElement(case, "failure", message=one_line(r.reason), type="ConformanceFailure")
            node.text = f"{r.case.statement}\n\n{r.reason}\n\n{r.details}".strip()
        elif r.status is Status.STALE:
            node = ET.SubElement(case, "failure", message=one_line(r.reason), type="StaleKnownFailing")
            node.text = r.reason
        elif r.status is Status.SKIPPED:
            ET.SubElement(case, "skipped", message=one_line(r.reason))
        elif r.status is Status.KNOWN_FAILING:
            ET.SubElement(case, "skipped", message=one_line(f"known failing: {r.reason}"))
        if r.details and r.status is not Status.FAILED:
            out = ET.SubElement(case, "system-out")
            out.text = r.details
    ET.indent(suites)
    return ET.tostring(suites, encoding="utf-8", xml_declaration=True)
