"""Running the cases: the pytest plugins, settings, findings, reports and the ``fsdp-conformance`` CLI.

Nothing here is imported by a case or an adapter; the runner reaches adapters
by name through :mod:`conformance.contract.registry`.
"""
