"""Tests of :mod:`conformance.selftest`."""
