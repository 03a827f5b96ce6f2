"""The suite's own tests of the conformance package.

[Note: tests on the first torch]
A test marked ``first_torch`` checks the suite's own plumbing (reports, the
CLI and its usage errors, the pytest plugin, listing and selection, signals,
xdist transport, the house rules on the code and the docs) over the reference
on a handful of rows: its verdict does not depend on which torch runs the
ranks. ``.ci/run`` runs the whole suite on the first torch it tests and leaves
these (and the mutant runs) out on the others, which keeps a commit's CI within
its budget; the nightly job (``tox -e nightly``) runs every test on every torch.
"""
