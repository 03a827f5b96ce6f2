"""FSDP conformance cases, adapters and the matrix report."""
