"""Which nodes of a module's AST may be mutated: the code that runs, less what no mutant of says anything about.

Left out, with everything beneath them: docstrings, logging and warning calls,
``assert`` statements, type annotations, the body of ``if TYPE_CHECKING:``,
f-strings (their parts are messages) and ``match`` patterns (a pattern is no
expression, so a mutated one would not compile). The walk is depth first, a
node's children in the AST's field order, so the same source always yields the
same nodes in the same order.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

__all__ = ["is_log_call", "is_type_checking", "mutable_nodes"]

#: ``<receiver>.<method>(...)`` calls that only log or warn.
_LOG_RECEIVERS = frozenset({"logger", "log", "logging", "_logger", "warnings", "torch_log"})
_LOG_METHODS = frozenset({"debug", "info", "warning", "warn", "error", "exception", "critical", "log",
                          "warning_once", "info_once", "warn_once"})
#: Bare names of functions that only warn or log.
_LOG_FUNCTIONS = frozenset({"warn", "warning", "warn_once", "trace_structured"})


def _dotted(node: ast.expr) -> str:
    """``a.b.c`` for a chain of attributes over a name, else ``""``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def is_log_call(node: ast.AST) -> bool:
    """Whether ``node`` is a call that only logs or warns (``logger.debug(...)``, ``warnings.warn(...)``)."""
    if not isinstance(node, ast.Call):
        return False
    name = _dotted(node.func)
    if name in _LOG_FUNCTIONS:
        return True
    receiver, _, method = name.rpartition(".")
    return method in _LOG_METHODS and receiver.rpartition(".")[2] in _LOG_RECEIVERS


def is_type_checking(node: ast.AST) -> bool:
    """Whether ``node`` is ``if TYPE_CHECKING:`` (or ``if typing.TYPE_CHECKING:``)."""
    return isinstance(node, ast.If) and _dotted(node.test).rpartition(".")[2] == "TYPE_CHECKING"


def _is_docstring(node: ast.AST) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str))


def _skipped(node: ast.AST) -> bool:
    return (isinstance(node, ast.Assert | ast.JoinedStr | ast.pattern) or _is_docstring(node)
            or is_log_call(node) or (isinstance(node, ast.Expr) and is_log_call(node.value)))


def _children(node: ast.AST) -> Iterator[ast.AST]:
    """The children of ``node`` the walk descends into: annotations and TYPE_CHECKING bodies left out."""
    if is_type_checking(node):
        assert isinstance(node, ast.If)
        yield from node.orelse
        return
    for field, value in ast.iter_fields(node):
        if field in ("annotation", "returns", "type_comment", "type_params"):
            continue
        if isinstance(value, ast.AST):
            yield value
        elif isinstance(value, list):
            yield from (item for item in value if isinstance(item, ast.AST))


def mutable_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree`` that an operator may mutate, depth first, children in the AST's field order."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if _skipped(node):
            continue
        yield node
        stack.extend(reversed(list(_children(node))))
