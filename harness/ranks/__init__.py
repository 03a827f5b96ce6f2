"""Running a body on ranks: process ranks (a pool of spawned processes), thread ranks (threads of a host
process), launched ranks (this process is one rank of a torchrun job), their placement, outcomes and failures.
``runner`` (``harness.run``) is the entry point."""
