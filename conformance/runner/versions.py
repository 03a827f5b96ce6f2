"""What software a run used: this suite's version, and the distribution package each adapter comes from.

The JSON report records both (``tool_version``, ``adapters``; ``docs/REPORTS.md``) and
``fsdp-conformance --version`` prints the suite's, torch's and Python's versions.
A module that no installed distribution provides (an adapter registered with
``FSDP_CONFORMANCE_ADAPTERS`` from a source tree) has ``distribution`` and
``version`` ``None``: the report says it does not know rather than guessing.
"""

from __future__ import annotations

import platform
from collections.abc import Mapping
from functools import cache
from importlib import metadata
from typing import Any

__all__ = ["DISTRIBUTION", "adapter_facts", "distribution_of", "suite_version", "version_text"]

#: This suite's distribution package (``pyproject.toml``'s ``name``).
DISTRIBUTION = "fsdp-conformance"


def suite_version() -> str:
    """This suite's installed version, or ``"unknown"`` when it runs from a tree that was never installed."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"


@cache
def _providers() -> Mapping[str, list[str]]:
    return metadata.packages_distributions()


def distribution_of(module: str) -> tuple[str | None, str | None]:
    """The distribution that provides ``module`` (dotted name) and its version; ``(None, None)`` if none does."""
    names = list(dict.fromkeys(_providers().get(module.partition(".")[0], [])))
    if not names:
        return None, None
    try:
        return names[0], metadata.version(names[0])
    except metadata.PackageNotFoundError:
        return names[0], None


def adapter_facts(names: tuple[str, ...] | list[str]) -> list[dict[str, Any]]:
    """Per adapter, in the run's order: ``name``, ``target`` (``module:Class``), ``distribution`` and
    ``version`` of the package its module comes from (``None`` when unknown or the name is not registered)."""
    from conformance.contract import registry

    entries = registry.registered()
    facts = []
    for name in names:
        target = entries[name].target if name in entries else None
        dist, version = distribution_of(target.partition(":")[0]) if target else (None, None)
        facts.append({"name": name, "target": target, "distribution": dist, "version": version})
    return facts


def version_text() -> str:
    """What ``fsdp-conformance --version`` prints, e.g. ``fsdp-conformance 0.1.0 (torch 2.13.0+cpu, Python 3.11.7)``."""
    try:
        import torch

        torch_version = str(torch.__version__)
    except ImportError:
        torch_version = "not installed"
    return f"{DISTRIBUTION} {suite_version()} (torch {torch_version}, Python {platform.python_version()})"
