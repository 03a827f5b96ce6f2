"""The HTML report: one self-contained file (no network, no other file) a person opens in a browser.

At the top the run's facts (versions, machine, settings with their sources,
times, and a banner when the run was interrupted); then outcome counts per
area and implementation; then the matrix, one coloured cell per row and
implementation/rank mode, each cell carrying its reason and, for a known
finding, a link to the write-up. Check boxes filter the matrix by outcome
(rows without a chosen outcome are hidden, other cells faded) and by
implementation (its columns hidden); the same filters can be given in the
address (``report.html#outcome=FAIL,error&impl=reference``). Once laid out, the page
records what it shows on ``<body>`` (``data-cells``, ``data-visible-cells``,
``data-coloured-cells``, ``data-summary-rows``) so a headless browser can
check it (:mod:`conformance.runner.html_check`). Compared with a baseline
(``--conformance-expect``), the page opens with the differences (``#expectation``):
the verdict, then a table of the changed cells, then the cells listed only.
Format: ``docs/REPORTS.md``.
"""

from __future__ import annotations

import html
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from conformance.contract.results import OUTCOMES, Result
from conformance.runner.document import SCHEMA_VERSION, RunFacts, summary
from conformance.runner.expect import CHANGES, LISTED, Change, Comparison

__all__ = ["COLOURS", "finding_href", "outcome_class", "render_html"]

#: The checkout this package runs from (its ``docs/findings`` hold the built-in findings' write-ups).
_CHECKOUT = Path(__file__).resolve().parents[2]

#: Cell colour per outcome (background, text).
COLOURS = {"pass": ("#c8e6c9", "#1b5e20"), "FAIL": ("#ef9a9a", "#7f0000"), "error": ("#ffcc80", "#6d3300"),
           "documented": ("#e1bee7", "#4a148c"), "n/a": ("#e0e0e0", "#424242"), "skip": ("#bbdefb", "#0d47a1")}


