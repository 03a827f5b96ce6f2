"""The mutation operators: each turns one AST node into the text that replaces it in the source.

A mutant replaces the exact source span of one expression node (the whole
call of a deleted statement, the value of a ``return``) with new text in
parentheses, padded with newlines to the span's line count: every other byte of
the module is unchanged, so line numbers in tracebacks still point at the
installed file. The operators:

==============  ===========================================================
``compare``     ``==``/``!=``, ``<``/``>=``, ``>``/``<=``, ``is``/``is not``, ``in``/``not in``
``negate``      the condition of an ``if``, ``while`` or ternary becomes ``not (...)`` (unless it is one
                comparison: that is ``compare``'s mutant)
``bool``        ``True``/``False``
``int``         an integer constant ``n`` becomes ``n + 1`` and ``n - 1`` (``0`` only ``1``)
``arith``       ``+``/``-``, ``*``/``/`` (not where an operand is a string, sequence or f-string literal)
``boolop``      ``and``/``or``
``delete``      a statement that is a bare call (``x.wait()``) becomes ``pass``
``return``      ``return X`` becomes ``return None`` (X not ``None``)
==============  ===========================================================
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from conformance.selftest.torch_mutants.sites import is_type_checking

__all__ = ["OPERATORS", "Edit", "short"]

_COMPARE_FLIPS: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt,
    ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In,
}
_ARITH_SWAPS: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
}
#: Operand literals that make ``+``/``*`` a concatenation or repetition, not arithmetic.
_NOT_SCALARS = (ast.JoinedStr, ast.List, ast.Tuple, ast.ListComp, ast.Dict, ast.Set)
#: Longest ``before``/``after`` text in a mutant's id.
SHORT = 48


@dataclass(frozen=True)
class Edit:
    """One mutation of one node: ``node``'s span becomes ``text`` (an expression)."""

    operator: str
    node: ast.expr
    before: str
    after: str
    text: str


def short(text: str) -> str:
    """``text`` on one line, cut to :data:`SHORT` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= SHORT else flat[: SHORT - 3] + "..."


def _compare(node: ast.AST, source: str) -> Iterator[Edit]:
    if not isinstance(node, ast.Compare):
        return
    for i, op in enumerate(node.ops):
        flipped = _COMPARE_FLIPS[type(op)]()
        new = ast.Compare(left=node.left, ops=[*node.ops[:i], flipped, *node.ops[i + 1:]],
                          comparators=node.comparators)
        text = ast.unparse(new)
        yield Edit("compare", node, short(ast.unparse(node)), short(text), text)


def _negate(node: ast.AST, source: str) -> Iterator[Edit]:
    if not isinstance(node, ast.If | ast.While | ast.IfExp) or is_type_checking(node):
        return
    if isinstance(node.test, ast.Compare) and len(node.test.ops) == 1:
        return  # the same mutant as the comparison's flip
    segment = ast.get_source_segment(source, node.test)
    if segment is None:
        return
    text = f"not ({segment})"
    yield Edit("negate", node.test, short(segment), short(text), text)


def _constant(node: ast.AST, source: str) -> Iterator[Edit]:
    if not isinstance(node, ast.Constant):
        return
    value = node.value
    if isinstance(value, bool):
        yield Edit("bool", node, repr(value), repr(not value), repr(not value))
    elif isinstance(value, int):
        for new in (value + 1, value - 1) if value != 0 else (1,):
            yield Edit("int", node, repr(value), repr(new), repr(new))


def _arith(node: ast.AST, source: str) -> Iterator[Edit]:
    if not isinstance(node, ast.BinOp) or type(node.op) not in _ARITH_SWAPS:
        return
    if any(isinstance(side, _NOT_SCALARS) or (isinstance(side, ast.Constant) and isinstance(side.value, str | bytes))
           for side in (node.left, node.right)):
        return
    new = ast.BinOp(left=node.left, op=_ARITH_SWAPS[type(node.op)](), right=node.right)
    text = ast.unparse(new)
    yield Edit("arith", node, short(ast.unparse(node)), short(text), text)


def _boolop(node: ast.AST, source: str) -> Iterator[Edit]:
    if not isinstance(node, ast.BoolOp):
        return
    new = ast.BoolOp(op=ast.Or() if isinstance(node.op, ast.And) else ast.And(), values=node.values)
    text = ast.unparse(new)
    yield Edit("boolop", node, short(ast.unparse(node)), short(text), text)


def _delete(node: ast.AST, source: str) -> Iterator[Edit]:
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        yield Edit("delete", node.value, short(ast.unparse(node.value)), "pass", "None")


def _return(node: ast.AST, source: str) -> Iterator[Edit]:
    if not isinstance(node, ast.Return) or node.value is None:
        return
    if isinstance(node.value, ast.Constant) and node.value.value is None:
        return
    yield Edit("return", node.value, short(f"return {ast.unparse(node.value)}"), "return None", "None")


#: Every operator, in the order a node's mutants are listed.
OPERATORS: tuple[Callable[[ast.AST, str], Iterator[Edit]], ...] = (
    _compare, _negate, _constant, _arith, _boolop, _delete, _return,
)
