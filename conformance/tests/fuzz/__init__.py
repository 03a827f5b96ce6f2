"""Tests of :mod:`conformance.fuzz`."""
