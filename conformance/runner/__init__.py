"""Running the cases: the pytest plugins, settings, findings, reports and the ``fsdp-conformance`` CLI.

Nothing here is imported by a case or an adapter; the runner reaches adapters
by name through :mod:`conformance.contract.registry`.
"""

from pathlib import Path

#: Where the cases live; here, in the package's lightest module, so that ``fsdp-conformance --help``
#: needs neither pytest nor torch.
CASES_DIR = Path(__file__).resolve().parents[1] / "cases"
#: The module a pytest session loads (``-p``) to run the cases: [Note: opt-in plugins].
PYTEST_PLUGIN = "conformance.pytest_plugin"
