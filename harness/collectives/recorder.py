"""Intercepting collectives: record, delay, or fail them.

[Note: collective patching]
Every collective an implementation issues is handed to an interceptor as
``(kind, fn, args, kwargs)``: ``kind`` is the canonical name below, ``fn`` the
real function or op, and the interceptor decides how (and when) to call it.
Two layers deliver them, and each call reaches exactly one
([Note: observing collectives] in :mod:`harness.collectives.observe` says why):

- the dispatcher, through :class:`harness.collectives.observe.CollectiveMode`, pushed on
  the calling thread: ``torch.ops.c10d.*`` (which every ``torch.distributed``
  function reaches on a C++ group) and the functional collectives DTensor uses;
- the ``torch.distributed`` functions, swapped (wherever a loaded module holds
  one under its own name: ``distributed_c10d``, DTensor's collective utilities,
  an implementation's ``from torch.distributed import all_reduce``) for
  wrappers that intercept a call only when its group
  is a Python ``ProcessGroup`` subclass (thread ranks' threaded group), whose
  collectives never reach the dispatcher; any other call passes through to
  the dispatcher, where the mode sees it.

Under thread ranks the attributes are process-global while ranks are
threads: the swap happens once, between two barriers (so no rank is inside a
collective while another swaps), reference-counted, and the wrapper routes
each call to the interceptor registered by the *calling thread's* rank.

Canonical kinds, stable across torch versions and layers: ``all_gather_into_tensor``
(``all_gather_single``, ``_all_gather_base``, ``c10d::_allgather_base_``, the
functional ``all_gather_into_tensor`` and their coalesced forms),
``reduce_scatter_tensor`` (likewise), ``all_reduce``, ``broadcast``,
``all_gather`` and ``reduce_scatter`` (list forms), ``all_to_all_single``,
``all_to_all``, ``scatter``, ``gather``, ``reduce``. ``bytes`` is the input's
size: the local shard for all-gathers, the full unsharded tensor for
reduce-scatters, the tensor for all-reduce/broadcast; a coalesced call's is the
sum over its tensors.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import time
import types
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from harness.collectives.observe import (
    CollectiveMode,
    bind,
    group_name,
    group_ranks,
    op_info,
    process_group,
    reduce_op_name,
    tensors_in,
)

__all__ = ["CANONICAL", "Call", "Trace", "Interceptor", "Observer", "describe", "intercepting", "observe_thread",
           "observing", "patch_collectives", "record"]

#: torch.distributed name -> canonical kind; only names present in the installed torch are patched.
CANONICAL = {
    "all_gather_single": "all_gather_into_tensor",
    "all_gather_into_tensor": "all_gather_into_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "reduce_scatter_tensor": "reduce_scatter_tensor",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "broadcast": "broadcast",
    "all_gather": "all_gather",
    "all_gather_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "all_to_all_single": "all_to_all_single",
    "all_to_all": "all_to_all",
    "scatter": "scatter",
    "gather": "gather",
    "reduce": "reduce",
}
# Name of the input parameter in each torch.distributed collective's signature.
_INPUT_PARAM = {"all_gather_single": "input_tensor", "all_gather_into_tensor": "input_tensor",
                "reduce_scatter_single": "input", "reduce_scatter_tensor": "input",
                "all_reduce": "tensor", "all_reduce_coalesced": "tensors", "broadcast": "tensor",
                "all_gather": "tensor", "all_gather_coalesced": "input_tensor_list", "reduce_scatter": "input_list",
                "all_to_all_single": "input", "all_to_all": "input_tensor_list", "scatter": "scatter_list",
                "gather": "tensor", "reduce": "tensor"}
_REDUCING = frozenset({"all_reduce", "reduce_scatter_tensor", "reduce_scatter", "reduce"})


class Interceptor(Protocol):
    def __call__(self, op: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...


@dataclass(frozen=True)
class Call:
    """One collective as the issuing rank saw it (``layer``, ``rank`` and ``group_name`` are not rendered)."""

    op: str
    group_ranks: tuple[int, ...]
    bytes: int
    dtype: str
    reduce_op: str | None
    async_op: bool
    #: Where it was seen: ``torch.distributed`` (a Python group), ``c10d`` or ``functional`` (dispatcher ops).
    layer: str = "torch.distributed"
    #: The issuing rank (global).
    rank: int = -1
    #: The group's c10d name: which group object, where ``group_ranks`` cannot tell two of the same ranks apart.
    group_name: str = ""


@dataclass
class Trace:
    """One rank's recorded collectives, in call order."""

    calls: list[Call] = field(default_factory=list)

    def count(self, op: str, group_ranks: tuple[int, ...] | list[int] | None = None) -> int:
        ranks = None if group_ranks is None else tuple(group_ranks)
        return sum(1 for c in self.calls if c.op == op and (ranks is None or c.group_ranks == ranks))

    def require(self, ops: Collection[str], what: str) -> list[Call]:
        """The calls of kinds ``ops``; none at all fails with ``what`` and why nothing can be checked then.

        For a check that asserts the *absence* of collectives somewhere: it
        proves something only if the same implementation's collectives are
        seen where they must happen.
        """
        calls = [c for c in self.calls if c.op in ops]
        assert calls, (f"{what}: no {'/'.join(sorted(ops))} was observed, so no collective of this implementation "
                       f"can be checked (seen: torch.distributed calls, torch.ops.c10d ops and functional "
                       f"collectives; {len(self.calls)} other call(s) recorded)")
        return calls

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


