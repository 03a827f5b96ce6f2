"""Deliberately broken variants of the reference, to prove that cases can fail.

Each mutant is a built-in adapter (the reference; torch-fsdp2 for what only it
can express) with exactly one behaviour broken, declared as data in its class
body (see :mod:`conformance.mutants._base`): the ``fsdp_impl`` attributes it
patches, named as strings, and the cases that must catch it (``expect``). The
suite's own tests (``conformance/tests/test_mutants.py``) run those cases
against each mutant and assert they report FAIL: a case that passes against a
mutant it should catch is not testing what it claims.

A mutant patches ``fsdp_impl`` in the rank processes (or thread host) running
a case, from the case's first ``wrap`` until the case ends, when the harness's
per-case reset puts the originals back; so the cases of several mutants can
run one after another in one session. The suite still runs mutants in pytest
sessions of their own, never next to the real reference. Register them with
``FSDP_CONFORMANCE_ADAPTERS="name=conformance.mutants:Class,..."``.
"""

from __future__ import annotations

from conformance.mutants._base import Expect, Patch, check_declaration
from conformance.mutants.accumulation import *  # noqa: F403 - adapters are registered as conformance.mutants:Class
from conformance.mutants.accumulation import __all__ as _accumulation
from conformance.mutants.construction import *  # noqa: F403 - adapters are registered as conformance.mutants:Class
from conformance.mutants.construction import __all__ as _construction
from conformance.mutants.fuzz import *  # noqa: F403 - adapters are registered as conformance.mutants:Class
from conformance.mutants.fuzz import __all__ as _fuzz
from conformance.mutants.hybrid import *  # noqa: F403 - adapters are registered as conformance.mutants:Class
from conformance.mutants.hybrid import __all__ as _hybrid
from conformance.mutants.longer_runs import *  # noqa: F403 - adapters are registered as conformance.mutants:Class
from conformance.mutants.longer_runs import __all__ as _longer_runs
from conformance.mutants.meshes import *  # noqa: F403 - adapters are registered as conformance.mutants:Class
from conformance.mutants.meshes import __all__ as _meshes
from conformance.mutants.outputs import *  # noqa: F403 - adapters are registered as conformance.mutants:Class
from conformance.mutants.outputs import __all__ as _outputs
from conformance.mutants.placement import *  # noqa: F403 - adapters are registered as conformance.mutants:Class
from conformance.mutants.placement import __all__ as _placement
from conformance.mutants.precision import *  # noqa: F403 - adapters are registered as conformance.mutants:Class
from conformance.mutants.precision import __all__ as _precision
from conformance.mutants.runtime import *  # noqa: F403 - adapters are registered as conformance.mutants:Class
from conformance.mutants.runtime import __all__ as _runtime
from conformance.mutants.sharing import *  # noqa: F403 - adapters are registered as conformance.mutants:Class
from conformance.mutants.sharing import __all__ as _sharing
from conformance.mutants.state_dicts import *  # noqa: F403 - adapters are registered as conformance.mutants:Class
from conformance.mutants.state_dicts import __all__ as _state_dicts

_ALL = (
    *_runtime, *_construction, *_placement, *_hybrid, *_longer_runs, *_state_dicts, *_accumulation, *_precision,
    *_sharing, *_outputs, *_meshes, *_fuzz,
)
__all__ = ["MUTANTS", "Expect", "Patch", "check_declaration", *_ALL]

#: mutant name -> adapter class (what ``FSDP_CONFORMANCE_ADAPTERS`` registers).
MUTANTS: dict[str, type] = {
    cls.name: cls for cls in (globals()[name] for name in _ALL)
}

for _mutant in MUTANTS.values():
    check_declaration(_mutant)  # a stale patch target fails here, at import
