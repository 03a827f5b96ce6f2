"""Shared plumbing for the benchmark scripts: argument defaults, tables, JSON, plots.

[Note: benchmark honesty]
These machines are noisy and shared. Every script measures the things it
compares side by side in one run, interleaved where possible, reports medians
of repeated measurements after a warm-up, and prints ratios rather than
absolute claims. No unit test asserts a wall-clock number.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["base_parser", "machine", "warn_without_bytecode_cache", "median", "print_table", "write_json", "save_plot"]

REPORTS = Path("reports")


def base_parser(name: str, doc: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m bench.{name}", description=doc.splitlines()[0])
    parser.add_argument("--json", type=Path, default=REPORTS / f"{name}.json", help="where to write results")
    parser.add_argument("--plot", type=Path, default=None, help="also write a PNG plot here (needs matplotlib)")
    return parser


def machine() -> dict[str, Any]:
    """What the figures were taken on."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        # Without a bytecode cache every interpreter a run starts compiles the modules it imports
        # (torch's among them when it was installed without pip's compile step) from source.
        "bytecode_cache": not sys.flags.dont_write_bytecode,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else [],
    }


def warn_without_bytecode_cache() -> None:
    """Say on stderr when ``PYTHONDONTWRITEBYTECODE`` is set: the figures then include compiling from source."""
    if sys.flags.dont_write_bytecode:
        print("warning: PYTHONDONTWRITEBYTECODE is set, so every interpreter of these runs compiles the modules "
              "it imports from source; a user's machine and .ci/run cache bytecode (unset it to measure that)",
              file=sys.stderr)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    texts = [[f"{v:.4g}" if isinstance(v, float) else str(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in texts)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in texts:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
    print(f"wrote {path}")


def save_plot(path: Path, draw: Any) -> None:
    """Call ``draw(ax)`` on a fresh figure and save it; a clear error without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the optional extra
        raise SystemExit(f"--plot needs matplotlib: pip install -e '.[bench]' ({exc})") from exc
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    draw(ax)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    print(f"wrote {path}")
