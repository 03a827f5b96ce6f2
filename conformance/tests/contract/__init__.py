"""Tests of :mod:`conformance.contract`."""
