"""The suite's pytest integration, loaded only when asked for: ``-p conformance.pytest_plugin``.

[Note: opt-in plugins]
Installing fsdp-conformance registers no ``pytest11`` entry point, so an
unrelated project's pytest runs as before: no torch import, no warning, no
option added. The suite's plugins load where a session asks for this module:

* ``fsdp-conformance run`` and ``fsdp-conformance list`` pass ``-p`` themselves
  (:data:`conformance.runner.PYTEST_PLUGIN`);
* this repository's own ``pytest`` runs get it from ``addopts`` in
  ``pyproject.toml``'s ``[tool.pytest.ini_options]``;
* another project adds ``-p conformance.pytest_plugin`` to its pytest command
  line or ``addopts`` (docs/USAGE.md, "Through pytest, and in another project").

pytest-xdist hands ``-p`` (the command line's and ``addopts``') to every
worker; the harness's rank processes and thread hosts run no pytest session,
so they need nothing. Every option the plugins add is namespaced
(``--fsdp-*``, ``--conformance-*``) so it cannot collide with one a user's
``conftest.py`` defines.

The suite's packages are marked for assertion rewriting (:data:`REWRITTEN`),
as pytest marked an installed plugin's whole distribution, before any of them
is imported: else pytest warns that it cannot rewrite a plugin module another
one imported first (``PytestAssertRewriteWarning``). The plugins are
registered in the order the entry points had (their names' order), which is
the order pluggy calls their hooks in, last registered first: the harness
parametrizes rank modes before the conformance plugin parametrizes
implementations, so a case's rows come mode by mode, as the matrix and the
reports list them.
"""

import pytest

#: The suite's packages whose ``assert`` statements pytest rewrites (``conformance`` itself, the parent
#: of this module, is imported by now: its subpackages are named instead).
REWRITTEN = ("harness", "fixtures", "fsdp_impl", "bench", "conformance.adapters", "conformance.cases",
             "conformance.contract", "conformance.fuzz", "conformance.runner", "conformance.selftest",
             "conformance.tests")
pytest.register_assert_rewrite(*REWRITTEN)

pytest_plugins = [
    "conformance.runner.plugin",
    "conformance.runner.baseline",
    "conformance.runner.selection",
    "conformance.runner.budget",
    "conformance.runner.progress",
    "conformance.runner.transport",
    "harness.plugin.pytest_plugin",
    "harness.plugin.scheduling",
    "conformance.runner.signals",
]
