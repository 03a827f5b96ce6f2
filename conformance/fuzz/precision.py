"""Moved to :mod:`conformance.fuzz.drawn_precision`: this path imports, with a ``DeprecationWarning``, until it goes
([Note: moved modules] in :mod:`conformance.contract.moved`)."""

from conformance.contract.moved import alias

alias(__name__)
