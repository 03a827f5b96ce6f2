"""Run one test body on N ranks, as spawned processes or as threads in one process."""