# -- the process-wide patch of the torch.distributed functions ----------------------------
_lock = threading.Lock()
_by_thread: dict[int, Interceptor] = {}
_swapped: list[tuple[types.ModuleType, str, Any]] = []
#: Modules whose namespace :func:`_install` has searched since the wrappers went in, by name.
_reached: dict[str, Any] = {}
_depth = 0
_nesting = threading.local()


def _python_group(group: Any) -> bool:
    """Whether ``group``'s collectives are Python methods, which never reach the dispatcher."""
    if group is None:
        group = c10d._get_default_group()
    return isinstance(inspect.getattr_static(type(group), "allreduce", None), types.FunctionType)


class Observer(Protocol):
    """Told of each collective this thread enters and how it left (:mod:`harness.collectives.sequence`)."""

    def entered(self, op: str) -> None: ...

    def left(self, *, raised: bool) -> None: ...


_observers: dict[int, Observer] = {}


def _observed(observer: Observer, op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` telling ``observer`` when the rank enters and leaves it: only the real collective counts,
    not an interceptor's work around it (an injected failure raised before ``fn`` never entered it)."""

    @functools.wraps(fn)  # describe() reads the name and the signature
    def call(*args: Any, **kwargs: Any) -> Any:
        observer.entered(op)
        raised = True
        try:
            value = fn(*args, **kwargs)
            raised = False
            return value
        finally:
            observer.left(raised=raised)

    return call


def _wrapper(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    op = CANONICAL[name]

    def intercepted(*args: Any, **kwargs: Any) -> Any:
        ident = threading.get_ident()
        interceptor, observer = _by_thread.get(ident), _observers.get(ident)
        if (interceptor is None and observer is None) or getattr(_nesting, "inside", False):
            # Deprecated names forward to the new ones (all_gather_into_tensor ->
            # all_gather_single): only the outermost call is one collective.
            return original(*args, **kwargs)
        if interceptor is not None and not _python_group(
                _signature(original).bind_partial(*args, **kwargs).arguments.get("group")):
            interceptor = None  # reaches the dispatcher: CollectiveMode sees it
        real = original if observer is None else _observed(observer, op, original)
        _nesting.inside = True
        try:
            return real(*args, **kwargs) if interceptor is None else interceptor(op, real, args, kwargs)
        finally:
            _nesting.inside = False

    intercepted.__wrapped__ = original  # type: ignore[attr-defined]
    intercepted.__name__ = name
    return intercepted


_originals: dict[str, Any] = {}
_wrapped: dict[int, Callable[..., Any]] = {}


def _install() -> None:
    """Swap in the wrappers (first call) and reach modules loaded since (every call).

    Every module that holds a collective under its own name (``distributed_c10d``,
    DTensor's ``from torch.distributed.distributed_c10d import scatter``, an
    implementation's ``from torch.distributed import all_reduce``) gets the wrapper;
    rank processes keep the wrappers installed for their whole life (:func:`observing`),
    so a module imported by a case is reached when the case's first block starts.

    [Note: modules reached once]
    Searching all ~2,300 loaded modules took 6.7 ms per recorded block and rank (about 1,050
    blocks in the main job), so each module is searched once while the wrappers are in. It
    cannot gain an original later: importing a collective from ``torch.distributed`` or
    ``distributed_c10d`` then gives the wrapper, their own names being swapped first, and a
    re-imported module is a new object. A module still being imported (``__spec__._initializing``:
    another rank thread's lazy import) is searched again next time, as its later lines may bind one.
    """
    global _depth
    with _lock:
        if _depth == 0:
            _originals.update({name: getattr(dist, name) for name in CANONICAL if hasattr(dist, name)})
            _wrapped.update({id(fn): _wrapper(name, fn) for name, fn in _originals.items()})
        for module_name, module in list(sys.modules.items()):
            if _reached.get(module_name) is not module:
                _reach(module_name, module)
        _depth += 1


def _reach(module_name: str, module: Any) -> None:
    """Swap the wrappers into ``module``; remember it once its import has finished ([Note: modules reached once])."""
    namespace = getattr(module, "__dict__", None)
    if not isinstance(namespace, dict):
        return
    for name, fn in _originals.items():
        if namespace.get(name) is fn:
            _swapped.append((module, name, fn))
            setattr(module, name, _wrapped[id(fn)])
    if not getattr(getattr(module, "__spec__", None), "_initializing", False):
        _reached[module_name] = module


def _uninstall() -> None:
    global _depth
    with _lock:
        _depth -= 1
        if _depth == 0:
            for module, name, original in _swapped:
                setattr(module, name, original)
            _swapped.clear()
            _reached.clear()
            _originals.clear()
            _wrapped.clear()


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
def patch_collectives(interceptor: Interceptor, *, barrier: bool = True,
                      on_wait: Callable[[torch.Tensor], None] | None = None) -> Iterator[None]:
    """Route this thread's collectives, from every layer, through ``interceptor`` inside the block.

    ``on_wait(tensor)`` is called before each functional collective's
    ``wait_tensor`` (for an interceptor that defers collectives). With
    ``barrier`` (the default) every rank must enter and leave together: the
    swap sits between barriers ([Note: collective patching]).
    """
    ident = threading.get_ident()
    if barrier:
        dist.barrier()
    _install()
    outer = _by_thread.get(ident)  # a block inside another one's: restored when it ends
    _by_thread[ident] = interceptor
    mode = CollectiveMode(interceptor, on_wait)
    mode.__enter__()
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
        mode.__exit__(None, None, None)
        if outer is None:
            _by_thread.pop(ident, None)
        else:
            _by_thread[ident] = outer
        _uninstall()
    if clean_exit and barrier:
        dist.barrier()


@functools.cache
def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(fn)


def _dtype(tensors: list[torch.Tensor]) -> str:
    names = sorted({str(t.dtype).removeprefix("torch.") for t in tensors})
    return ",".join(names) if names else "?"


def describe(op: str, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
    """The :class:`Call` an interceptor was handed, from a dispatcher op or a ``torch.distributed`` function."""
    info = op_info(fn)
    if info is not None:
        bound = bind(fn, args, kwargs)
        group = bound.get("process_group", bound.get("group_name"))
        asynchronous = bool(bound.get("async_op", True))  # functional collectives are waited for later
        reduce_op, layer = bound.get("reduce_op"), info.layer
        tensors = tensors_in(bound.get(info.input))
    else:
        bound = _signature(fn).bind_partial(*args, **kwargs).arguments
        group, asynchronous, layer = bound.get("group"), bool(bound.get("async_op", False)), "torch.distributed"
        reduce_op = bound.get("op", dist.ReduceOp.SUM if op in _REDUCING else None)
        tensors = tensors_in(bound.get(_INPUT_PARAM.get(fn.__name__, "")))
    size = sum(t.numel() * t.element_size() for t in tensors)
    red = None if reduce_op is None else reduce_op_name(reduce_op)
    resolved = process_group(group)  # once: both read the same group
    return Call(op, group_ranks(resolved), size, _dtype(tensors), red, asynchronous, layer, dist.get_rank(),
                group_name(resolved))


@contextmanager
def record(ctx: Any = None, *, delay_s: float = 0.0, fail: str | None = None) -> Iterator[Trace]:
    """Record this rank's collectives; optionally sleep ``delay_s`` before each, or raise on kind ``fail``.

    Collective: every rank must enter and leave the block together.
    """
    trace = Trace()

    def interceptor(op: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        trace.calls.append(describe(op, fn, args, kwargs))
        if fail == op:
            raise RuntimeError(f"injected failure in {op} (record_collectives(fail={fail!r}))")
        if delay_s:
            time.sleep(delay_s)
        return fn(*args, **kwargs)

    with patch_collectives(interceptor):
        yield trace
