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
and users' scripts imported, now ``conformance.fuzz``) has no old directory:
its old path and its old submodules' are found by :class:`_MovedPackage`, which
:func:`find_moved_package` puts first on ``sys.meta_path`` when the old
parent package is imported (``conformance/cases/__init__.py`` calls it). It
aliases ``old.sub`` to the module :data:`MOVED` names
(``conformance.cases.fuzz.runner`` -> ``conformance.fuzz.parity``) with the
same warning, and refuses a name the old package never had: once the old
package's name is the new package, the ordinary finders would search the new
package's directory and load a second copy of ``new.sub`` under the old name.
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

__all__ = ["MOVED", "REMOVED_IN", "alias", "find_moved_package"]

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
    # parity fuzzer. No directory is left under the old path: :func:`find_moved_package` (see the module note).
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
#: The first version without the paths of :data:`MOVED` (this one is 0.1).
REMOVED_IN = "0.3"


def alias(old: str) -> None:
    """Make module ``old`` (the caller, while it is imported) the module :data:`MOVED` names, warning
    from the line that imported it."""
    _redirect(old, _importer(sys._getframe(2)))


def _redirect(old: str, importer: FrameType) -> None:
    """Warn from ``importer``'s line that ``old`` moved, and put the new module in ``old``'s place."""
    new = MOVED[old]
    warnings.warn_explicit(
        f"{old} moved to {new}: import {new} instead ({old} is removed in fsdp-conformance {REMOVED_IN})",
        DeprecationWarning, importer.f_code.co_filename, importer.f_lineno,
        module=importer.f_globals.get("__name__"), registry=importer.f_globals.setdefault("__warningregistry__", {}),
    )
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


class _MovedPackage(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a moved package's old path and its old submodules' (the module note)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        package = next((old for old in _PACKAGES if fullname == old or fullname.startswith(old + ".")), None)
        if package is None:
            return None
        if fullname not in MOVED:
            raise ModuleNotFoundError(f"No module named {fullname!r} ({package} moved to {MOVED[package]})",
                                      name=fullname)
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module, replaced by the new one in exec_module

    def exec_module(self, module: ModuleType) -> None:
        _redirect(module.__name__, _importer(sys._getframe(1)))


_FINDER = _MovedPackage()
#: The moved packages :data:`_FINDER` serves.
_PACKAGES: set[str] = set()


def find_moved_package(old: str) -> None:
    """Let ``old`` (a moved package in :data:`MOVED`, with no directory left) and its old submodules import
    as their new modules, with the warning."""
    if old not in MOVED:
        raise KeyError(f"{old} is not a moved module path")
    _PACKAGES.add(old)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
