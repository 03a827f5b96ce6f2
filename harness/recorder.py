"""Intercepting ``torch.distributed`` collectives: record, delay, or fail them.

[Note: collective patching]
FSDP implementations call collectives through the ``torch.distributed``
module attribute at call time, so swapping those attributes (and the same
names in ``distributed_c10d``) intercepts them. :func:`patch_collectives`
installs a wrapper that hands ``(op, fn, args, kwargs)`` to an interceptor
which decides how to call the real function; :func:`record` builds on it.

Under thread ranks the attributes are process-global while ranks are
threads: the swap happens once, between two barriers (so no rank is inside a
collective while another swaps), reference-counted, and the wrapper routes
each call to the interceptor registered by the *calling thread's* rank.

Canonical op names, stable across torch versions: ``all_gather_into_tensor``
(for ``all_gather_single`` too), ``reduce_scatter_tensor`` (for
``reduce_scatter_single``), ``all_reduce``, ``broadcast``, ``all_gather``
(list form), ``reduce_scatter`` (list form). ``bytes`` is the input's size:
the local shard for all-gathers, the full unsharded tensor for
reduce-scatters, the tensor for all-reduce/broadcast.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["CANONICAL", "Call", "Trace", "Interceptor", "Observer", "intercepting", "observe_thread", "observing",
           "patch_collectives", "record"]

#: torch name -> canonical op name; only names present in the installed torch are patched.
CANONICAL = {
    "all_gather_single": "all_gather_into_tensor",
    "all_gather_into_tensor": "all_gather_into_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "reduce_scatter_tensor": "reduce_scatter_tensor",
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
}
# Name of the input parameter in each collective's signature.
_INPUT_PARAM = {"all_gather_single": "input", "all_gather_into_tensor": "input_tensor",
                "reduce_scatter_single": "input", "reduce_scatter_tensor": "input",
                "all_reduce": "tensor", "broadcast": "tensor", "all_gather": "tensor",
                "reduce_scatter": "input_list"}


class Interceptor(Protocol):
    def __call__(self, op: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...


@dataclass(frozen=True)
class Call:
    op: str
    group_ranks: tuple[int, ...]
    bytes: int
    dtype: str
    reduce_op: str | None
    async_op: bool


@dataclass
class Trace:
    """One rank's recorded collectives, in call order."""

    calls: list[Call] = field(default_factory=list)

    def count(self, op: str, group_ranks: tuple[int, ...] | list[int] | None = None) -> int:
        ranks = None if group_ranks is None else tuple(group_ranks)
        return sum(1 for c in self.calls if c.op == op and (ranks is None or c.group_ranks == ranks))

    def bytes(self, op: str | None = None) -> int:
        return sum(c.bytes for c in self.calls if op is None or c.op == op)

    def render(self) -> str:
        """Stable text, one call per line, for expecttest goldens."""
        lines = []
        for c in self.calls:
            red = f" {c.reduce_op}" if c.reduce_op else ""
            mode = " async" if c.async_op else ""
            lines.append(f"{c.op}{red} group={list(c.group_ranks)} {c.dtype} {c.bytes}B{mode}")
        return "\n".join(lines)


# -- the process-wide patch ----------------------------------------------------------
_lock = threading.Lock()
_by_thread: dict[int, Interceptor] = {}
_originals: dict[str, Any] = {}
_depth = 0
_nesting = threading.local()


class Observer(Protocol):
    """Told of each collective this thread enters and how it left (:mod:`harness.sequence`)."""

    def entered(self, op: str) -> None: ...

    def left(self, *, raised: bool) -> None: ...


_observers: dict[int, Observer] = {}


