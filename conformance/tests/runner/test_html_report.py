"""The HTML report: its structure checked in Python, then the page as headless Chromium shows it."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from conformance.contract.results import OUTCOMES, Result
from conformance.runner import html_check
from conformance.runner.document import RunFacts
from conformance.runner.html_report import finding_href, outcome_class, render_html

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

RESULTS = [
    Result("exec_order/train_eval[FULL_SHARD]", "reference", "process", 2, "pass", "", 1.25, placement="cpu"),
    Result("exec_order/train_eval[FULL_SHARD]", "torch-fsdp2", "process", 2, "n/a",
           "torch-fsdp2 lacks capability exec_order_validation", 0.0, placement="cpu"),
    Result("misc/device_id[]", "reference", "process", 1, "skip", "needs any GPU, found 0", 0.0),
    Result("misc/device_id[]", "torch-fsdp2", "process", 1, "skip", "needs any GPU, found 0", 0.0),
    Result("misc/cpu_offload[]", "reference", "process", 2, "error", "adapter failed: <script>alert(1)</script>", 0.1),
    Result("misc/cpu_offload[]", "torch-fsdp2", "process", 2, "FAIL",
           "known finding, see docs/findings/x.md: rank 0 raised RuntimeError: y", 2.5, placement="cpu",
           finding="docs/findings/x.md"),
]
SETTINGS = {"impls": {"value": ["reference", "torch-fsdp2"], "source": "--impl"},
            "device": {"value": "auto", "source": "default"}}


def _facts(interrupted_by: str | None = None) -> RunFacts:
    return RunFacts(started_at="2026-01-01T00:00:00+00:00", ended_at="2026-01-01T00:01:00+00:00",
                    settings=SETTINGS, machine={"hostname": "box", "platform": "Linux", "cpus": 2, "usable_cpus": 2,
                                                "gpus_visible": 0}, interrupted_by=interrupted_by,
                    torch="2.13.0", python="3.11.7", selected_rows=len(RESULTS), tool_version="0.1.0")


class _Page(HTMLParser):
    """Every start tag with its attributes, and the text inside each element with an id."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.text: dict[str, str] = {}
        self._open: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = {k: v or "" for k, v in attrs}
        self.tags.append((tag, attributes))
        if "id" in attributes:
            self._open.append(attributes["id"])
            self.text.setdefault(attributes["id"], "")

    def handle_data(self, data: str) -> None:
        for name in self._open:
            self.text[name] += data

    def with_class(self, name: str) -> list[dict[str, str]]:
        return [a for _, a in self.tags if name in a.get("class", "").split()]


def _parse(text: str) -> _Page:
    page = _Page()
    page.feed(text)
    return page


def test_page_is_self_contained() -> None:
    text = render_html(RESULTS, _facts())
    page = _parse(text)
    assert text.startswith("<!DOCTYPE html>") and text.count("<html") == 1
    assert not [a for t, a in page.tags if "src" in a or (t == "link")], "a resource outside the file"
    assert {a["href"] for t, a in page.tags if t == "a"} == {"docs/findings/x.md"}  # finding links only
    assert "<script>alert(1)</script>" not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text


def test_run_facts_come_first() -> None:
    text = render_html(RESULTS, _facts())
    page = _parse(text)
    facts = page.text["facts"]
    for expected in ("2.13.0", "3.11.7", "box: Linux", "2 usable of 2", "2026-01-01T00:00:00+00:00",
                     "settings", "impls", "reference, torch-fsdp2 (from --impl)", "auto (from default)"):
        assert expected in facts
    assert "Complete" in page.text["status"]
    assert text.index('id="facts"') < text.index('id="summary"') < text.index('id="matrix"')
    interrupted = _parse(render_html(RESULTS[:2], _facts("SIGTERM")))
    assert "Interrupted by SIGTERM after 2 rows" in interrupted.text["status"]
    assert interrupted.with_class("interrupted")


