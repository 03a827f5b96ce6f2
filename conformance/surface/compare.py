"""The classification against the installed torch's surface: what is missing, stale or of another kind."""

from __future__ import annotations

from conformance.surface.classification import Surface

__all__ = ["problems"]


def problems(surfaces: list[Surface], installed: dict[str, dict[str, str]], version: tuple[int, int]) -> list[str]:
    """One line per disagreement between ``surfaces`` and ``installed`` (surface -> {name -> kind}) for torch
    ``version``, each naming the surface and the name; empty when they agree."""
    found: list[str] = []
    classified = {surface.name: surface for surface in surfaces}
    for name in sorted(set(installed) - set(classified)):
        found.append(f"surface {name!r} of the installed torch is not classified (names: {sorted(installed[name])})")
    for surface in surfaces:
        if surface.name not in installed:
            found.append(f"surface {surface.name!r} is classified but the installed torch has no such surface")
            continue
        found += _surface_problems(surface, installed[surface.name], version)
    return found


def _surface_problems(surface: Surface, names: dict[str, str], version: tuple[int, int]) -> list[str]:
    found = []
    torch = f"torch {version[0]}.{version[1]}"
    for name, kind in names.items():
        entry = surface.entry(name)
        if entry is None:
            found.append(f"{surface.name}.{name} ({kind}) is public in {torch} and not classified")
        elif entry.kind != kind:
            found.append(f"{surface.name}.{name} is classified as {entry.kind!r}, {torch} has a {kind!r}")
        elif not entry.present_in(version):
            found.append(f"{surface.name}.{name} exists in {torch}, outside its since/until "
                         f"({entry.since}, {entry.until})")
    for entry in surface.entries:
        if entry.name not in names and entry.present_in(version):
            found.append(f"{surface.name}.{entry.name} is classified but {torch} has no such public name; "
                         "give it since/until if another torch has it")
    return found
