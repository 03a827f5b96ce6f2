"""Tests of :mod:`harness.collectives`."""
