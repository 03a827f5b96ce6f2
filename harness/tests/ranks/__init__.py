"""Tests of :mod:`harness.ranks`."""