def _wrapper(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    op = CANONICAL[name]

    def intercepted(*args: Any, **kwargs: Any) -> Any:
        ident = threading.get_ident()
        interceptor, observer = _by_thread.get(ident), _observers.get(ident)
        if (interceptor is None and observer is None) or getattr(_nesting, "inside", False):
            # Deprecated names forward to the new ones (all_gather_into_tensor ->
            # all_gather_single): only the outermost call is one collective.
            return original(*args, **kwargs)
        _nesting.inside = True
        if observer is not None:
            observer.entered(op)
        raised = True
        try:
            value = original(*args, **kwargs) if interceptor is None else interceptor(op, original, args, kwargs)
            raised = False
            return value
        finally:
            _nesting.inside = False
            if observer is not None:
                observer.left(raised=raised)

    intercepted.__wrapped__ = original  # type: ignore[attr-defined]
    intercepted.__name__ = name
    return intercepted


def _install() -> None:
    global _depth
    with _lock:
        if _depth == 0:
            for name in CANONICAL:
                if hasattr(dist, name):
                    _originals[name] = getattr(dist, name)
                    wrapped = _wrapper(name, _originals[name])
                    setattr(dist, name, wrapped)
                    if hasattr(c10d, name):
                        setattr(c10d, name, wrapped)
        _depth += 1


def _uninstall() -> None:
    global _depth
    with _lock:
        _depth -= 1
        if _depth == 0:
            for name, original in _originals.items():
                setattr(dist, name, original)
                if hasattr(c10d, name):
                    setattr(c10d, name, original)
            _originals.clear()


@contextmanager
def observing() -> Iterator[None]:
    """Keep the collectives patched inside the block, so :func:`observe_thread` observers are told.

    Not collective: the caller makes sure no rank is inside a collective while the
    attributes are swapped (a rank process before its first task; a thread host
    before its rank threads start).
    """
    _install()
    try:
        yield
    finally:
        _uninstall()


def intercepting() -> bool:
    """Whether an interceptor sees the calling thread's collectives (an observer only counts them)."""
    return threading.get_ident() in _by_thread


def observe_thread(observer: Observer | None) -> None:
    """Tell ``observer`` of the calling thread's collectives from now on (``None``: stop) inside :func:`observing`."""
    if observer is None:
        _observers.pop(threading.get_ident(), None)
    else:
        _observers[threading.get_ident()] = observer


@contextmanager
def patch_collectives(interceptor: Interceptor, *, barrier: bool = True) -> Iterator[None]:
    """Route this thread's collectives through ``interceptor`` inside the block.

    With ``barrier`` (the default) every rank must enter and leave together:
    the swap sits between barriers ([Note: collective patching]).
    """
    ident = threading.get_ident()
    if barrier:
        dist.barrier()
    _install()
    _by_thread[ident] = interceptor
    clean_exit = False
    try:
        if barrier:
            dist.barrier()
        yield
        if barrier:
            dist.barrier()
        clean_exit = True
    finally:
        # Always unpatch this rank, even if the block failed; only a clean exit
        # synchronises with the other ranks (after a failure they may never arrive).
        _by_thread.pop(ident, None)
        _uninstall()
    if clean_exit and barrier:
        dist.barrier()


@functools.cache
def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(fn)


def _describe(op: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
    bound = _signature(fn).bind_partial(*args, **kwargs).arguments
    name = fn.__name__
    inp = bound.get(_INPUT_PARAM.get(name, ""))
    if inp is None:  # a renamed parameter in some torch version: take the second tensor-ish argument
        inp = next((v for v in list(bound.values())[1:2]), None)
    tensors = inp if isinstance(inp, (list, tuple)) else [inp]
    size = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    dtype = next((str(t.dtype).removeprefix("torch.") for t in tensors if isinstance(t, torch.Tensor)), "?")
    group = bound.get("group")
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
    reduce_op = bound.get("op")
    if reduce_op is None and op in ("all_reduce", "reduce_scatter_tensor", "reduce_scatter"):
        reduce_op = dist.ReduceOp.SUM
    red = None if reduce_op is None else _op_name(reduce_op)
    return Call(op, ranks, size, dtype, red, bool(bound.get("async_op", False)))


def _op_name(reduce_op: Any) -> str:
    text = str(reduce_op)
    return text.rsplit(".", 1)[-1].removeprefix("RedOpType.")


@contextmanager
def record(ctx: Any = None, *, delay_s: float = 0.0, fail: str | None = None) -> Iterator[Trace]:
    """Record this rank's collectives; optionally sleep ``delay_s`` before each, or raise on op ``fail``.

    Collective: every rank must enter and leave the block together.
    """
    trace = Trace()

    def interceptor(op: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        trace.calls.append(_describe(op, fn, args, kwargs))
        if fail == op:
            raise RuntimeError(f"injected failure in {op} (record_collectives(fail={fail!r}))")
        if delay_s:
            time.sleep(delay_s)
        return fn(*args, **kwargs)

    with patch_collectives(interceptor):
        yield trace
