"""Moved to :mod:`conformance.fuzz.parity_run`: this path imports, with a ``DeprecationWarning``, until it goes
([Note: moved modules] in :mod:`conformance.contract.moved`)."""

from conformance.contract.moved import alias

alias(__name__)
