"""docs/CONFORMANCE.md's generated blocks are what the committed report renders to ([Note: generated results] in
:mod:`conformance.runner.results_doc`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance.runner.document import load_report
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
