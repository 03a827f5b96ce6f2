"""Tests of :mod:`harness.plugin`."""
