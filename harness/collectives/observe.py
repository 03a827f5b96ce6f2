"""Collectives seen below the Python API: a dispatch mode over c10d and functional-collective ops.

[Note: observing collectives]
An FSDP issues collectives three ways: the ``torch.distributed`` functions
(``all_gather_into_tensor``, ``_all_gather_base``, ``reduce_scatter_tensor``,
``all_reduce_coalesced``, ...), the functional collectives DTensor uses
(``torch.ops._c10d_functional.*``, their ``_c10d_functional_autograd``
variants, each result waited for by ``wait_tensor``), and ``torch.ops.c10d.*``
called directly. Patching the Python functions sees only the first, so the
one layer that sees them all is the dispatcher, through a
``TorchDispatchMode`` (:class:`CollectiveMode`):

- a ``torch.distributed`` function calls the group's C++ method, which calls
  the ``c10d::`` op through the dispatcher (``dist.all_gather_into_tensor``
  reaches ``c10d::_allgather_base_``, a coalescing manager's flush reaches
  ``c10d::allgather_into_tensor_coalesced_``), so the mode sees each call once,
  as the op that really goes on the wire;
- functional collectives are dispatcher ops themselves, and DTensor issues
  them from Python (``redistribute``, ``full_tensor``) or from inside its own
  ``__torch_dispatch__`` (a sharding that needs a redistribution). A mode runs
  before tensor subclasses, so the mode hands an op with subclass arguments
  back (``NotImplemented``): DTensor, or an ``AsyncCollectiveTensor`` about to
  call ``wait_tensor``, desugars first and the mode sees the plain ops that
  result. Fake tensors (DTensor's sharding propagation) communicate nothing
  and run as they are.
- A dispatch mode is thread-local: each rank pushes its own, which is what
  thread ranks need (every rank a thread of one process), and the autograd
  engine carries it into backward.

One hole, measured: on thread ranks the group is torch's threaded group, a
Python subclass of ``ProcessGroup`` whose collectives are Python methods, so a
``torch.distributed`` call never reaches the dispatcher (functional
collectives still do: their C++ calls the group). For such a group, and only
for it, :mod:`harness.collectives.recorder` intercepts the ``torch.distributed`` function
itself ([Note: collective patching]); a group whose collectives are C++
reaches the mode, so no call is seen by both layers. What differs between
the rank modes, then, is only what the threaded group does differently: the
calls inside a ``_coalescing_manager`` are recorded one by one on thread
ranks, where there is no coalesced op to flush them to, and as the one
coalesced collective on process ranks (harness/tests/collectives/test_observe.py).

Recorded, for every layer alike, as :class:`harness.collectives.recorder.Call`: the
canonical kind (a coalesced call is one collective of its kind, its bytes the
sum), the group's ranks, the input's bytes and dtype, the reduction, and
whether the caller may wait later (functional collectives always may).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpInfo", "OPS", "WAIT", "CollectiveMode", "bind", "op_info", "group_name", "group_ranks", "process_group",
           "tensors_in", "reduce_op_name"]

#: The functional collectives' wait; not a collective, but the comm worker must see it.
WAIT = "_c10d_functional::wait_tensor"
#: Namespaces whose ops the comm worker runs as the dispatcher's own collectives.
C10D, FUNCTIONAL = "c10d", "functional"


class OpInfo(NamedTuple):
    """How to read one collective op: its canonical kind, its input argument, its layer."""

    kind: str
    input: str
    layer: str


def _table() -> dict[str, OpInfo]:
    c10d_ops = {
        "_allgather_base_": ("all_gather_into_tensor", "input_tensor"),
        "allgather_into_tensor_coalesced_": ("all_gather_into_tensor", "inputs"),
        "_reduce_scatter_base_": ("reduce_scatter_tensor", "input_tensor"),
        "reduce_scatter_tensor_coalesced_": ("reduce_scatter_tensor", "inputs"),
        "allreduce_": ("all_reduce", "tensors"),
        "allreduce_coalesced_": ("all_reduce", "tensors"),
        "broadcast_": ("broadcast", "tensors"),
        "allgather_": ("all_gather", "input_tensors"),
        "allgather_coalesced_": ("all_gather", "input_list"),
        "reduce_scatter_": ("reduce_scatter", "input_tensors"),
        "alltoall_base_": ("all_to_all_single", "input"),
        "alltoall_": ("all_to_all", "input_tensors"),
        "scatter_": ("scatter", "input_tensors"),
        "gather_": ("gather", "input_tensors"),
        "reduce_": ("reduce", "tensors"),
    }
    functional = {
        "all_gather_into_tensor": ("all_gather_into_tensor", "input"),
        "all_gather_into_tensor_out": ("all_gather_into_tensor", "input"),
        "all_gather_into_tensor_coalesced": ("all_gather_into_tensor", "inputs"),
        "reduce_scatter_tensor": ("reduce_scatter_tensor", "input"),
        "reduce_scatter_tensor_out": ("reduce_scatter_tensor", "input"),
        "reduce_scatter_tensor_coalesced": ("reduce_scatter_tensor", "inputs"),
        "all_reduce": ("all_reduce", "input"),
        "all_reduce_": ("all_reduce", "input"),
        "all_reduce_coalesced": ("all_reduce", "inputs"),
        "all_reduce_coalesced_": ("all_reduce", "inputs"),
        "broadcast": ("broadcast", "input"),
        "broadcast_": ("broadcast", "input"),
        "all_to_all_single": ("all_to_all_single", "input"),
    }
    table = {f"c10d::{name}": OpInfo(kind, inp, C10D) for name, (kind, inp) in c10d_ops.items()}
    table.update({f"_c10d_functional::{name}": OpInfo(kind, inp, FUNCTIONAL)
                  for name, (kind, inp) in functional.items()})
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        kind, inp = functional[name]
        table[f"_c10d_functional_autograd::{name}"] = OpInfo(kind, inp, FUNCTIONAL)
    return table


#: Schema name (``namespace::name``) -> how to read the op; every other op is not a collective.
OPS = _table()


def op_info(func: Any) -> OpInfo | None:
    """The collective ``func`` is, or ``None`` (any other op, a higher-order operator, a Python function)."""
    schema = getattr(func, "_schema", None)
    return None if schema is None else OPS.get(schema.name)


def bind(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The op's arguments by schema name, defaults filled in (callers leave ``async_op=True`` out)."""
    bound: dict[str, Any] = {}
    for index, argument in enumerate(func._schema.arguments):
        if index < len(args):
            bound[argument.name] = args[index]
        elif argument.name in kwargs:
            bound[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
    return bound


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in ``value`` (a tensor, or nested lists of them), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    return []


def process_group(group: Any) -> Any:
    """The ProcessGroup given as itself, its boxed script object, its name, or ``None`` (the default group)."""
    if group is None:
        return c10d._get_default_group()
    if isinstance(group, str):
        return c10d._resolve_process_group(group)  # type: ignore[arg-type]
    if isinstance(group, torch.ScriptObject):
        return dist.ProcessGroup.unbox(group)
    return group


def group_ranks(group: Any) -> tuple[int, ...]:
    """Global ranks of a group given as a ProcessGroup, its boxed script object, a name, or ``None``."""
    return tuple(dist.get_process_group_ranks(process_group(group)))


def group_name(group: Any) -> str:
    """The name c10d registered a group under (each ``new_group`` its own, so two groups of the same ranks
    differ), from the forms :func:`group_ranks` takes."""
    return group if isinstance(group, str) else str(process_group(group).group_name)


def reduce_op_name(reduce_op: Any) -> str:
    """``SUM``, ``AVG``, ...: from a ``ReduceOp``, its boxed script object, or a functional name (``"avg"``)."""
    if isinstance(reduce_op, str):
        return reduce_op.upper()
    if isinstance(reduce_op, torch.ScriptObject):
        return dist.ReduceOp.RedOpType(reduce_op.op()).name  # type: ignore[attr-defined]
    return str(reduce_op).rsplit(".", 1)[-1].removeprefix("RedOpType.")


def _dispatches_inner_ops(types: Sequence[type]) -> bool:
    """Whether an argument is a tensor subclass with its own ``__torch_dispatch__`` (not a fake tensor)."""
    plain = torch.Tensor.__torch_dispatch__
    return any(getattr(t, "__torch_dispatch__", plain) is not plain and not issubclass(t, FakeTensor) for t in types)


@dataclass
class CollectiveMode(TorchDispatchMode):
    """Hands every collective op to ``interceptor`` and every ``wait_tensor`` to ``on_wait`` first.

    ``interceptor(kind, op, args, kwargs)`` runs with this mode off (it calls
    ``op`` or arranges for it to run); ``on_wait(tensor)`` may block until a
    collective it deferred has written ``tensor``. See [Note: observing collectives].
    """

    interceptor: Callable[[str, Any, tuple[Any, ...], dict[str, Any]], Any]
    on_wait: Callable[[torch.Tensor], None] | None = None

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func: Any, types: Sequence[type], args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, FakeTensor) for t in types) or isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if _dispatches_inner_ops(types):
            return NotImplemented
        info = op_info(func)
        if info is not None:
            return self.interceptor(info.kind, func, tuple(args), kwargs)
        if self.on_wait is not None and func._schema.name == WAIT:
            self.on_wait(args[0])
        return func(*args, **kwargs)
