"""A minimal, readable reference implementation of Fully Sharded Data Parallel."""
