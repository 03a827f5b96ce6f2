"""Module paths the contract was published under before it moved, still importable with a warning.

[Note: moved modules]
Adapter and case authors imported the contract from the paths the guide taught
at the time (``conformance.adapters.base`` until the contract became
``conformance.contract``). Each old path in :data:`MOVED` is a module of one
line, ``alias(__name__)``, which warns (``DeprecationWarning`` naming the new
path) and puts the new module in its place in ``sys.modules``: the old name
*is* the new module, so every name it had, private ones included, and every
class (``Capability``, ``WrapSpec``) is the same object under both paths. They
stay until :data:`REMOVED_IN` (docs/ADAPTER_GUIDE.md, section 8); the test of
the stable surface imports each of them.

A moved package (``conformance.cases.fuzz``, the fuzz engine that reproducers
and users' scripts imported, now ``conformance.fuzz``) keeps its old directory
of one-line modules, one per old submodule. Once the old package's name is the
new package, importing ``old.sub`` would search the new package's directory
and load a second copy of ``new.sub`` under the old name; :class:`_OldSubmodules`
finds ``old.sub`` in the old directory instead, where its one line aliases it
to the module :data:`MOVED` names (``conformance.cases.fuzz.runner`` ->
``conformance.fuzz.parity``), and refuses a name the old package never had.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import warnings
from collections.abc import Sequence
from types import FrameType, ModuleType

__all__ = ["MOVED", "REMOVED_IN", "alias"]

#: A published module path -> the module that took its place.
MOVED: dict[str, str] = {
    "conformance.adapters.base": "conformance.contract.adapter",
    "conformance.adapters.optional": "conformance.contract.optional",
    "conformance.applicability": "conformance.contract.applicability",
    "conformance.case": "conformance.contract.case",
    "conformance.registry": "conformance.contract.registry",
    "conformance.rows": "conformance.contract.rows",
    # ``CaseReport``, ``Result`` and ``OUTCOMES``, what adapter and case authors took from it.
    "conformance.report": "conformance.contract.results",
    "conformance.findings": "conformance.runner.findings",
    "conformance.settings": "conformance.runner.settings",
    # The fuzz engine, a package of the case modules' until it became one of its own; ``runner`` is the
    # parity fuzzer. Its old directory holds the one-line modules (see the module note).
    "conformance.cases.fuzz": "conformance.fuzz",
    "conformance.cases.fuzz.controls": "conformance.fuzz.controls",
    "conformance.cases.fuzz.drawing": "conformance.fuzz.drawing",
    "conformance.cases.fuzz.driver": "conformance.fuzz.driver",
    "conformance.cases.fuzz.example": "conformance.fuzz.example",
    "conformance.cases.fuzz.gathers": "conformance.fuzz.gathers",
    "conformance.cases.fuzz.held": "conformance.fuzz.held",
    "conformance.cases.fuzz.model": "conformance.fuzz.model",
    "conformance.cases.fuzz.neighbours": "conformance.fuzz.neighbours",
    "conformance.cases.fuzz.ops": "conformance.fuzz.ops",
    "conformance.cases.fuzz.options": "conformance.fuzz.options",
    "conformance.cases.fuzz.precision": "conformance.fuzz.precision",
    "conformance.cases.fuzz.prefetching": "conformance.fuzz.prefetching",
    "conformance.cases.fuzz.runner": "conformance.fuzz.parity",
    "conformance.cases.fuzz.searching": "conformance.fuzz.searching",
    "conformance.cases.fuzz.shadow": "conformance.fuzz.shadow",
    "conformance.cases.fuzz.stateful": "conformance.fuzz.stateful",
    "conformance.cases.fuzz.unsynced": "conformance.fuzz.unsynced",
    "conformance.cases.fuzz.wrapping": "conformance.fuzz.wrapping",
}

_IMPORTLIB = os.path.dirname(importlib.__file__)
#: A moved package, once imported under its old name -> its old directory (``__path__``).
_OLD_PATHS: dict[str, list[str]] = {}
#: The first version without the paths of :data:`MOVED` (this one is 0.1).
REMOVED_IN = "0.3"


def alias(old: str) -> None:
    """Make module ``old`` (the caller, while it is imported) the module :data:`MOVED` names, warning
    from the line that imported it."""
    new = MOVED[old]
    importer = _importer(sys._getframe(2))
    warnings.warn_explicit(
        f"{old} moved to {new}: import {new} instead ({old} is removed in fsdp-conformance {REMOVED_IN})",
        DeprecationWarning, importer.f_code.co_filename, importer.f_lineno,
        module=importer.f_globals.get("__name__"), registry=importer.f_globals.setdefault("__warningregistry__", {}),
    )
    old_path = sys._getframe(1).f_globals.get("__path__")
    if old_path is not None:  # a package: its old submodules are found in its old directory
        _OLD_PATHS[old] = list(old_path)
        _put_first(_FINDER)
    sys.modules[old] = importlib.import_module(new)


def _importer(frame: FrameType) -> FrameType:
    """The first frame from ``frame`` up that is not the import system's: importlib's (frozen or not,
    ``import_module`` included), or a loader's ``exec_module`` (pytest's assertion rewriter is one)."""
    while frame.f_back is not None:
        code = frame.f_code
        if not (code.co_filename.startswith(("<frozen importlib", _IMPORTLIB)) or code.co_name == "exec_module"):
            break
        frame = frame.f_back
    return frame


class _OldSubmodules(importlib.abc.MetaPathFinder):
    """Finds ``old.sub`` of a moved package ``old`` in the old package's directory (the module note)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        parent = fullname.rpartition(".")[0]
        if parent not in _OLD_PATHS:
            return None
        if fullname not in MOVED:
            raise ModuleNotFoundError(f"No module named {fullname!r} ({parent} moved to {MOVED[parent]})",
                                      name=fullname)
        return importlib.machinery.PathFinder.find_spec(fullname, _OLD_PATHS[parent])


_FINDER = _OldSubmodules()


def _put_first(finder: importlib.abc.MetaPathFinder) -> None:
    """``finder`` first on ``sys.meta_path``, ahead of finders that search the new package's directory (pytest's
    assertion rewriter is one)."""
    if sys.meta_path and sys.meta_path[0] is finder:
        return
    if finder in sys.meta_path:
        sys.meta_path.remove(finder)
    sys.meta_path.insert(0, finder)
