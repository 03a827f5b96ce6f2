"""pytest integration for the multi-rank harness."""
