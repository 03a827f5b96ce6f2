"""Proving that cases can fail: an implementation with one behaviour broken, and the rows that must FAIL.

Public: :class:`Patch` (replace one attribute of an implementation, named as a
string), :class:`Expect` (the rows that must report FAIL against it) and
:func:`check_declaration`, for this suite's mutants of the reference
(:mod:`conformance.selftest.mutants`) and for out-of-tree tools that mutate
their own implementation.
"""

from conformance.selftest.declare import Expect, Patch, apply_patches, check_declaration, revert_patches

__all__ = ["Expect", "Patch", "apply_patches", "check_declaration", "revert_patches"]
