"""The JUnit XML report of a run, written from its rows (``docs/REPORTS.md``: JUnit).

One ``<testcase>`` per row: ``name`` is the row id (what ``list``, the matrix
and the JSON show), ``classname`` is ``<implementation>.<rank mode>``. A FAIL
is a ``<failure>``, an ``error`` an ``<error>``; ``n/a`` and ``skip`` are both
``<skipped>`` (JUnit has no other word) told apart by ``type``:
``not-applicable`` (the implementation lacks what the case needs) and
``hardware`` (the machine lacks it). A FAIL a known finding explains has
``type="known-finding"`` and a ``finding`` property naming the write-up. An
interrupted run says so twice: suite properties ``interrupted``/``complete``
and one extra ``<testcase name="(run interrupted)">`` with an ``<error>``, so a
CI that only counts failures does not read a partial run as green; a run
missing rows for another reason (it ended before them, or a row ended with no
outcome) has ``complete`` false and a ``<testcase name="(run incomplete)">``.

Compared with a baseline (``--conformance-expect``; [Note: expected outcomes]
in :mod:`conformance.runner.expect`), every row carries an ``expectation``
property (``as expected`` or the kind of change); a FAIL or error the baseline
has is ``<skipped type="expected-failure">`` (the run does not fail on it), and
a cell that now passes is ``<failure type="now-passes">`` (the run fails until
the baseline is updated). The suite gains ``expect.*`` properties.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Sequence

from conformance.contract.results import Result
from conformance.runner.document import SCHEMA_VERSION, RunFacts, summary
from conformance.runner.expect import Comparison

__all__ = ["SKIP_TYPES", "render_junit"]

#: ``<skipped type=...>`` per outcome.
SKIP_TYPES = {"documented": "documented", "n/a": "not-applicable", "skip": "hardware"}


def _testcase(result: Result, comparison: Comparison | None) -> ET.Element:
    case = ET.Element("testcase", classname=f"{result.impl}.{result.rank_mode}", name=result.case,
                      time=f"{result.duration_s:.3f}")
    props = ET.SubElement(case, "properties")
    cell = (result.case, result.impl, result.rank_mode)
    change = comparison.change_of(cell) if comparison is not None else None
    expectation = "" if comparison is None else change.kind if change is not None else "as expected"
    for name, value in (("outcome", result.outcome), ("placement", result.placement or "-"),
                        ("world_size", str(result.world_size)), ("finding", result.finding),
                        ("expectation", expectation)):
        if value:
            ET.SubElement(props, "property", name=name, value=value)
    message = result.reason.strip().splitlines()[0] if result.reason.strip() else result.outcome
    if expectation == "as expected" and result.outcome in ("FAIL", "error"):
        ET.SubElement(case, "skipped", type="expected-failure",
                      message=f"expected {result.outcome} (as in the baseline): {message}")
    elif expectation == "now passes" and change is not None and change.expected is not None:
        text = f"now passes; the baseline has {change.expected.outcome}: {change.expected.reason}"
        ET.SubElement(case, "failure", type="now-passes", message=text).text = text
    elif result.outcome == "FAIL":
        kind = "known-finding" if result.finding else "nonconforming"
        ET.SubElement(case, "failure", type=kind, message=message).text = result.reason
    elif result.outcome == "error":
        ET.SubElement(case, "error", type="error", message=message).text = result.reason
    elif result.outcome in SKIP_TYPES:
        ET.SubElement(case, "skipped", type=SKIP_TYPES[result.outcome], message=f"{result.outcome}: {message}")
    return case


def _interruption(facts: RunFacts, reported: int) -> ET.Element:
    case = ET.Element("testcase", classname="fsdp-conformance", name="(run interrupted)", time="0.000")
    text = (f"the run was stopped by {facts.interrupted_by} after {reported} rows; rows not listed did not run, "
            "so this report is incomplete")
    ET.SubElement(case, "error", type="interrupted", message=text).text = text
    return case


def _unfinished(reason: str) -> ET.Element:
    case = ET.Element("testcase", classname="fsdp-conformance", name="(run incomplete)", time="0.000")
    text = f"this report is incomplete: {reason}"
    ET.SubElement(case, "error", type="incomplete", message=text).text = text
    return case


def _expect_props(comparison: Comparison | None) -> list[tuple[str, object]]:
    if comparison is None:
        return []
    counts = [(f"expect.{kind.replace(' ', '_')}", n) for kind, n in comparison.counts().items()]
    return [("expect.baseline", comparison.baseline), ("expect.changed", comparison.changed), *counts]


def render_junit(results: Sequence[Result], facts: RunFacts) -> str:
    """The JUnit XML document for ``results``."""
    counts = summary(results)
    interrupted = facts.interrupted_by is not None
    incomplete = facts.incomplete_reason(len(results))
    unfinished = incomplete is not None and not interrupted  # rows missing without a stop signal
    cases = [_testcase(r, facts.expectation) for r in results]
    if interrupted:
        cases.append(_interruption(facts, len(results)))
    elif unfinished:
        cases.append(_unfinished(str(incomplete)))
    tally = {tag: str(sum(1 for c in cases if c.find(tag) is not None)) for tag in ("failure", "error", "skipped")}
    suite = ET.Element("testsuite", name="fsdp-conformance", tests=str(len(cases)), failures=tally["failure"],
                       errors=tally["error"], skipped=tally["skipped"], time=f"{counts['case_time_s']:.3f}",
                       timestamp=facts.started_at, hostname=str(facts.machine.get("hostname", "")))
    props = ET.SubElement(suite, "properties")
    run_props: list[tuple[str, object]] = [
        ("schema_version", SCHEMA_VERSION), ("complete", incomplete is None), ("interrupted", interrupted),
        ("interrupted_by", facts.interrupted_by or ""), ("tool_version", facts.tool_version),
        ("torch", facts.torch), ("python", facts.python),
        ("started_at", facts.started_at), ("ended_at", facts.ended_at), *_expect_props(facts.expectation)]
    run_props += [(f"setting.{name}", f"{s['value']} (from {s['source']})") for name, s in facts.settings.items()]
    for name, value in run_props:
        text = str(value).lower() if isinstance(value, bool) else str(value)
        ET.SubElement(props, "property", name=name, value=text)
    suite.extend(cases)
    root = ET.Element("testsuites", name="fsdp-conformance", tests=suite.get("tests", "0"),
                      failures=suite.get("failures", "0"), errors=suite.get("errors", "0"),
                      skipped=suite.get("skipped", "0"))
    root.append(suite)
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
