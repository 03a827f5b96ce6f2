"""Tests of what the cases share: the reference's collective trace for a hybrid configuration (a golden)
and the baseline cache (:mod:`fixtures.baselines`)."""
