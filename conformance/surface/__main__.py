"""``python -m conformance.surface --write docs/SURFACE.md`` or ``--check docs/SURFACE.md``.

``--write`` renders the classification to the page; both first compare the classification with the
installed torch (:func:`conformance.surface.compare.problems`) and exit 1 listing what disagrees.
``--check`` also exits 1 when the page differs from what ``--write`` would write.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.surface", description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", type=Path, metavar="PAGE", help="write the surface table to PAGE")
    action.add_argument("--check", type=Path, metavar="PAGE", help="exit 1 unless PAGE is up to date")
    args = parser.parse_args(argv)

    import torch

    from conformance.surface.classification import load
    from conformance.surface.collect import installed_surfaces
    from conformance.surface.compare import problems
    from conformance.surface.render import coverage, render

    surfaces = load()
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    found = problems(surfaces, installed_surfaces(), (major, minor))
    for line in found:
        print(f"error: {line}", file=sys.stderr)
    page = render(surfaces)
    if args.write is not None:
        if found:
            return 1
        args.write.write_text(page)
        print("\n".join(coverage(surface) for surface in surfaces))
        return 0
    if not args.check.is_file() or args.check.read_text() != page:
        print(f"error: {args.check} is not the generator's output; run python -m conformance.surface --write "
              f"{args.check}", file=sys.stderr)
        return 1
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