def outcome_class(outcome: str) -> str:
    """The CSS class of an outcome's cells: ``o-pass``, ``o-FAIL``, ``o-documented``, ``o-error``, ``o-na``,
    ``o-skip``."""
    return "o-" + outcome.replace("/", "")


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.2em;color:#212121}
h1{font-size:1.4em;margin:0 0 .4em} h2{font-size:1.1em;margin:1.2em 0 .4em}
table{border-collapse:collapse} th,td{border:1px solid #bdbdbd;padding:3px 6px;vertical-align:top}
th{background:#f5f5f5;text-align:left} .facts th{width:9em} .side{display:flex;gap:1.5em;flex-wrap:wrap}
.facts td{font-size:.9em}
.banner{padding:.6em;margin:.6em 0;font-weight:bold;border-radius:4px}
.interrupted{background:#ffecb3;border:2px solid #ff6f00} .changed{background:#ffcdd2;border:2px solid #b71c1c}
.complete{background:#e8f5e9;border:1px solid #66bb6a}
.cell{min-width:5em;font-weight:bold} .reason{font-weight:normal;font-size:.8em;max-width:28em;
overflow-wrap:anywhere} .cell a{font-weight:normal;font-size:.8em}
#filters label{margin-right:1em} .hidden{display:none} .faded{opacity:.15}
""" + "".join(f".{outcome_class(o)}{{background:{bg};color:{fg}}}" for o, (bg, fg) in COLOURS.items())

_JS = """
(function(){
  var boxes=function(kind){return Array.prototype.slice.call(document.querySelectorAll('input[data-'+kind+']'));};
  function checked(kind){var s={};boxes(kind).forEach(function(b){if(b.checked)s[b.getAttribute('data-'+kind)]=1;});
    return s;}
  function apply(){
    var outs=checked('outcome'), impls=checked('impl');
    document.querySelectorAll('#matrix [data-col-impl]').forEach(function(c){
      c.classList.toggle('hidden',!impls[c.getAttribute('data-col-impl')]);});
    document.querySelectorAll('#matrix tbody tr').forEach(function(row){
      var shown=false;
      row.querySelectorAll('td.cell').forEach(function(c){
        var match=!!outs[c.getAttribute('data-outcome')]; c.classList.toggle('faded',!match);
        if(impls[c.getAttribute('data-impl')]&&match)shown=true;});
      row.classList.toggle('hidden',!shown);});
    record();}
  function visible(el){var r=el.getBoundingClientRect();return r.width>0&&r.height>0;}
  function record(){
    var cells=document.querySelectorAll('#matrix td.cell'), vis=0, col=0;
    cells.forEach(function(c){if(!visible(c)||c.classList.contains('faded'))return;vis++;
      var bg=getComputedStyle(c).backgroundColor;if(bg&&bg!=='transparent'&&bg!=='rgba(0, 0, 0, 0)')col++;});
    var b=document.body; b.setAttribute('data-cells',cells.length); b.setAttribute('data-visible-cells',vis);
    b.setAttribute('data-coloured-cells',col);
    b.setAttribute('data-summary-rows',
      Array.prototype.filter.call(document.querySelectorAll('#summary tbody tr'),visible).length);}
  function fromAddress(){
    location.hash.replace(/^#/,'').split('&').forEach(function(part){
      var kv=part.split('='); if(kv.length!==2||(kv[0]!=='outcome'&&kv[0]!=='impl'))return;
      var want=decodeURIComponent(kv[1]).split(',');
      boxes(kv[0]).forEach(function(b){b.checked=want.indexOf(b.getAttribute('data-'+kv[0]))>=0;});});}
  boxes('outcome').concat(boxes('impl')).forEach(function(b){b.addEventListener('change',apply);});
  fromAddress(); apply();
})();
"""


def _facts_section(facts: RunFacts, rows: int) -> str:
    if facts.interrupted_by is not None:
        banner = (f'<div class="banner interrupted" id="status">Interrupted by {_e(facts.interrupted_by)} after '
                  f"{rows} rows: rows not shown did not run; this report is incomplete.</div>")
    elif (reason := facts.incomplete_reason(rows)) is not None:
        banner = f'<div class="banner interrupted" id="status">Incomplete: {_e(reason)}.</div>'
    else:
        banner = f'<div class="banner complete" id="status">Complete: every selected row ran ({rows} rows).</div>'
    machine = facts.machine
    adapters = ", ".join(f"{a['name']} ({a['distribution'] or 'no package'} {a['version'] or ''})".replace(" )", ")")
                         for a in facts.adapters)
    run = [("fsdp-conformance", facts.tool_version), ("adapters", adapters or "-"), ("torch", facts.torch),
           ("Python", facts.python),
           ("machine", f"{machine.get('hostname', '?')}: {machine.get('platform', '?')}"),
           ("CPUs", f"{machine.get('usable_cpus', '?')} usable of {machine.get('cpus', '?')}"),
           ("GPUs visible", machine.get("gpus_visible", "?")), ("started", facts.started_at),
           ("ended", facts.ended_at), ("report schema", SCHEMA_VERSION)]
    settings = [(name, f"{_value(s['value'])} (from {s['source']})") for name, s in facts.settings.items()]
    tables = "".join(f'<table class="facts"><thead><tr><th colspan="2">{title}</th></tr></thead><tbody>'
                     + "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in items) + "</tbody></table>"
                     for title, items in (("run", run), ("settings", settings)))
    return f'{banner}<div id="facts" class="side">{tables}</div>'


def _side(result: Result | None) -> str:
    if result is None:
        return "<td>(no cell)</td>"
    reason = f'<div class="reason">{_e(result.reason)}</div>'
    return f'<td class="{outcome_class(result.outcome)}">{_e(result.outcome)}{reason}</td>'


def _change_row(change: Change) -> str:
    case, impl, mode = change.cell
    return (f'<tr data-kind="{_e(change.kind)}"><th>{_e(change.kind)}</th><td><code>{_e(case)}</code></td>'
            f"<td>{_e(impl)}/{_e(mode)}</td>{_side(change.expected)}{_side(change.actual)}</tr>")


def _expectation_section(comparison: Comparison | None) -> str:
    """The differences from the baseline, first on the page; ``""`` without one."""
    if comparison is None:
        return ""
    verdict = "Changed" if comparison.changed else "As expected"
    style = "changed" if comparison.changed else "complete"
    text = (f"{verdict} against the baseline {_e(comparison.baseline)}: {comparison.as_expected} cells as expected "
            f"({comparison.expected_failures} of them known FAIL or error)")
    kinds = (*CHANGES, *LISTED)
    counts = ", ".join(f"{n} {_e(kind)}" for kind, n in comparison.counts().items() if n and kind in kinds)
    rows = "".join(_change_row(change) for change in comparison.changes)
    table = (f'<table id="changes"><thead><tr><th>difference</th><th>case</th><th>column</th><th>baseline</th>'
             f"<th>this run</th></tr></thead><tbody>{rows}</tbody></table>") if rows else ""
    return (f'<div id="expectation"><h2>Compared with the baseline</h2>'
            f'<div class="banner {style}" id="expect-status">{text}{": " + counts if counts else ""}.</div>'
            f"{table}</div>")


def _value(value: object) -> str:
    return ", ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def _summary_section(results: Sequence[Result], impls: list[str]) -> str:
    counts = Counter((r.case.split("/", 1)[0], r.impl, r.outcome) for r in results)
    areas = sorted({r.case.split("/", 1)[0] for r in results})
    total = summary(results)
    overall = ", ".join(f'<span class="{outcome_class(o)}">{total[o]} {_e(o)}</span>' for o in OUTCOMES if total[o])
    head = "".join(f"<th>{_e(i)}</th>" for i in impls)
    body = []
    for area in areas:
        cells = []
        for impl in impls:
            parts = [f'<span class="{outcome_class(o)}">{counts[(area, impl, o)]} {_e(o)}</span>'
                     for o in OUTCOMES if counts[(area, impl, o)]]
            cells.append(f"<td>{', '.join(parts) or '-'}</td>")
        body.append(f"<tr><th>{_e(area)}</th>{''.join(cells)}</tr>")
    return (f'<h2>Summary</h2><p id="overall">{total["rows"]} rows: {overall or "nothing ran"}</p>'
            f'<table id="summary"><thead><tr><th>area</th>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>')


def _filters(impls: list[str]) -> str:
    outs = "".join(f'<label><input type="checkbox" checked data-outcome="{_e(o)}"> {_e(o)}</label>' for o in OUTCOMES)
    imps = "".join(f'<label><input type="checkbox" checked data-impl="{_e(i)}"> {_e(i)}</label>' for i in impls)
    return f'<div id="filters"><p><b>outcome:</b> {outs}</p><p><b>implementation:</b> {imps}</p></div>'


def finding_href(doc: str, page_dir: Path | None) -> str:
    """Where a finding's link points from a page in ``page_dir``: a URL as it is; a write-up path relative to
    the working directory or to this project's checkout (``docs/findings/...``), relative to the page when that
    file exists; else the path as registered."""
    if "://" in doc or page_dir is None:
        return doc
    for root in (Path.cwd(), _CHECKOUT):
        candidate = root / doc
        if candidate.is_file():
            return Path(os.path.relpath(candidate.resolve(), page_dir.resolve())).as_posix()
    return doc


def _cell(r: Result, page_dir: Path | None) -> str:
    reason = f'<div class="reason">{_e(r.reason)}</div>' if r.reason else ""
    href = finding_href(r.finding, page_dir)
    link = f'<div><a href="{_e(href)}">known finding: {_e(r.finding)}</a></div>' if r.finding else ""
    return (f'<td class="cell {outcome_class(r.outcome)}" data-outcome="{_e(r.outcome)}" data-impl="{_e(r.impl)}" '
            f'data-col-impl="{_e(r.impl)}" data-mode="{_e(r.rank_mode)}" title="{_e(r.reason)}">'
            f"{_e(r.outcome)}{reason}{link}</td>")


def _matrix(results: Sequence[Result], page_dir: Path | None) -> str:
    cols: list[tuple[str, str]] = list(dict.fromkeys((r.impl, r.rank_mode) for r in results))
    cells = {(r.case, r.impl, r.rank_mode): r for r in results}
    places: dict[str, list[str]] = {}
    for r in results:
        names = places.setdefault(r.case, [])
        if r.placement and r.placement not in names:
            names.append(r.placement)
    head = "".join(f'<th data-col-impl="{_e(i)}">{_e(i)}<br>{_e(m)}</th>' for i, m in cols)
    body = []
    for case in sorted(places):
        tds = [_cell(cells[(case, i, m)], page_dir) if (case, i, m) in cells else f'<td data-col-impl="{_e(i)}"></td>'
               for i, m in cols]
        body.append(f"<tr><th><code>{_e(case)}</code></th><td>{_e(','.join(places[case]) or '-')}</td>"
                    f"{''.join(tds)}</tr>")
    return (f'<h2>Matrix</h2><table id="matrix"><thead><tr><th>case</th><th>placement</th>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table>')


def render_html(results: Sequence[Result], facts: RunFacts, page_dir: Path | None = None) -> str:
    """The report page for ``results`` (module docstring); ``page_dir``, the directory the page is written to,
    makes the finding links relative to it (:func:`finding_href`)."""
    impls = list(dict.fromkeys(r.impl for r in results))
    parts = [f"<h1>fsdp-conformance report</h1>{_expectation_section(facts.expectation)}",
             _facts_section(facts, len(results)),
             _summary_section(results, impls), "<h2>Filters</h2>", _filters(impls), _matrix(results, page_dir)]
    return ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>fsdp-conformance report ({_e(facts.started_at)})</title><style>{_CSS}</style></head>"
            f"<body>{''.join(parts)}<script>{_JS}</script></body></html>\n")
