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
its old path and its old submodules' are found by a finder
(:class:`harness.moved.MovedModules`) that :func:`find_moved_package` puts
first on ``sys.meta_path`` when the old
parent package is imported (``conformance/cases/__init__.py`` calls it). It
aliases ``old.sub`` to the module :data:`MOVED` names
(``conformance.cases.fuzz.runner`` -> ``conformance.fuzz.parity_run``) with the
same warning, and refuses a name the old package never had: once the old
package's name is the new package, the ordinary finders would search the new
package's directory and load a second copy of ``new.sub`` under the old name.

The harness's modules that moved into its subpackages (``harness.process`` ->
``harness.ranks.process``) stay importable the same way until the same
version: :data:`harness.moved.MOVED` lists them, and importing ``harness``
puts their finder first. The mechanism lives in :mod:`harness.moved`, where
the harness, which imports nothing above it, can use it too.
"""

from __future__ import annotations

import sys

from harness.moved import MovedModules, importer, install, redirect

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
    "conformance.cases.fuzz.options": "conformance.fuzz.option_neighbours",
    "conformance.cases.fuzz.precision": "conformance.fuzz.drawn_precision",
    "conformance.cases.fuzz.prefetching": "conformance.fuzz.prefetching",
    "conformance.cases.fuzz.runner": "conformance.fuzz.parity_run",
    "conformance.cases.fuzz.searching": "conformance.fuzz.searching",
    "conformance.cases.fuzz.shadow": "conformance.fuzz.shadow",
    "conformance.cases.fuzz.stateful": "conformance.fuzz.stateful",
    "conformance.cases.fuzz.unsynced": "conformance.fuzz.unsynced",
    "conformance.cases.fuzz.wrapping": "conformance.fuzz.wrapping",
    # The fuzz engine's modules renamed for what they hold, where the old name was another package's too
    # (``fixtures.parity``, ``conformance.runner.options``...): a one-line module at each old path.
    "conformance.fuzz.compare": "conformance.fuzz.twin_checks",
    "conformance.fuzz.optimizers": "conformance.fuzz.drawn_optimizers",
    "conformance.fuzz.options": "conformance.fuzz.option_neighbours",
    "conformance.fuzz.parity": "conformance.fuzz.parity_run",
    "conformance.fuzz.precision": "conformance.fuzz.drawn_precision",
    "conformance.fuzz.verdicts": "conformance.fuzz.agreement",
}

#: The first version without the paths of :data:`MOVED` (this one is 0.1).
REMOVED_IN = "0.3"


def alias(old: str) -> None:
    """Make module ``old`` (the caller, while it is imported) the module :data:`MOVED` names, warning
    from the line that imported it."""
    redirect(old, MOVED[old], REMOVED_IN, importer(sys._getframe(2)))


#: Serves the moved packages that have no directory left (:func:`find_moved_package`).
_FINDER = MovedModules(MOVED, REMOVED_IN)


def find_moved_package(old: str) -> None:
    """Let ``old`` (a moved package in :data:`MOVED`, with no directory left) and its old submodules import
    as their new modules, with the warning."""
    _FINDER.serve(old, package=True)
    install(_FINDER)
