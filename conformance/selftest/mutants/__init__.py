"""Deliberately broken variants of the reference, to prove that cases can fail.

Each mutant is a built-in adapter (the reference; torch-fsdp2 for what only it
can express) with exactly one behaviour broken, declared as data in its class
body (see :mod:`conformance.selftest.declare`): the ``fsdp_impl`` attributes it
patches, named as strings, and the cases that must catch it (``expect``). The
suite's own tests (``conformance/tests/selftest/test_mutants.py``) run those cases
against each mutant and assert they report FAIL: a case that passes against a
mutant it should catch is not testing what it claims.

A mutant patches ``fsdp_impl`` in the rank processes (or thread host) running
a case, from the case's first ``wrap`` until the case ends, when the harness's
per-case reset puts the originals back; so the cases of several mutants can
run one after another in one session. The suite still runs mutants in pytest
sessions of their own, never next to the real reference. Register them with
``FSDP_CONFORMANCE_ADAPTERS="name=conformance.selftest.mutants:Class,..."``.
"""

from __future__ import annotations

import importlib
import pkgutil

from conformance.selftest.declare import Expect, Patch, check_declaration


def _discover() -> dict[str, type]:
    """Every mutant class its module exports (``__all__``) in this package's modules, by mutant name.

    Each class also becomes an attribute of this package, the name
    ``FSDP_CONFORMANCE_ADAPTERS`` registers it under; a new module needs no edit here.
    """
    found: dict[str, type] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for attr in module.__all__:
            cls = getattr(module, attr)
            if cls.name in found:
                raise ValueError(f"mutant name {cls.name!r} declared twice: {found[cls.name].__name__} and {attr}")
            check_declaration(cls)  # a stale patch target fails here, at import
            globals()[attr] = cls
            found[cls.name] = cls
    return found


#: mutant name -> adapter class (what ``FSDP_CONFORMANCE_ADAPTERS`` registers).
MUTANTS: dict[str, type] = _discover()

__all__ = ["MUTANTS", "Expect", "Patch", "check_declaration", *(cls.__name__ for cls in MUTANTS.values())]
