"""The conformance suite without an engine: the golden case list, the case data and the reports."""

from __future__ import annotations

import io
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conformance import hints as H
from conformance.cases import REGISTRY
from conformance.cases.requirements import CASE_OF_NEED
from conformance.model import Case, CaseResult, Registry, Status
from conformance.report import RunInfo, junit_xml, summary
from conformance.runner import apply_known_failing, main, read_known_failing, select

GOLDEN = Path(__file__).resolve().parents[2] / "conformance" / "golden_case_ids.txt"
CAPABILITY = re.compile(
    r"^(?:(?:%s)(?::(?:%s|range))?|selector:(?:%s)|tier:(?:device|host|disk|remote)|share-destination)$"
    % ("|".join(H.ACTIONS), "|".join(H.SELECTORS), "|".join(H.SELECTORS))
)


def golden_ids() -> list[str]:
    return [line.strip() for line in GOLDEN.read_text().splitlines() if line.strip() and not line.startswith("#")]


def test_golden_list_matches_the_registered_cases() -> None:
    golden, registered = golden_ids(), REGISTRY.ids()
    assert len(golden) == len(set(golden)), "duplicate ids in golden_case_ids.txt"
    added = sorted(set(registered) - set(golden))
    removed = sorted(set(golden) - set(registered))
    assert not added and not removed, (
        f"cases added {added} / removed {removed} without updating conformance/golden_case_ids.txt; "
        "regenerate it with `kvhint-conformance --list > conformance/golden_case_ids.txt` and review the diff"
    )


def test_every_case_is_well_formed_data() -> None:
    for case in REGISTRY.cases:
        assert re.match(r"^kvhint\.v1/[a-z0-9-]+/[a-z0-9]+(-[a-z0-9]+)*$", case.id), case.id
        assert re.search(r"\bMUST\b", case.statement), case.id
        assert case.since == "v1.0", case.id
        for capability in case.requires:
            assert CAPABILITY.match(capability), f"{case.id}: unknown capability {capability!r}"
        assert set(case.needs) <= {"traffic", "cached-tokens", "pressure"}, case.id


def test_the_issue_coverage_areas_are_present() -> None:
    areas = {c.area for c in REGISTRY.cases}
    assert {"capabilities", "outcomes", "clipping", "idempotency", "bad-input", "retention", "release", "evict", "events", "unhinted"} <= areas
    ids = set(REGISTRY.ids())
    for action in ("retain", "pin", "release", "evict"):
        for kind in H.SELECTORS:
            assert f"kvhint.v1/outcomes/{action}-{kind}-accepted" in ids and f"kvhint.v1/outcomes/{action}-{kind}-missing" in ids
    for action in H.ACTIONS:
        assert f"kvhint.v1/capabilities/{action}-unadvertised-selectors-unsupported" in ids


def test_registry_rejects_malformed_cases() -> None:
    reg = Registry()
    noop = lambda ctx: None  # noqa: E731
    with pytest.raises(ValueError, match="MUST-worded"):
        reg.add(Case("kvhint.v1/x/should-fail", "The engine should do it.", noop))
    with pytest.raises(ValueError, match="area/kebab-name"):
        reg.add(Case("kvhint.v1/Bad_Name", "It MUST work.", noop))
    reg.add(Case("kvhint.v1/x/ok", "It MUST work.", noop))
    with pytest.raises(ValueError, match="duplicate"):
        reg.add(Case("kvhint.v1/x/ok", "It MUST work.", noop))


def test_list_and_filters() -> None:
    out = io.StringIO()
    assert main(["--list"], out=out) == 0
    assert out.getvalue().split() == REGISTRY.ids()
    chosen = select(REGISTRY, [r"/events/"], [r"resync"])
    picked = [c for c in chosen if "/requirements/" not in c.id]
    assert picked and all("/events/" in c.id and "resync" not in c.id for c in picked)
    # The requirement case of every need of a selected case runs with it (even under --skip).
    needs = {n for c in picked for n in c.needs}
    assert needs, "some /events/ case needs traffic"
    assert {c.id for c in chosen if "/requirements/" in c.id} == {
        f"kvhint.v1/requirements/{CASE_OF_NEED[n]}" for n in needs}
    assert select(REGISTRY, [r"/events/"], [r"resync", r"requirements/"]) == chosen


