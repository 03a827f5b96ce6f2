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
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from types import FrameType

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
}

_IMPORTLIB = os.path.dirname(importlib.__file__)
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
