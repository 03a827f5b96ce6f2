"""Module paths that moved, still importable with a ``DeprecationWarning`` naming the new path.

The mechanism, here at the bottom of the stack so that the harness keeps its
own old paths (it imports nothing above it) and the contract uses the same one
for its published paths (:mod:`conformance.contract.moved`, [Note: moved
modules], says which paths are kept and until when). An old path is served in
one of two ways:

* a module of one line left at the old path that calls :func:`redirect`
  with its importer's frame (the contract's moved modules);
* no file at all: a :class:`MovedModules` finder, first on ``sys.meta_path``,
  serves each old path it was told to (a moved package's submodules too). The harness's modules that moved into its
  subpackages (:data:`MOVED`) are served so, by a finder that importing
  ``harness`` puts there (``import harness.process`` imports ``harness``
  first).

Either way the old name *is* the new module in ``sys.modules``: every name it
had, private ones included, is the same object under both paths, and the
warning points at the line that imported the old path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from types import FrameType, ModuleType

__all__ = ["MOVED", "REMOVED_IN", "MovedModules", "importer", "install", "redirect", "serve_harness"]

#: The harness's module paths before it was grouped by its jobs, or renamed -> where each went.
MOVED: dict[str, str] = {
    **{f"harness.{name}": f"harness.ranks.{name}" for name in (
        "runner", "process", "thread_host", "threads", "launched", "_host_main", "_rank_main", "_rank_state",
        "_torch_threadlocal", "context", "outcome", "errors", "reset", "devices", "cpu_budget", "main_guard",
        "rank_mode", "warnings_capture")},
    **{f"harness.{name}": f"harness.collectives.{name}" for name in (
        "observe", "recorder", "sequence", "comm_worker")},
    **{f"harness.{name}": f"harness.plugin.{name}" for name in (
        "pytest_plugin", "hookspecs", "scheduling", "workers")},
    # The resolution of a setting from its sources, named apart from the conformance run's settings.
    "harness.settings": "harness.setting_sources",
}
#: The first version without the paths of :data:`MOVED` (this one is 0.1).
REMOVED_IN = "0.3"

_IMPORTLIB = os.path.dirname(importlib.__file__)


def redirect(old: str, new: str, removed_in: str, importer_frame: FrameType) -> None:
    """Warn from ``importer_frame``'s line that ``old`` moved to ``new``, and put ``new`` in ``old``'s place."""
    warnings.warn_explicit(
        f"{old} moved to {new}: import {new} instead ({old} is removed in fsdp-conformance {removed_in})",
        DeprecationWarning, importer_frame.f_code.co_filename, importer_frame.f_lineno,
        module=importer_frame.f_globals.get("__name__"),
        registry=importer_frame.f_globals.setdefault("__warningregistry__", {}),
    )
    sys.modules[old] = importlib.import_module(new)


def importer(frame: FrameType) -> FrameType:
    """The first frame from ``frame`` up that is not the import system's: importlib's (frozen or not,
    ``import_module`` included), or a loader's ``exec_module`` (pytest's assertion rewriter is one)."""
    while frame.f_back is not None:
        code = frame.f_code
        if not (code.co_filename.startswith(("<frozen importlib", _IMPORTLIB)) or code.co_name == "exec_module"):
            break
        frame = frame.f_back
    return frame


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the old paths :meth:`serve` names (of ``moved``, with no file left) as their new modules, warning.

    A moved package's old path is served with its submodules' (``old.sub``); a name under it that ``moved``
    lacks is refused, where the ordinary finders would search the new package's directory and load a second
    copy of ``new.sub`` under the old name.
    """

    def __init__(self, moved: Mapping[str, str], removed_in: str) -> None:
        self.moved, self.removed_in = moved, removed_in
        self.served: set[str] = set()
        self.packages: set[str] = set()

    def serve(self, old: str, *, package: bool = False) -> None:
        """Serve ``old``; a ``package`` with the submodules ``moved`` lists under it."""
        if old not in self.moved:
            raise KeyError(f"{old} is not a moved module path")
        self.served.add(old)
        if package:
            self.packages.add(old)

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname in self.served:
            return importlib.machinery.ModuleSpec(fullname, self)
        package = next((old for old in self.packages if fullname.startswith(old + ".")), None)
        if package is None:
            return None
        if fullname not in self.moved:
            raise ModuleNotFoundError(f"No module named {fullname!r} ({package} moved to {self.moved[package]})",
                                      name=fullname)
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module, replaced by the new one in exec_module

    def exec_module(self, module: ModuleType) -> None:
        old = module.__name__
        redirect(old, self.moved[old], self.removed_in, importer(sys._getframe(1)))


def install(finder: MovedModules) -> None:
    """Put ``finder`` first on ``sys.meta_path`` (once), ahead of the finders that would search a new
    package's directory under an old name."""
    if finder not in sys.meta_path:
        sys.meta_path.insert(0, finder)


def serve_harness() -> None:
    """Serve the harness's old paths (:data:`MOVED`); importing ``harness`` calls it."""
    for old in MOVED:
        _HARNESS.serve(old)
    install(_HARNESS)


_HARNESS = MovedModules(MOVED, REMOVED_IN)
