"""The suite's own tests of the conformance package.

[Note: tests on the first torch]
A test marked ``first_torch`` checks the suite's own plumbing (reports, the
CLI and its usage errors, the pytest plugins and hooks, listing and selection,
signals, xdist transport, the main-module guard, the self-test API and how a
mutant's patches are scoped, the stateful fuzzer's search and shrink, the house
rules on the code and the docs, the rank processes' lifetimes and temp dirs) over the reference
on a handful of rows: its verdict does not depend on which torch runs the
ranks. ``.ci/run`` runs the whole suite on the first torch it tests and leaves
these out on the others, which keeps a commit's CI within its budget; the
nightly job (``tox -e nightly``) runs every test on every torch.

[Note: nightly tests]
A test marked ``nightly`` is slow and still needed: the mutant runs
(``test_mutants_are_caught``, one pytest session per batch of mutants, each
proving its cases can FAIL), soak tests (fifty faulted runs in a row), the
launched jobs beyond the two-agent one every commit runs (a pool rank 0 starts
inside the job, a job that loses a rank), and the variants of a plumbing test whose other variant
takes the same path in every commit: the CLI's serial-against-``-n 2`` comparison
(the pytest-level transport test compares them every commit), a lost row, a
known FAIL and a shared deadline under ``-n 2`` (their serial tests), SIGHUP (SIGINT's
serial path) and an unknown row under ``-n 2``, and the overlap case run by the CLI against
the DTensor toy (a timing test, alone at a session's end: its measurement and the case's
bound are checked every commit by the toy's own timing test and the main job's overlap
rows). Each ``-n 2`` session pays for a
controller, two workers and their forkservers importing torch before its first
row (about 20 CPU-seconds). A
plain ``pytest`` run, the README's test command and so a commit's CI, leaves
them out (the project's ``conftest.py`` deselects them and says so in the
header); ``pytest --nightly`` runs them too, as the nightly jobs do
(``tox -e nightly``, ``tox -e gpu``). A change to a case or a mutant is checked
by hand with ``pytest --nightly conformance/tests/selftest/test_mutants.py -k <module>``
(docs/TESTING.md).
"""
