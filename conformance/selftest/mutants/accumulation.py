"""Gradient-accumulation mutants: accumulating across backwards, with and without ``no_sync``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from conformance.selftest.declare import Expect, Patch, _Mutant, drop_grads

__all__ = ["OffloadedAccumulationOverwrites", "NoSyncDropsKeptGrad", "NoSyncKeepsGradForever", "NoSyncCommunicates"]

Fn = Callable[..., Any]


def _overwrite_when_offloaded(accumulate: Fn) -> Fn:
    def accumulate_or_replace(handle: Any, grad: Any) -> None:
        if handle.offload_params:
            drop_grads(handle)
        accumulate(handle, grad)

    return accumulate_or_replace


class OffloadedAccumulationOverwrites(_Mutant):
    """With parameter CPU offload, each backward's gradient replaces the CPU gradient instead of adding to it."""

    name = "mutant-offloaded-accumulation-overwrites"
    breaks = "accumulating gradients of CPU-offloaded parameters across backwards"
    # With no_sync only the last backward of a step reaches the sharded gradient: nothing to overwrite.
    expect = Expect(
        "grad_accumulation", "thread", ("grad_accumulation/accumulate[cpu_offload=True,no_sync=False]",),
    )
    patches = (Patch("fsdp_impl.flat_param:FlatParamHandle.accumulate_sharded_grad", _overwrite_when_offloaded),)


def _drop_kept(unit: Any, grad: Any) -> Any:
    unit.unsynced_grad = None
    return grad


def _keep_forever(original: Fn) -> Fn:
    def add_and_keep(unit: Any, grad: Any) -> Any:
        kept = None if unit.unsynced_grad is None else unit.unsynced_grad.clone()
        total = original(unit, grad)
        unit.unsynced_grad = kept
        return total

    return add_and_keep


@contextlib.contextmanager
def _still_syncing(module: Any) -> Iterator[None]:
    yield


class NoSyncDropsKeptGrad(_Mutant):
    """The first backward after ``no_sync`` reduces only its own gradient: what the backwards inside kept is lost."""

    name = "mutant-no-sync-drops-kept-grad"
    breaks = "adding the gradient kept inside no_sync to the synchronizing backward's"
    #: And the stateful fuzzer at world sizes 1 and 2 with the main job's budget (seed 0).
    expect = Expect("grad_accumulation or stateful_ws1 or stateful_ws2", "thread",
                    ("grad_accumulation/accumulate[no_sync=True]", "fuzz/stateful_ws1", "fuzz/stateful_ws2"))
    patches = (Patch.instead("fsdp_impl.unit:_with_unsynced_grad", _drop_kept),)


class NoSyncKeepsGradForever(_Mutant):
    """The kept gradient is added at the synchronizing backward but never cleared: the next step adds it again."""

    name = "mutant-no-sync-keeps-grad-forever"
    breaks = "handing the gradient kept inside no_sync over once"
    #: And the stateful fuzzer at world sizes 1 and 2 with the main job's budget (seed 0).
    expect = Expect("grad_accumulation or stateful_ws1 or stateful_ws2", "thread",
                    ("grad_accumulation/accumulate[no_sync=True]", "fuzz/stateful_ws1", "fuzz/stateful_ws2"))
    patches = (Patch("fsdp_impl.unit:_with_unsynced_grad", _keep_forever),)


class NoSyncCommunicates(_Mutant):
    """``no_sync()`` does nothing: every backward reduces as usual (the gradients are still right)."""

    name = "mutant-no-sync-communicates"
    breaks = "skipping gradient communication inside no_sync"
    expect = Expect("grad_accumulation", "thread", ("grad_accumulation/accumulate[no_sync=True]",))
    patches = (Patch.instead("fsdp_impl.no_sync:no_sync", _still_syncing),)
