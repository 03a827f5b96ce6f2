"""docs/CONFORMANCE.md's generated blocks are what the committed report renders to ([Note: generated results] in
:mod:`conformance.runner.results_doc`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance.runner.document import load_report
from conformance.runner.findings import BUILTIN_FILE, Finding, load_file
from conformance.runner.results_doc import BLOCKS, main, publish, render_blocks, replace_blocks

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

ROOT = Path(__file__).resolve().parents[3]
PAGE, REPORT = ROOT / "docs" / "CONFORMANCE.md", ROOT / "docs" / "results" / "cpu.json"


def test_the_results_page_is_its_report_rendered() -> None:
    page, changed = replace_blocks(PAGE.read_text(), render_blocks(load_report(REPORT)))
    assert not changed, (f"docs/CONFORMANCE.md's blocks {changed} differ from {REPORT.name}: run "
                         "python -m conformance.runner.results_doc docs/results/cpu.json docs/CONFORMANCE.md")
    assert page == PAGE.read_text()
    assert "hostname" not in json.loads(REPORT.read_text())["machine"]


def test_blocks_are_replaced_and_bad_markers_named() -> None:
    page = "intro\n<!-- generated: facts -->\nold\n<!-- end generated: facts -->\nprose\n"
    new, changed = replace_blocks(page, {"facts": "new\n"})
    assert (new, changed) == ("intro\n<!-- generated: facts -->\nnew\n<!-- end generated: facts -->\nprose\n",
                              ["facts"])
    assert replace_blocks(new, {"facts": "new\n"}) == (new, [])
    with pytest.raises(ValueError, match=r"missing \['summary'\], unknown \[\]"):
        replace_blocks(page, {"facts": "x\n", "summary": "y\n"})
    with pytest.raises(ValueError, match=r"missing \[\], unknown \['facts'\]"):
        replace_blocks(page, {})


def test_check_names_a_stale_block_and_publish_drops_the_host_name(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    report = json.loads(REPORT.read_text())
    report["machine"]["hostname"] = "box-17"
    source, published, page = tmp_path / "run.json", tmp_path / "cpu.json", tmp_path / "page.md"
    source.write_text(json.dumps(report))
    page.write_text("".join(f"<!-- generated: {name} -->\n<!-- end generated: {name} -->\n" for name in BLOCKS))
    assert main([str(source), str(page), "--check"]) == 1
    assert f"{page}: block 'facts' differs from {source}" in capsys.readouterr().err
    assert main([str(source), str(page), "--publish", str(published)]) == 0
    assert "hostname" not in json.loads(published.read_text())["machine"]
    assert main([str(published), str(page), "--check"]) == 0
    publish(source, published)
    assert json.loads(published.read_text())["rows"] == report["rows"]


def test_a_finding_registered_later_appears_in_the_index(tmp_path: Path) -> None:
    doc = tmp_path / "docs" / "findings" / "new-finding.md"
    doc.parent.mkdir(parents=True)
    doc.write_text("# torch FSDP9 forgets the step\n\nThe write-up.\n")
    new = Finding(impl="torch-fsdp2", rows="training/*", doc="docs/findings/new-finding.md")
    blocks = render_blocks(load_report(REPORT), [*load_file(BUILTIN_FILE), new], root=tmp_path)
    assert ("- [torch FSDP9 forgets the step](findings/new-finding.md): FAIL; torch-fsdp2; cells of this run: none; "
            "registered for `training/*`") in blocks["findings"]
    _, changed = replace_blocks(PAGE.read_text(), blocks)
    assert changed == ["findings"]  # the committed page is stale until it is regenerated


def test_the_index_counts_the_cells_each_finding_explains() -> None:
    report = load_report(REPORT)
    index = render_blocks(report)["findings"]
    for doc in dict.fromkeys(f.doc for f in load_file(BUILTIN_FILE)):
        cells = sum(row.finding == doc for row in report.rows)
        item = next(line for line in index.splitlines() if f"]({doc.removeprefix('docs/')})" in line)
        assert (f"cells of this run: {cells} " if cells else "cells of this run: none") in item, item
    unexplained = sum(row.outcome == "FAIL" and not row.finding for row in report.rows)
    assert f"FAIL and error cells no finding explains: {unexplained} (" in index


def test_a_hand_edited_findings_block_fails_the_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "page.md"
    page.write_text(PAGE.read_text().replace("cells of this run: ", "cells of this run (by hand): ", 1))
    assert main([str(REPORT), str(page), "--check"]) == 1
    assert f"{page}: block 'findings' differs from {REPORT}" in capsys.readouterr().err
