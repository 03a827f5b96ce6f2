"""Open an HTML report in headless Chromium: render it, take a screenshot, check what the page shows.

``python -m conformance.runner.html_check REPORT.html [--screenshot PNG]`` (what ``.ci/run`` runs on
the main job's report) exits 0 when, in the browser, every matrix cell is laid out and coloured, the
per-area summary is shown, and the outcome filter given in the address hides the other cells; else it
prints what is wrong and exits 1. The page records what it shows on ``<body>``
(:mod:`conformance.runner.html_report`); Chromium's ``--dump-dom`` gives that DOM after the scripts ran.
Chromium comes from Debian's ``chromium`` package (``apt-get install chromium``).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["BROWSERS", "find_browser", "page_state", "problems", "screenshot"]

#: Executable names tried, in order.
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--virtual-time-budget=5000"]
_BODY = re.compile(r"<body([^>]*)>")


def find_browser() -> str | None:
    """The first of :data:`BROWSERS` on ``PATH``, or ``None``."""
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def _run(browser: str, args: list[str]) -> str:
    with tempfile.TemporaryDirectory(prefix="html-check-") as profile:
        proc = subprocess.run([browser, *_FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                              text=True, timeout=120, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{browser} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc.stdout


def page_state(browser: str, report: Path, fragment: str = "") -> dict[str, int]:
    """The counts the page recorded on ``<body>`` once rendered (``data-cells``, ``data-visible-cells``, ...)."""
    dom = _run(browser, ["--dump-dom", report.resolve().as_uri() + (f"#{fragment}" if fragment else "")])
    match = _BODY.search(dom)
    attrs = dict(re.findall(r'data-([a-z-]+)="(\d+)"', match.group(1))) if match else {}
    return {name: int(value) for name, value in attrs.items()}


def screenshot(browser: str, report: Path, png: Path, size: tuple[int, int] = (1400, 1200)) -> None:
    """Render ``report`` and save what the window shows as ``png``."""
    png.parent.mkdir(parents=True, exist_ok=True)
    _run(browser, [f"--screenshot={png.resolve()}", f"--window-size={size[0]},{size[1]}", report.resolve().as_uri()])
    if not png.exists() or png.stat().st_size == 0:
        raise RuntimeError(f"{browser} wrote no screenshot at {png}")


def problems(browser: str, report: Path, cells: int, fail_cells: int) -> list[str]:
    """What is wrong with ``report`` as the browser shows it (empty when nothing is): it must lay out and colour
    ``cells`` matrix cells, and the address filter ``#outcome=FAIL`` must leave the ``fail_cells`` FAIL ones."""
    state = page_state(browser, report)
    found = []
    if not state:
        found.append("the page recorded nothing on <body>: its script did not run")
    elif state["cells"] != cells:
        found.append(f"the page has {state['cells']} matrix cells, the run {cells} rows")
    elif state["visible-cells"] != cells:
        found.append(f"{state['visible-cells']} of {state['cells']} matrix cells are laid out")
    elif state["coloured-cells"] != state["cells"]:
        found.append(f"{state['coloured-cells']} of {state['cells']} matrix cells are coloured")
    if state and state.get("summary-rows", 0) == 0:
        found.append("the per-area summary shows no row")
    filtered = page_state(browser, report, "outcome=FAIL")
    if filtered.get("visible-cells") != fail_cells:
        found.append(f"with #outcome=FAIL, {filtered.get('visible-cells')} cells are visible, expected {fail_cells}")
    return found


def main(argv: list[str] | None = None) -> int:
    from conformance.runner.document import load_report

    parser = argparse.ArgumentParser(prog="python -m conformance.runner.html_check", description=__doc__)
    parser.add_argument("report", type=Path, help="the HTML report")
    parser.add_argument("--json", type=Path, required=True, help="the same run's JSON report (the expected cells)")
    parser.add_argument("--screenshot", type=Path, help="also save a screenshot here")
    ns = parser.parse_args(argv)
    browser = find_browser()
    if browser is None:
        print(f"no browser found ({', '.join(BROWSERS)}): apt-get install chromium", file=sys.stderr)
        return 1
    rows = load_report(ns.json).rows
    found = problems(browser, ns.report, len(rows), sum(r.outcome == "FAIL" for r in rows))
    if ns.screenshot:
        screenshot(browser, ns.report, ns.screenshot)
    for problem in found:
        print(f"{ns.report}: {problem}", file=sys.stderr)
    if not found:
        print(f"{ns.report}: {len(rows)} cells rendered and coloured, summary shown, filters work ({browser})")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
