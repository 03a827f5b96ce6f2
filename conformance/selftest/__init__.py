"""Proving that cases can fail: an implementation with one behaviour broken, and the rows that must FAIL.

Public, for this suite's mutants of the reference (:mod:`conformance.selftest.mutants`)
and for out-of-tree tools that mutate their own implementation (docs/ADAPTER_GUIDE.md,
"Prove your cases can fail"): :class:`Patch` (replace one attribute, named as a string),
:class:`Expect` (the rows that must report FAIL), :class:`PatchedAdapter` (mix into any
adapter class to apply patches on every wrap), :func:`check_declaration`, and
:func:`uncaught` (run the rows in a pytest session; the ones that did not FAIL).
"""

from conformance.selftest.declare import (
    Expect,
    Patch,
    PatchedAdapter,
    apply_patches,
    check_declaration,
    revert_patches,
)
from conformance.selftest.session import problems_of, run_session, uncaught

__all__ = ["Expect", "Patch", "PatchedAdapter", "apply_patches", "check_declaration", "problems_of", "revert_patches",
           "run_session", "uncaught"]
