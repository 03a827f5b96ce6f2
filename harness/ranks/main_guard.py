"""Refuse, before anything starts, a ``harness.run`` call that every rank process would make again.

[Note: main-module guard]
Rank processes and thread hosts start by forkserver or spawn
([Note: process start] in :mod:`harness.ranks.process`), which import the main
module of the parent again in each child (as ``__mp_main__``). A script
calling ``harness.run`` at its top level without the
``if __name__ == "__main__":`` idiom therefore makes every child call it
again while bootstrapping; the children exit, and all the parent can tell is
that its ranks (or its thread host) died. So the parent checks first: if the
call comes from the main module's top-level code (directly, or through the
functions it calls) and that line is not inside an ``if __name__ ==
"__main__":`` block, the call is refused with the standard advice. What the
children do not re-import is not checked, as multiprocessing decides it: a
main module without a source file (``python -c``, a REPL, a notebook) and a
package's ``__main__`` (``python -m conformance``).
"""

from __future__ import annotations

import ast
import functools
import sys
from types import FrameType

__all__ = ["check_main_guard"]


def _top_level_frame_of_main(frame: FrameType | None) -> FrameType | None:
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            return frame
        frame = frame.f_back
    return None


def _is_main_test(node: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not isinstance(node, ast.Compare) or len(node.ops) != 1 or not isinstance(node.ops[0], ast.Eq):
        return False
    sides = [node.left, node.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    constants = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and constants == ["__main__"]


@functools.cache
def _guarded_lines(path: str) -> tuple[tuple[int, int], ...]:
    """Line ranges of the ``if __name__ == "__main__":`` bodies of the file at ``path``."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, UnicodeDecodeError):
        return ((1, sys.maxsize),)  # cannot tell: do not refuse
    return tuple((node.body[0].lineno, node.end_lineno or sys.maxsize) for node in ast.walk(tree)
                 if isinstance(node, ast.If) and _is_main_test(node.test))


def check_main_guard(start_method: str) -> None:
    """Raise ``RuntimeError`` with the spawn advice if the main module calls ``harness.run`` unguarded."""
    if start_method == "fork":
        return
    frame = _top_level_frame_of_main(sys._getframe(1))
    path = frame.f_globals.get("__file__") if frame is not None else None
    if frame is None or not isinstance(path, str) or path.startswith("<"):
        return
    spec_name = getattr(frame.f_globals.get("__spec__"), "name", None) or ""
    if spec_name == "__main__" or spec_name.endswith(".__main__"):
        return  # multiprocessing's children skip a package's __main__
    line = frame.f_lineno
    if any(first <= line <= last for first, last in _guarded_lines(path)):
        return
    raise RuntimeError(
        f"{path}:{line} calls harness.run from the main module's top level without the "
        f"`if __name__ == \"__main__\":` idiom. Rank processes and thread hosts start with {start_method}, which "
        "imports the main module again in every child, so each would run this call again while bootstrapping. "
        "Put the call under `if __name__ == \"__main__\":` (the standard idiom for multiprocessing's spawn and "
        "forkserver start methods; see 'Safe importing of main module' in the multiprocessing docs).")