def test_a_filtered_run_without_an_openai_endpoint_is_not_a_pass(tmp_path: Path) -> None:
    """`--run retention/` without --openai-url skips every case (each needs traffic or pressure):
    the requirement cases run with them and fail, so the run fails instead of passing having
    checked nothing. Usage errors (a bad pattern, a missing known-failing file) exit 2."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    from kvhint_unit_support import Harness, local_engine_info

    harness = Harness(local_engine_info(num_device_blocks=64))
    try:
        out = io.StringIO()
        rc = main(["--target", f"127.0.0.1:{harness.port}", "--run", "retention/"], out=out)
        text = out.getvalue()
        assert rc == 1, text
        assert "FAILED: kvhint.v1/requirements/" in text and "no --openai-url given" in text, text
        assert text.splitlines()[-1].startswith("FAIL: 0 passed"), text
    finally:
        harness.close()
    assert main(["--target", "h:1", "--run", "("], out=io.StringIO()) == 2
    assert main(["--list", "--skip", "[z-a]"], out=io.StringIO()) == 2
    assert main(["--target", "h:1", "--known-failing", str(tmp_path / "absent.txt")], out=io.StringIO()) == 2


def _results() -> list[CaseResult]:
    noop = lambda ctx: None  # noqa: E731
    cases = [Case(f"kvhint.v1/area/case-{i}", "It MUST hold.", noop) for i in range(5)]
    return [
        CaseResult(cases[0], Status.PASSED, duration_s=0.1),
        CaseResult(cases[1], Status.FAILED, "pinned session hit 0 of 704 tokens\nsecond line", details="Traceback ..."),
        CaseResult(cases[2], Status.SKIPPED, "not advertised by the target: demote:session"),
        apply_known_failing(CaseResult(cases[3], Status.FAILED, "known bug"), ["kvhint.v1/area/case-3"]),
        apply_known_failing(CaseResult(cases[4], Status.PASSED), ["kvhint.v1/area/case-*"]),
    ]


def test_summary_names_each_failure_with_a_one_line_reason() -> None:
    results = _results()
    assert [r.status for r in results][3:] == [Status.KNOWN_FAILING, Status.STALE]
    text = summary(results, RunInfo("h:1", "http://h:2", "vllm 0.32.0", "e1", "plan", 1.5, "n"))
    assert "FAILED: kvhint.v1/area/case-1: pinned session hit 0 of 704 tokens second line" in text
    assert "FAILED: kvhint.v1/area/case-4: listed in --known-failing but passed" in text
    assert "SKIPPED: kvhint.v1/area/case-2: not advertised by the target: demote:session" in text
    assert "KNOWN FAILING: kvhint.v1/area/case-3: known bug" in text
    assert text.splitlines()[-1].startswith("FAIL: 1 passed, 2 failed (1 stale known-failing), 1 skipped, 1 known failing of 5 cases")


def test_junit_xml_reports_failures_skips_and_statements() -> None:
    root = ET.fromstring(junit_xml(_results(), RunInfo("h:1", "", "", "", "", 1.0, "n")))
    suite = root.find("testsuite")
    assert suite is not None and suite.get("tests") == "5" and suite.get("failures") == "2" and suite.get("skipped") == "2"
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert cases["case-1"].get("classname") == "kvhint.v1.area"
    failure = cases["case-1"].find("failure")
    assert failure is not None and failure.get("message") == "pinned session hit 0 of 704 tokens second line"
    assert "It MUST hold." in (failure.text or "")
    assert cases["case-2"].find("skipped") is not None
    assert cases["case-4"].find("failure") is not None  # stale
    assert cases["case-0"].find("failure") is None and cases["case-0"].find("skipped") is None


def test_known_failing_entries_must_match_a_case(tmp_path: Path) -> None:
    listed = tmp_path / "known.txt"
    listed.write_text("# comment\nkvhint.v1/outcomes/pin-session-missing\nkvhint.v1/events/*  # glob\n")
    assert read_known_failing(str(listed), REGISTRY) == ["kvhint.v1/outcomes/pin-session-missing", "kvhint.v1/events/*"]
    listed.write_text("kvhint.v1/nope/not-a-case\n")
    with pytest.raises(SystemExit, match="match no case"):
        read_known_failing(str(listed), REGISTRY)


def test_unreachable_target_fails_every_selected_case(tmp_path: Path) -> None:
    """No case runs (exit 3, one line on stderr: tests/conformance/test_conformance_unreachable.py),
    and the JUnit report still lists every selected case as failed, with the reason."""
    out = io.StringIO()
    xml = tmp_path / "report.xml"
    rc = main(["--target", "127.0.0.1:1", "--rpc-timeout", "0.5", "--run", "capabilities/protocol-version|bad-input/empty",
               "--junit-xml", str(xml)], out=out)
    assert rc == 3 and out.getvalue() == ""
    suite = ET.parse(xml).getroot().find("testsuite")
    assert suite is not None and suite.get("failures") == "2"
    assert "not run: cannot reach the target 127.0.0.1:1" in ET.tostring(suite, encoding="unicode")
