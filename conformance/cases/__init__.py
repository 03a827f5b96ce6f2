"""The case modules: each ``test_*.py`` declares the cases of one area of the catalogue.

``conformance.cases.fuzz``, the fuzz engine's old path, still imports (as ``conformance.fuzz``, with a
``DeprecationWarning``): [Note: moved modules] in :mod:`conformance.contract.moved`.
"""

from conformance.contract.moved import find_moved_package

find_moved_package("conformance.cases.fuzz")
