"""Every mutant of a module, each with a stable id; its mutated source; a seeded sample of them.

A mutant's id is ``module:line:col:operator:before -> after`` (line 1-based,
column 0-based, of the replaced node). Enumeration walks the AST in source order
(:func:`~conformance.selftest.torch_mutants.sites.mutable_nodes`) and runs the
operators in a fixed order, so the same source always yields the same list,
and :func:`sample` draws from it with its own ``random.Random(seed)``.
"""

from __future__ import annotations

import ast
import random
from dataclasses import dataclass

from conformance.selftest.torch_mutants.operators import OPERATORS
from conformance.selftest.torch_mutants.sites import mutable_nodes

__all__ = ["PROBE", "Mutant", "apply", "enumerate_mutants", "sample"]

#: The name a probed mutant calls where its replacement runs; the injecting
#: loader defines it in the module ([Note: torch mutants] in ``__init__``). A
#: dunder name, so a class body does not mangle it.
PROBE = "__fsdp_mutant_hit__"


@dataclass(frozen=True)
class Mutant:
    """One mutation of one module: the span ``(line, col)``-``(end_line, end_col)`` of its source becomes ``text``."""

    module: str
    line: int
    col: int
    end_line: int
    end_col: int
    operator: str
    before: str
    after: str
    text: str

    @property
    def id(self) -> str:
        return f"{self.module}:{self.line}:{self.col}:{self.operator}:{self.before} -> {self.after}"


def enumerate_mutants(source: str, module: str) -> list[Mutant]:
    """Every mutant of ``source`` (the text of module ``module``), in source order."""
    tree = ast.parse(source)
    out = []
    for node in mutable_nodes(tree):
        for operator in OPERATORS:
            for edit in operator(node, source):
                target = edit.node
                assert target.end_lineno is not None and target.end_col_offset is not None
                out.append(Mutant(module, target.lineno, target.col_offset, target.end_lineno,
                                  target.end_col_offset, edit.operator, edit.before, edit.after, edit.text))
    return out


def _offset(lines: list[str], line: int, col: int) -> int:
    """The character offset of ``(line, col)`` in the ``\\n``-split ``lines``; ``col`` counts UTF-8 bytes,
    as the AST's offsets do."""
    return sum(len(lines[i]) + 1 for i in range(line - 1)) + len(lines[line - 1].encode()[:col].decode())


def apply(source: str, mutant: Mutant, probe: bool = False) -> str:
    """``source`` with ``mutant``'s span replaced; with ``probe``, the replacement first calls :data:`PROBE`.

    The replacement is ``(X)``, or ``(__fsdp_mutant_hit__() or (X))`` (the probe
    returns ``None``, so the value is X's), padded with newlines inside the
    parentheses to the span's line count.
    """
    lines = source.split("\n")
    start, end = _offset(lines, mutant.line, mutant.col), _offset(lines, mutant.end_line, mutant.end_col)
    body = f"{PROBE}() or ({mutant.text})" if probe else mutant.text
    padding = "\n" * max(0, (mutant.end_line - mutant.line) - body.count("\n"))
    return f"{source[:start]}({body}{padding}){source[end:]}"


def sample(mutants: list[Mutant], size: int, seed: int) -> list[Mutant]:
    """``size`` mutants drawn with ``random.Random(seed)`` (all of them when there are fewer), in list order."""
    if size >= len(mutants):
        return list(mutants)
    chosen = set(random.Random(seed).sample(range(len(mutants)), size))
    return [mutant for i, mutant in enumerate(mutants) if i in chosen]
