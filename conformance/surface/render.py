"""docs/SURFACE.md: the classification as markdown, a table per surface with its coverage line.

The page is made from the classification alone, so one committed page holds for every torch the
classification covers (names of one torch only carry their versions).
"""

from __future__ import annotations

from conformance.surface.classification import Entry, Surface

__all__ = ["coverage", "render"]

_INTRO = """\
# The public surface of torch's FSDPs, and what exercises it

Every public name of `torch.distributed.fsdp` (`FullyShardedDataParallel`'s members and constructor
arguments, `FSDPModule`'s methods, `fully_shard`'s arguments, the fields and members of the policy,
config and enum classes they take) and of `torch.distributed.checkpoint.state_dict` (its functions and
`StateDictOptions`' fields), with the case rows (ids as `fsdp-conformance list` prints them; `*`
matches any characters, a case id without parameters stands for all its rows) or stateful-fuzzer
operations (`fuzz/stateful_* op Unshard`: the programs those rows draw that run the `Unshard`
operation) that exercise it with an observable check, and what that check asserts; or why nothing
does. Each surface is reached through the adapter named with it. A performance knob no case checks
for neutrality says so.

Generated from `conformance/surface/classified.toml` by `python -m conformance.surface --write
docs/SURFACE.md`; `conformance/tests/surface/test_surface.py` checks that the classification names every public
name of the installed torch and nothing else, that every row cited exists and runs on the surface's
adapter, and that this page is the generator's output
([TESTING.md](TESTING.md#the-public-surface-table)). A name one torch has and another lacks carries the
versions that have it.
"""


def coverage(surface: Surface) -> str:
    """``NAME: E of N exercised``."""
    exercised = sum(entry.exercised for entry in surface.entries)
    return f"{surface.name}: {exercised} of {len(surface.entries)} exercised"


def render(surfaces: list[Surface]) -> str:
    """The whole page."""
    parts = [_INTRO, _summary(surfaces)]
    parts += [_section(surface) for surface in surfaces]
    return "\n".join(parts).rstrip() + "\n"


def _summary(surfaces: list[Surface]) -> str:
    rows = ["## Coverage", "", "| surface | adapter | exercised |", "|---|---|---|"]
    for surface in surfaces:
        exercised = sum(entry.exercised for entry in surface.entries)
        rows.append(f"| [`{surface.name}`](#{_anchor(surface.name)}) | {surface.adapter} | "
                    f"{exercised} of {len(surface.entries)} |")
    total = sum(len(surface.entries) for surface in surfaces)
    exercised = sum(entry.exercised for surface in surfaces for entry in surface.entries)
    rows.append(f"| all | | {exercised} of {total} |")
    return "\n".join(rows) + "\n"


def _section(surface: Surface) -> str:
    rows = [f"## `{surface.name}`", "", f"{coverage(surface)} (through the {surface.adapter} adapter).", ""]
    if not surface.entries:
        return "\n".join([*rows, "No public names.", ""])
    rows += ["| name | kind | exercised by | what is checked / why not |", "|---|---|---|---|"]
    rows += [_row(entry) for entry in surface.entries]
    return "\n".join(rows) + "\n"


def _row(entry: Entry) -> str:
    cited = "<br>".join(_cell(citation) for citation in map(str, entry.exercised_by)) or "none"
    said = entry.check if entry.exercised else entry.unexercised
    return f"| `{entry.name}`{_versions(entry)} | {entry.kind} | {cited} | {_escaped(said)} |"


def _cell(citation: str) -> str:
    rows, _, op = citation.partition(" op ")
    return f"`{rows}` op `{op}`" if op else f"`{rows}`"


def _versions(entry: Entry) -> str:
    bounds = [f"torch >= {entry.since}"] * bool(entry.since) + [f"torch < {entry.until}"] * bool(entry.until)
    return f" ({', '.join(bounds)})" if bounds else ""


def _escaped(text: str) -> str:
    return text.replace("|", r"\|")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than ``-`` and ``_`` dropped."""
    return "".join(ch for ch in heading.lower().replace(" ", "-") if ch.isalnum() or ch in "-_")
