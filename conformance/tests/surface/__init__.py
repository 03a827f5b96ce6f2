"""Tests of :mod:`conformance.surface`."""
