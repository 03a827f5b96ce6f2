"""A fake installed distribution for the tests that load adapters or findings through entry points."""

from __future__ import annotations

from pathlib import Path

__all__ = ["fake_distribution"]


def fake_distribution(site: Path, name: str, version: str, entry_points: str,
                      package: tuple[str, str] | None = None) -> Path:
    """Write ``name``'s ``.dist-info`` (METADATA and ``entry_points`` as its entry_points.txt) under ``site``, and
    ``package`` (an import name and its ``__init__`` source) beside it: on ``sys.path``, ``site`` is as if ``name``
    were installed there. Returns ``site``."""
    if package is not None:
        (site / package[0]).mkdir(parents=True)
        (site / package[0] / "__init__.py").write_text(package[1])
    dist = site / f"{name.replace('-', '_')}-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (dist / "entry_points.txt").write_text(entry_points)
    return site