def test_matrix_has_a_coloured_cell_per_row_with_reason_and_finding() -> None:
    page = _parse(render_html(RESULTS, _facts()))
    cells = page.with_class("cell")
    assert [(c["data-outcome"], c["data-impl"], c["data-mode"]) for c in cells] == sorted(
        [(r.outcome, r.impl, r.rank_mode) for r in RESULTS],
        key=lambda key: [(r.outcome, r.impl, r.rank_mode) for r in sorted(RESULTS, key=lambda r: r.case)].index(key))
    assert all(outcome_class(c["data-outcome"]) in c["class"].split() for c in cells)
    assert {c["title"] for c in cells} == {r.reason for r in RESULTS}
    matrix = page.text["matrix"]
    assert "known finding: docs/findings/x.md" in matrix and "needs any GPU, found 0" in matrix


def test_summary_per_area_and_filters_per_outcome_and_implementation() -> None:
    page = _parse(render_html(RESULTS, _facts()))
    summary = page.text["summary"]
    assert re.search(r"exec_order\s*1 pass\s*1 n/a", summary), summary
    assert re.search(r"misc\s*1 error, 1 skip\s*1 FAIL, 1 skip", summary), summary
    assert "6 rows: 1 pass, 1 FAIL, 1 error, 1 n/a, 2 skip" in page.text["overall"]
    boxes = [a for t, a in page.tags if t == "input"]
    assert [b["data-outcome"] for b in boxes if "data-outcome" in b] == list(OUTCOMES)
    assert [b["data-impl"] for b in boxes if "data-impl" in b] == ["reference", "torch-fsdp2"]
    assert all("checked" in b for b in boxes)


# -- in a real browser ------------------------------------------------------------------------------------

BROWSER = html_check.find_browser()
needs_browser = pytest.mark.skipif(
    BROWSER is None, reason=f"no headless browser ({', '.join(html_check.BROWSERS)}) on PATH: "
    "apt-get install chromium (.ci/run installs it)")


@needs_browser
def test_browser_renders_cells_summary_and_filters(tmp_path: Path) -> None:
    assert BROWSER is not None
    report, png = tmp_path / "r.html", tmp_path / "r.png"
    report.write_text(render_html(RESULTS, _facts()))
    assert html_check.problems(BROWSER, report, cells=len(RESULTS), fail_cells=1) == []
    state = html_check.page_state(BROWSER, report, "outcome=skip,n/a&impl=torch-fsdp2")
    assert state["visible-cells"] == 2  # torch-fsdp2's n/a and skip
    html_check.screenshot(BROWSER, report, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@needs_browser
@pytest.mark.parametrize("broken", ["no_script", "no_colours"])
def test_browser_check_catches_a_broken_page(tmp_path: Path, broken: str) -> None:
    """Negative control: a page whose script does not run, or whose cells have no colour, is reported."""
    assert BROWSER is not None
    text = render_html(RESULTS, _facts())
    if broken == "no_script":
        text = re.sub(r"<script>.*</script>", "", text, flags=re.S)
    else:
        text = re.sub(r"\.o-[A-Za-z]+\{background:[^}]*\}", "", text)
    report = tmp_path / "r.html"
    report.write_text(text)
    found = html_check.problems(BROWSER, report, cells=len(RESULTS), fail_cells=1)
    expected = "script did not run" if broken == "no_script" else "6 matrix cells are coloured"
    assert any(expected in problem for problem in found), found


def test_finding_links_are_relative_to_the_page(tmp_path: Path) -> None:
    doc = "docs/findings/fsdp1-cpu-offload-pinning.md"  # a built-in finding's write-up, in this checkout
    page_dir = tmp_path / "reports"
    page_dir.mkdir()
    href = finding_href(doc, page_dir)
    assert (page_dir / href).resolve() == (Path(__file__).resolve().parents[3] / doc)
    assert finding_href("https://example.org/x", page_dir) == "https://example.org/x"
    assert finding_href("docs/findings/not-there.md", page_dir) == "docs/findings/not-there.md"
    assert finding_href(doc, None) == doc
