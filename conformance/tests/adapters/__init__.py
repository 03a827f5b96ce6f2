"""Tests of :mod:`conformance.adapters`."""
