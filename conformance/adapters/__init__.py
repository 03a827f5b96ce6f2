"""The built-in adapters, registered by name in ``pyproject.toml``'s ``fsdp_conformance.adapters`` entry points."""
