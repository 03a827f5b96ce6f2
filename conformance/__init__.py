"""FSDP conformance: the contract, the built-in adapters, the runner, the cases and the suite's self-test.

=========================== ===============================================================
package                     what it is
=========================== ===============================================================
``conformance.contract``    what adapter and case authors import (public, versioned):
                            the adapter protocol and capabilities, ``@case``, row ids,
                            applicability, the adapter registry, results
``conformance.adapters``    the built-in adapters (reference, torch FSDP1/FSDP2, FairScale)
``conformance.runner``      the pytest plugins, settings, reports and the ``fsdp-conformance`` CLI
``conformance.cases``       the cases, one module per area, and the parity fuzzer
``conformance.selftest``    proving cases can fail: patches of an implementation and the rows
                            that must FAIL against them (public), and the reference's mutants
=========================== ===============================================================

Imports point down this table's dependency order: ``contract`` needs only the
harness; ``adapters`` build on the contract; ``runner``, ``cases`` and
``selftest`` build on both and never on each other
(``conformance/tests/test_structure.py`` enforces it).
"""
