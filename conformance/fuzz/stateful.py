"""Run one stateful program on the ranks: the wrapped model and the shadow, checked after every operation.

[Note: stateful invariant]
After every operation each rank checks what a user of the wrapped model can
observe against the shadow ([Note: the shadow model] in
:mod:`conformance.fuzz.shadow`): the outputs and loss of a forward (this
rank's batch), and, whenever no loss is pending (between iterations, where a
user reads them), the full parameters, the full gradients (where the adapter
exposes them), the values of the model's buffers (``named_buffers()``, also
before the first operation: a ``buffer_dtype`` changes them at the first
forward, not at wrapping), and that every original parameter is still
registered with ``use_orig_params``; a full save is compared with the shadow's
model and optimizer state. A unit none of whose parameters has a gradient in the
shadow shows none either (``assert_no_grads_outside_the_loss`` in
:mod:`conformance.fuzz.twin_checks`), and the rank holds no more memory than sharding allows
([Note: memory held between iterations] in :mod:`conformance.fuzz.held`); at the program's end its
user releases (``optional.release``) and drops the model, which must then be freed
(:func:`~conformance.fuzz.held.left_alive`). Tolerances are
``torch.testing.assert_close``'s defaults for the dtype (under a mixed-precision policy, outputs,
losses and gradients in the param dtype: see [Note: fuzz mixed-precision baseline]). A missing
gradient and an all-zero one are otherwise alike, as in the parity fuzzer (see
:mod:`conformance.fuzz.twin_checks`), and so are missing optimizer state and
all-zero state: a flat parameter steps the unused parameters it holds with
zero gradients, which leaves them and their zero moments unchanged. Verdicts
agree across ranks exactly as [Note: fuzz verdicts agree across ranks] says.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch.nn as nn

from conformance.contract import optional
from conformance.contract.adapter import FSDPAdapter
from conformance.contract.case import not_applicable
from conformance.contract.optional import takes_param_dtype
from conformance.fuzz.agreement import RanksParted, Verdicts, agree, attempt
from conformance.fuzz.drawn_precision import dtype_of
from conformance.fuzz.held import Held, left_alive
from conformance.fuzz.machine import Machine, setup
from conformance.fuzz.neighbours import check_neighbours
from conformance.fuzz.ops import Op, Program
from harness.ranks.rank_mode import RankMode

if TYPE_CHECKING:
    from harness import RankContext

__all__ = ["check_program", "run_program"]


def check_program(ctx: RankContext, impl: FSDPAdapter, program: Program, *, neighbours: bool = True) -> str | None:
    """Run ``program`` on ``impl`` and on the shadow, then (unless told not to) its configuration's neighbours; the
    first failure (the same on every rank) or ``None``. Raises :class:`~conformance.fuzz.agreement.RanksParted`,
    holding ``program``, where this rank raised in the implementation and its peers went on without it."""
    if program.config.world_size != ctx.world_size:
        raise ValueError(f"program is for world_size {program.config.world_size}, running on {ctx.world_size} ranks")
    verdicts = Verdicts(ctx)
    try:
        failure, model = _check_operations(verdicts, impl, program)
    except RanksParted as parted:
        parted.value = program
        raise
    failure = failure or agree(ctx, left_alive(ctx, model))  # the user's loop ends: the model is dropped
    if failure is None and neighbours and (failure := check_neighbours(ctx, impl, program.config)) is not None:
        return f"after its operations, {failure}"  # [Note: neighbours of a configuration]
    return failure


def _check_operations(verdicts: Verdicts, impl: FSDPAdapter,
                      program: Program) -> tuple[str | None, tuple[weakref.ref[nn.Module], ...]]:
    """Wrap as ``program`` says and run its operations, then the closing ones; the first failure or ``None``,
    and the wrapped model's modules, held weakly (none: it was never wrapped)."""
    ctx = verdicts.ctx
    held = Held(program.config, threads=ctx.mode == RankMode.THREAD)
    with held.watching():  # [Note: memory held between iterations]
        machine, raised = attempt("wrap", setup, ctx, impl, program.config, held)
        failure = held.untracked(verdicts.agree, None, raised=raised, where="wrap")
        if failure is not None:
            return failure, ()
        model = tuple(weakref.ref(module) for module in machine.model.modules())  # the user's modules among them
        raised = attempt("raised", machine.check_buffers)[1]
        failure = held.untracked(verdicts.agree, machine.mismatch, raised=raised, where="before any operation")
        if failure is not None:
            return f"before any operation, {failure}", model
        failure = _apply_all(verdicts, machine, "op", program.ops)
        # the closing operations: after the program's
        failure = failure or _apply_all(verdicts, machine, "closing op", machine.closing())
        release = attempt("release", optional.release, impl, machine.model)[1]  # the user's loop ends
        return failure or held.untracked(verdicts.agree, None, raised=release, where="release"), model


def _apply_all(verdicts: Verdicts, machine: Machine, label: str, ops: tuple[Op, ...]) -> str | None:
    """Apply ``ops`` in turn; the first failure (the same on every rank), named by ``label`` and index, or ``None``."""
    for index, op in enumerate(ops):
        where = f"{label} {index} ({op})"
        raised = attempt("raised", machine.apply, op)[1]
        # Agreed before the state check: its collectives run only when every rank is through the op.
        failure = machine.held.untracked(verdicts.agree, machine.mismatch, raised=raised, where=where)
        if failure is None and machine.pending is None:  # between iterations ([Note: stateful invariant])
            raised = attempt("raised", machine.held.untracked, machine.check_state)[1]
            failure = machine.held.untracked(verdicts.agree, machine.mismatch, raised=raised, where=where)
        if failure is not None:
            return f"{where}, {failure}"
    return None


def run_program(ctx: RankContext, impl: FSDPAdapter, program: Program) -> None:
    """A reproducer's body: fail with the first mismatch of ``program`` on every rank (``n/a`` where the
    adapter's ``param_dtypes`` leaves out the program's dtype)."""
    if not takes_param_dtype(impl, dtype_of(program.config.dtype)):
        not_applicable(f"{impl.name} takes no {program.config.dtype} parameters (its param_dtypes)")
    try:
        failure = check_program(ctx, impl, program)
    except RanksParted as parted:
        raise AssertionError(f"{impl.name} differs from the shadow model: {parted}") from None
    if failure is not None:
        raise AssertionError(f"{impl.name} differs from the shadow model: {failure}")
