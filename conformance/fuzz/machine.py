"""A stateful program's state on one rank: the wrapped model, its optimizer and the shadow, and each operation
applied to both and compared ([Note: stateful invariant] in :mod:`conformance.fuzz.stateful` says what is
compared after each; :mod:`conformance.fuzz.stateful` runs a program's operations through a :class:`Machine`)."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from conformance.contract import optional
from conformance.contract.adapter import FSDPAdapter
from conformance.fuzz.agreement import fail
from conformance.fuzz.configs import FullyShardConfig, ProgramConfig, WrapConfig
from conformance.fuzz.controls import Controls, full_value, materialize, shard_config, user_buffers
from conformance.fuzz.drawn_optimizers import wrapped_optimizer
from conformance.fuzz.drawn_precision import as_compared, compared_outputs, in_compute_dtype, wrapped_input
from conformance.fuzz.full_value_ops import (
    assert_norm,
    assert_summoned,
    clip_grads,
    clipped_norm_type,
    has_grads,
    scale_params,
    summon_options,
    summoned_names,
)
from conformance.fuzz.gathers import Gathers
from conformance.fuzz.held import Held
from conformance.fuzz.ops import (
    BATCHES,
    MODELLED_CONTROLS,
    Backward,
    ClipGradNorm,
    Forward,
    GradSync,
    Load,
    Mode,
    NoSync,
    Op,
    Save,
    ScaleParams,
    SetReshardAfterForward,
    Step,
    SummonFull,
    Train,
    Unshard,
    ZeroGrad,
)
from conformance.fuzz.shadow import Shadow, batch_of, build, loss_for
from conformance.fuzz.twin_checks import (
    assert_dtypes,
    assert_no_grads_outside_the_loss,
    assert_optim_state,
    assert_same_dtypes,
    tensors_of,
    unwrapped_name,
    unwrapped_names,
    zeros_for_none,
)
from conformance.fuzz.wrapping import assert_ignored_kept, given_groups, missing_operations, wrap_config
from fixtures.parity import assert_close_named

if TYPE_CHECKING:
    from harness import RankContext

__all__ = ["Machine", "setup"]

@dataclass
class Machine:
    """One program's wrapped model, optimizer and shadow on this rank."""

    ctx: RankContext
    impl: FSDPAdapter
    config: ProgramConfig
    model: nn.Module
    optim: torch.optim.Optimizer
    shadow: Shadow
    missing: dict[str, str]
    held: Held
    gathers: Gathers
    controls: Controls | None = None  # a fully_shard program's ([Note: fully_shard programs])
    pending: torch.Tensor | None = None
    saved: tuple[dict[str, Any], dict[str, Any] | None, bool] | None = None
    mismatch: str | None = None
    ignored: dict[str, nn.Module] = field(default_factory=dict)  # the user's ignored modules, by path
    trains: int = 0  # Train operations run (see _save_in_iteration)
    #: the user's modules, by path, held weakly (controls.user_buffers)
    user_modules: Mapping[nn.Module, str] = field(default_factory=weakref.WeakKeyDictionary)

    def compare(self, label: str, check: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """``check(*args, **kwargs)``; keep the first mismatch (see [Note: fuzz verdicts agree across ranks])."""
        try:
            self.held.untracked(check, *args, **kwargs)  # the fuzzer's own tensors are not held memory
        except Exception as exc:  # noqa: BLE001 - kept, so this rank still runs its peers' next collectives
            if self.mismatch is None:
                kind = "" if isinstance(exc, AssertionError) else f"{type(exc).__name__}: "
                self.mismatch = f"{label}: {kind}{' | '.join(str(exc).strip().splitlines()[:6])}"

    def apply(self, op: Op) -> None:
        """Run ``op`` on both sides; :meth:`check_state` follows once every rank is through it
        ([Note: fuzz verdicts agree across ranks])."""
        handlers: dict[type, Callable[[Any], None]] = {
            Forward: self.forward, Backward: self.backward, Step: self.step, Train: self.train_iteration,
            ZeroGrad: self.zero_grad, Mode: self.mode, Save: self.save, Load: self.load, NoSync: self.no_sync,
            ClipGradNorm: self.clip_grad_norm, ScaleParams: self.scale_params, SummonFull: self.summon_full,
        }
        handlers.get(type(op), self.control)(op)

    def control(self, op: Op) -> None:
        """A control of a ``fully_shard``-ed model: the checks end, or follow what a modelled one set ([Note:
        fully_shard programs]). ``Unshard`` is followed by a forward with gradients."""
        controls = self._controls()
        if not isinstance(op, MODELLED_CONTROLS):
            self.held.stop()
            self.gathers.stop()
        if isinstance(op, Unshard):
            controls.unshard(op)
            self.forward(Forward(batch=op.batch))
        controls.apply(op, self.config)
        if isinstance(op, SetReshardAfterForward):
            self.gathers.reshards_after_forward(controls.after_forward)
            self.held.reshards_after_forward(self.shadow.local, controls.after_forward)
        self.shadow.divisors = controls.divisors(self.config)

    def _forward(self, batch: int, *, grad: bool, loss: str) -> torch.Tensor:
        with nullcontext() if grad else torch.no_grad():
            output = self.model(wrapped_input(batch_of(self.config, batch, self.ctx.rank, self.ctx.device),
                                              self.config.policy))
        want, want_loss = self.shadow.forward(batch, self.ctx.rank, grad=grad, loss=loss)
        policy = self.config.policy
        if policy is not None:
            self.compare("output dtype", assert_dtypes, output, policy.param_dtype)
        self.compare("outputs", assert_close_named, compared_outputs(output, policy), compared_outputs(want, policy),
                     what="output")
        value = loss_for(output, loss)
        self.compare("loss", torch.testing.assert_close, as_compared(value.detach(), policy),
                     as_compared(want_loss, policy))
        return value

    def _controls(self) -> Controls:
        assert self.controls is not None, "a control operation on a program without api='fully_shard'"
        return self.controls

    def _unsynced(self) -> bool:
        """Gradients kept unreduced (see [Note: fully_shard programs]): the optimizer waits."""
        return self.controls is not None and self.controls.unsynced

    def closing(self) -> tuple[Op, ...]:
        """How the user's loop ends: sync on and a ``Train`` where gradients are kept ([Note: fully_shard programs])."""
        return (GradSync(on=True), Train()) if self._unsynced() else ()

    def forward(self, op: Forward) -> None:
        value = self._forward(op.batch, grad=op.grad, loss=op.loss)
        if self.pending is not None:
            self.gathers.disturbed()
        elif not op.grad:
            self.held.forwarded()
        if op.grad:
            if self.pending is None:
                self.gathers.started()
            self.pending = value if self.pending is None else self.pending + value

    def backward(self, _op: Backward) -> None:
        if self.pending is not None:
            with self.gathers.backward():
                self.pending.backward()
            self.compare("all-gathers in backward", self.gathers.check)
            self.pending = None
            if self.controls is not None:
                self.controls.after_backward()
            self.held.synchronised()
        self.shadow.backward(sync=self.controls is None or self.controls.sync)

    def step(self, _op: Step) -> None:
        if self._unsynced():
            return
        if self.pending is None:
            if self.controls is not None:
                self.controls.before_update(self.config)
            optional.step(self.impl, self.model, self.optim)
        if self.shadow.step() and optional.step_zeroes_grads(self.impl):  # as the implementation's step does
            self.shadow.optim.zero_grad(set_to_none=True)

    def train_iteration(self, op: Train) -> None:
        self.forward(Forward(batch=op.batch))
        if isinstance(self.config, WrapConfig) and self.config.saves_in_iteration:
            self._save_in_iteration()
        self.backward(Backward())
        self.step(Step())
        self.trains += 1

    def _save_in_iteration(self) -> None:
        """``WrapConfig.saves_in_iteration``: a full state dict (compared with the shadow's) in a program's first
        ``Train``, a sharded one in the second, and so on (a full one reshards the units, so a sharded one after
        it would find none still gathered from the forward); kept nowhere: a ``Load`` loads the last ``Save``."""
        sharded = self.trains % 2 == 1
        self.gathers.disturbed()
        if ("sharded save" if sharded else "full save") in self.missing:
            return
        if sharded:
            self.impl.sharded_state_dict(self.model)
        else:
            self._compare_saved(tensors_of(self.impl.full_state_dict(self.model)), None)

    def zero_grad(self, op: ZeroGrad) -> None:
        if self._unsynced():
            return
        self.optim.zero_grad(set_to_none=op.set_to_none)
        self.shadow.optim.zero_grad(set_to_none=op.set_to_none)

    def mode(self, op: Mode) -> None:
        self.model.train(op.train)
        self.shadow.local.train(op.train)

    def no_sync(self, op: NoSync) -> None:
        if self.pending is not None or "no_sync" in self.missing or self.controls is not None:
            return  # a fully_shard-ed model has GradSync instead
        with optional.no_sync(self.impl, self.model):
            self._forward(op.batch, grad=True, loss="all").backward()
        self.shadow.backward(sync=False)
        self._forward((op.batch + 1) % BATCHES, grad=True, loss="all").backward()
        self.shadow.backward()
        self.held.synchronised()

    def clip_grad_norm(self, op: ClipGradNorm) -> None:
        """Clip both sides' gradients and compare the total norms (when nothing happens: :class:`ClipGradNorm`)."""
        if self.pending is not None or self._unsynced() or not has_grads(self.shadow.local):
            return
        if self.controls is None and "clip_grad_norm" in self.missing:
            return
        norm_type = clipped_norm_type(self.config, op.norm_type)
        got = clip_grads(self.impl, self.model, fully_sharded=self.controls is not None, max_norm=op.max_norm,
                         norm_type=norm_type)
        self.compare("total norm", assert_norm, got, self.shadow.clip_grad_norm(op.max_norm, norm_type))

    def scale_params(self, op: ScaleParams) -> None:
        """Scale both sides' full parameters (when nothing happens: :class:`ScaleParams`)."""
        if self.pending is not None or (self.controls is None and "apply_with_full_params" in self.missing):
            return
        if self.controls is not None:
            if "reshard" in self.missing:
                return
            for unit in self.controls.units(self.config):  # what a forward or backward left gathered is dropped
                optional.reshard(self.impl, unit)
            self.controls.kept = False
        scale_params(self.impl, self.model, fully_sharded=self.controls is not None, scale=op.scale)
        self.shadow.scale_params(op.scale)

    def summon_full(self, op: SummonFull) -> None:
        """Read a unit's full parameters (and gradients) and compare them with the shadow's on every rank that sees
        them (when nothing happens: :class:`SummonFull`)."""
        if self.pending is not None or "summoned_params" in self.missing or not isinstance(self.config, WrapConfig):
            return
        offload, with_grads = summon_options(self.config, op)
        params, grads = optional.summoned_params(self.impl, self.model, op.unit, recurse=op.recurse,
                                                 rank0_only=op.rank0_only, offload_to_cpu=offload,
                                                 with_grads=with_grads)
        if op.rank0_only and self.ctx.rank != 0:
            return
        names = summoned_names(self.config, self.shadow.local, op.unit, op.recurse)
        local = dict(self.shadow.local.named_parameters())
        ignored = tuple(f"{path}." for path in self.config.ignored)
        self.compare("summoned params", assert_summoned, unwrapped_names(params), {n: local[n] for n in names},
                     offloaded=[n for n in names if offload and not n.startswith(ignored)])
        if grads is not None:  # only those summoned: a nested unit's, not summoned, may show its shard's
            summoned = {n: g for n, g in unwrapped_names(grads).items() if n in names}
            self._compare_grads("summoned grads", summoned, names)

    def save(self, op: Save) -> None:
        if self.controls is not None:
            self._save_fully_sharded(op)
            return
        kind = "sharded save" if op.sharded else "full save"
        if kind in self.missing or (op.optim and "optimizer save" in self.missing):
            return
        state = self.impl.sharded_state_dict(self.model) if op.sharded else self.impl.full_state_dict(self.model)
        optim = self.impl.optim_state_dict(self.model, self.optim, sharded=op.sharded) if op.optim else None
        self.saved = (copy.deepcopy(state), copy.deepcopy(optim), op.sharded)
        self.shadow.save(op.optim)
        if not op.sharded:
            self._compare_saved(tensors_of(state), None if optim is None else optim["state"])

    def _save_fully_sharded(self, op: Save) -> None:
        """The model's and optimizer's ``state_dict()`` (see [Note: fully_shard programs])."""
        controls = self._controls()
        state, optim = controls.save(self.optim if op.optim else None)
        self.saved = (state, optim, op.sharded)
        self.shadow.save(op.optim)
        if not op.sharded:
            self._compare_saved({name: full_value(v) for name, v in tensors_of(state).items()},
                                None if optim is None else controls.full_optim_state(optim))

    def _compare_saved(self, state: dict[str, torch.Tensor], optim: dict[str, Any] | None) -> None:
        self.compare("full model state dict", assert_close_named, unwrapped_names(state),
                     self.shadow.local.state_dict(), what="state_dict")
        if optim is not None:
            self.compare("full optimizer state dict", assert_optim_state, unwrapped_names(optim),
                         self.shadow.optim_state_by_name())

    def load(self, _op: Load) -> None:
        if self.saved is None:
            return
        state, optim, sharded = self.saved
        if ("sharded load" if sharded else "full load") in self.missing and self.controls is None:
            return
        if self.pending is not None:  # an abandoned iteration
            self.pending = None
            self.held.forwarded()
        if self.controls is not None:
            self.controls.before_update(self.config)
            self.controls.load(self.optim, (state, optim))
            self.shadow.load()
            return
        self.impl.load_state_dict(self.model, copy.deepcopy(state), sharded=sharded)
        if optim is not None:
            self.impl.load_optim_state_dict(self.model, self.optim, copy.deepcopy(optim), sharded=sharded)
        self.shadow.load()

    def check_buffers(self) -> None:
        """The wrapped model's buffers hold the shadow's values (see [Note: stateful invariant])."""
        want = {name: buf.detach() for name, buf in self.shadow.local.named_buffers()}
        got = user_buffers(self.model, want, self.user_modules)
        self.compare("buffers", assert_close_named, got, want, what="buffers")

    def check_state(self) -> None:
        buffers = sum(buf.nbytes for buf in self.shadow.local.buffers())
        self.compare("memory held", self.held.check, self.optim, buffers, self.shadow, self.saved)
        self.check_buffers()
        local = self.shadow.local
        if self.config.orig_params:  # the original parameters stay registered on the module
            got, want = len(list(self.model.parameters())), len(list(local.parameters()))
            if got != want:
                self.compare("parameters registered", fail, f"the wrapped model has {got}, the shadow {want}")
        if self.controls is not None:
            params = self.controls.full_params()
            grads = None if self.controls.unsynced else self.controls.full_grads()
        else:
            params = unwrapped_names(self.impl.full_params(self.model))
            grads = optional.full_grads(self.impl, self.model)
        self.compare("params", assert_close_named, params, dict(local.named_parameters()), what="params")
        self.compare("ignored modules", assert_ignored_kept, self.ignored, local)
        got_grads = None if grads is None else unwrapped_names(grads)
        self.compare("no gradient outside the loss", assert_no_grads_outside_the_loss, self.impl.units(self.model),
                     got_grads, local)
        if got_grads is not None:  # None: not exposed for this wrap; parameters still compared
            self._compare_grads("grads", got_grads, [n for n, _ in local.named_parameters()])

    def _compare_grads(self, label: str, got: dict[str, torch.Tensor | None], names: list[str]) -> None:
        """The full gradients ``got`` of the parameters ``names`` equal the shadow's (``None`` standing for zeros
        where the other side has one), in the dtype kept where the policy keeps low-precision gradients."""
        local = dict(self.shadow.local.named_parameters())
        want = {n: None if local[n].grad is None else local[n].grad.detach() for n in names}  # type: ignore[union-attr]
        policy = self.config.policy
        if policy is not None and policy.keep_low_precision_grads:
            self.compare(label.replace("grads", "grad dtypes"), assert_same_dtypes, got, want)
        self.compare(label, assert_close_named, in_compute_dtype(zeros_for_none(got, want), policy),
                     in_compute_dtype(zeros_for_none(want, got), policy), what=label)


def setup(ctx: RankContext, impl: FSDPAdapter, config: ProgramConfig, held: Held) -> Machine:
    shadow = Shadow.of(config, ctx.device)
    meta = isinstance(config, FullyShardConfig) and config.meta_init
    built = build(config, torch.device("meta") if meta else ctx.device)
    ignored, groups = {path: built.get_submodule(path) for path in config.ignored}, None
    user_modules = weakref.WeakKeyDictionary({module: path for path, module in built.named_modules()})
    if isinstance(config, WrapConfig):
        groups = given_groups(ctx, config)
        model, controls = wrap_config(ctx, impl, built, config, groups), None
    else:
        model = shard_config(ctx, impl, built, config)
        if meta:
            materialize(model, ctx.device, shadow.local, unwrapped_name)
        controls = Controls.of(impl, model, unwrapped_names)
    strategy = config.strategy if isinstance(config, WrapConfig) else None
    machine = Machine(ctx, impl, config, model, wrapped_optimizer(impl, model, config.optimizer), shadow,
                       missing_operations(impl, ctx.mode, strategy), held,
                       Gathers(config, shadow.local, shard_group=groups and groups[0]), controls, ignored=ignored,
                       user_modules=user_modules)
    held.wrapped(shadow.local, shadow)
    return machine
