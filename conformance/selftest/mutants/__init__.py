"""Deliberately broken variants of the reference, to prove that cases can fail.

Each mutant is a built-in adapter (the reference; torch-fsdp2 for what only it
can express) with exactly one behaviour broken, declared as data in its class
body (see :mod:`conformance.selftest.declare`): the ``fsdp_impl`` attributes it
patches, named as strings, and the cases that must catch it (``expect``). The
suite's own tests (``conformance/tests/test_mutants.py``) run those cases
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

from conformance.selftest.declare import Expect, Patch, check_declaration
from conformance.selftest.mutants.accumulation import *  # noqa: F403 - adapters are registered as conformance.selftest.mutants:Class
from conformance.selftest.mutants.accumulation import __all__ as _accumulation
from conformance.selftest.mutants.composable import *  # noqa: F403 - adapters are registered as conformance.selftest.mutants:Class
from conformance.selftest.mutants.composable import __all__ as _composable
from conformance.selftest.mutants.construction import *  # noqa: F403 - adapters are registered as conformance.selftest.mutants:Class
from conformance.selftest.mutants.construction import __all__ as _construction
from conformance.selftest.mutants.fuzz import *  # noqa: F403 - adapters are registered as conformance.selftest.mutants:Class
from conformance.selftest.mutants.fuzz import __all__ as _fuzz
from conformance.selftest.mutants.hybrid import *  # noqa: F403 - adapters are registered as conformance.selftest.mutants:Class
from conformance.selftest.mutants.hybrid import __all__ as _hybrid
from conformance.selftest.mutants.longer_runs import *  # noqa: F403 - adapters are registered as conformance.selftest.mutants:Class
from conformance.selftest.mutants.longer_runs import __all__ as _longer_runs
from conformance.selftest.mutants.memory import *  # noqa: F403 - adapters are registered as conformance.selftest.mutants:Class
from conformance.selftest.mutants.memory import __all__ as _memory
from conformance.selftest.mutants.meshes import *  # noqa: F403 - adapters are registered as conformance.selftest.mutants:Class
from conformance.selftest.mutants.meshes import __all__ as _meshes
from conformance.selftest.mutants.outputs import *  # noqa: F403 - adapters are registered as conformance.selftest.mutants:Class
from conformance.selftest.mutants.outputs import __all__ as _outputs
from conformance.selftest.mutants.placement import *  # noqa: F403 - adapters are registered as conformance.selftest.mutants:Class
from conformance.selftest.mutants.placement import __all__ as _placement
from conformance.selftest.mutants.precision import *  # noqa: F403 - adapters are registered as conformance.selftest.mutants:Class
from conformance.selftest.mutants.precision import __all__ as _precision
from conformance.selftest.mutants.runtime import *  # noqa: F403 - adapters are registered as conformance.selftest.mutants:Class
from conformance.selftest.mutants.runtime import __all__ as _runtime
from conformance.selftest.mutants.sharing import *  # noqa: F403 - adapters are registered as conformance.selftest.mutants:Class
from conformance.selftest.mutants.sharing import __all__ as _sharing
from conformance.selftest.mutants.state_dicts import *  # noqa: F403 - adapters are registered as conformance.selftest.mutants:Class
from conformance.selftest.mutants.state_dicts import __all__ as _state_dicts

_ALL = (
    *_runtime, *_construction, *_placement, *_hybrid, *_longer_runs, *_state_dicts, *_accumulation, *_precision,
    *_sharing, *_outputs, *_meshes, *_fuzz, *_memory, *_composable,
)
__all__ = ["MUTANTS", "Expect", "Patch", "check_declaration", *_ALL]

#: mutant name -> adapter class (what ``FSDP_CONFORMANCE_ADAPTERS`` registers).
MUTANTS: dict[str, type] = {
    cls.name: cls for cls in (globals()[name] for name in _ALL)
}

for _mutant in MUTANTS.values():
    check_declaration(_mutant)  # a stale patch target fails here, at import
