"""Tests of :mod:`conformance.runner`."""
