"""Serve mutated sources to every process of a run through an overlay directory on ``PYTHONPATH``.

An overlay is a directory holding ``sitecustomize.py`` (a copy of
:mod:`~conformance.selftest.torch_mutants.overlay_site`), ``torch_mutant.json``
(which modules it serves, and from which files), the served sources, and a
``markers`` directory where the processes that load them say so. Python runs
``sitecustomize`` at every start-up, and ``PYTHONPATH`` is inherited by every
process a run starts (its forkserver, rank processes, thread hosts), so the
mutant is in place wherever the rows run, without any hook in the product or
the suite. Nothing outside the overlay is written.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Markers", "Overlay", "make_overlay", "overlay_env", "read_markers"]

_SITE = Path(__file__).with_name("overlay_site.py")


@dataclass(frozen=True)
class Overlay:
    """An overlay directory and the directory its processes write their markers to."""

    root: Path
    markers: Path


@dataclass(frozen=True)
class Markers:
    """What the processes of a run reported: one entry per (process, module)."""

    imported: tuple[dict[str, object], ...]
    import_errors: tuple[dict[str, object], ...]
    hits: tuple[dict[str, object], ...]

    def modules_imported(self) -> set[str]:
        return {str(entry["module"]) for entry in self.imported}


def make_overlay(root: Path, served: Mapping[str, str]) -> Overlay:
    """Create an overlay at ``root`` (an empty or new directory) serving ``served``: module name -> source text."""
    root.mkdir(parents=True, exist_ok=True)
    if any(root.iterdir()):
        raise ValueError(f"overlay directory {str(root)!r} is not empty")
    markers = root / "markers"
    markers.mkdir()
    sources = root / "sources"
    sources.mkdir()
    modules = {}
    for name, text in served.items():
        path = sources / f"{name}.py"
        path.write_text(text)
        modules[name] = str(path.resolve())
    (root / "torch_mutant.json").write_text(json.dumps({"modules": modules, "markers": str(markers.resolve())}))
    shutil.copyfile(_SITE, root / "sitecustomize.py")
    return Overlay(root.resolve(), markers.resolve())


def overlay_env(overlay: Overlay, environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with the overlay first on ``PYTHONPATH``."""
    env = dict(environ)
    rest = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(overlay.root) + (os.pathsep + rest if rest else "")
    return env


def read_markers(overlay: Overlay) -> Markers:
    """The markers the overlay's processes wrote (one cut short by a kill counts by its name alone)."""
    kinds: dict[str, list[dict[str, object]]] = {"import": [], "import-error": [], "hit": []}
    for path in sorted(overlay.markers.iterdir()):
        kind, pid, module = path.name.split(".", 2)
        entry: dict[str, object] = {"kind": kind, "pid": int(pid), "module": module}
        with contextlib.suppress(OSError, ValueError):
            entry.update(json.loads(path.read_text()))
        kinds.setdefault(kind, []).append(entry)
    return Markers(tuple(kinds["import"]), tuple(kinds["import-error"]), tuple(kinds["hit"]))
