"""Adapters for DeepSpeed ZeRO (0.19.x): ``deepspeed-zero1``, ``deepspeed-zero2``, ``deepspeed-zero3``.

An optional extra, installed so that it never replaces the installed torch
(``docs/USAGE.md``, "DeepSpeed ZeRO"): ``DS_BUILD_OPS=0 pip install --no-deps
--no-build-isolation deepspeed`` plus its small pure-Python requirements. On a
machine without an accelerator set ``DS_ACCELERATOR=cpu`` (the adapter sets it
when unset and no GPU is present): DeepSpeed then uses gloo.

[Note: DeepSpeed mapping]
A ZeRO stage is a property of the whole engine, chosen in its config, not a
per-unit strategy, and stages 1 and 2 never shard parameters (every rank holds
them whole; only optimizer state, and at stage 2 gradients, are partitioned).
So each stage is its own column rather than a ``WrapSpec.strategy`` mapping:

==================== ==================== ==========================================
adapter              strategies accepted  what is partitioned
==================== ==================== ==========================================
``deepspeed-zero1``  None, NO_SHARD       optimizer state
``deepspeed-zero2``  None, NO_SHARD       optimizer state, gradients
``deepspeed-zero3``  None, FULL_SHARD     optimizer state, gradients, parameters
==================== ==================== ==========================================

``wrap`` returns ``deepspeed.initialize``'s engine (an ``nn.Module`` whose
``module`` is the user's model). DeepSpeed owns the optimizer and the step,
and ZeRO partitions gradients only through the optimizer it wraps, so ``wrap``
gives the engine a placeholder ``torch.optim.SGD(lr=0)``
(``spec.extra["optimizer"]``, a callable taking the parameters, replaces it;
``spec.extra["config"]`` is merged into the DeepSpeed config); a module
without parameters gets none. The adapter's ``optimizer(model, cls,
**kwargs)`` puts ``cls(**kwargs)`` in the placeholder's place inside the ZeRO
optimizer, over the same flat fp32 partitions, and returns the ZeRO
optimizer; ``step`` is ``engine.step()``, which ends with the ZeRO optimizer's
``zero_grad`` (``step_zeroes_grads``). Backward is the user's
``loss.backward()``: DeepSpeed 0.19 hooks the forward's outputs so that a
plain backward reduces into the partitions as ``engine.backward`` does (loss
scaling aside, which no fp32 config uses).

Parameter resharding is DeepSpeed's parameter persistence, reuse distance and
prefetch: ZeRO-3 releases a gathered parameter after its module's forward when
``stage3_param_persistence_threshold`` is 0 (DeepSpeed's default keeps
parameters under 100k elements whole) and ``stage3_max_reuse_distance`` is 0
(its default keeps a parameter the traced module order uses again within 1e9
elements); the adapter sets both. It keeps DeepSpeed's prefetch
(``stage3_prefetch_bucket_size``, 5e7 elements "to fetch ahead of use"): once
the module order is traced, the parameters the backward uses first are within
that window at the end of the forward, so they stay gathered (for the suite's
small models, every one; docs/findings/deepspeed-zero3-prefetch-keeps-gathered.md);
without prefetch a forward overlaps nothing. ``release`` is
``engine.destroy()``, DeepSpeed's way to let an engine go. Accumulation is
``gradient_accumulation_steps`` in the config (``engine.no_sync`` refuses
stages 2 and 3 by design; at stage 1 every row that uses it wraps with a
sharding strategy, so ``NO_SYNC`` is not declared).
Full parameters come from ``deepspeed.zero.GatheredParameters`` (stage 3) or
the parameters themselves (stages 1, 2). Stages 1 and 2 report one unit, the
engine's, whatever the auto-wrap policy (``units_per_module`` is ``False``).

No ``THREAD_RANKS``: DeepSpeed keeps process-global state (its accelerator,
its ``comm`` module's backend, ``deepspeed.utils.groups``), so ranks that are
threads of one process would share it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from conformance.adapters._inexpressible import refuse_inexpressible
from conformance.contract.adapter import Capability, UnitInfo, WrapSpec

__all__ = ["DeepSpeedZero1Adapter", "DeepSpeedZero2Adapter", "DeepSpeedZero3Adapter"]

_INSTALL = ("DS_BUILD_OPS=0 pip install --no-deps --no-build-isolation deepspeed "
            "psutil tqdm pydantic hjson msgpack ninja py-cpuinfo einops packaging")
_SUPPORTED = "0.19."
_UNEXPRESSED = ("device_mesh", "cpu_offload", "sync_module_states", "ignored_modules", "param_init_fn")


def _deepspeed() -> Any:
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    return deepspeed


def _user_module(model: nn.Module) -> nn.Module:
    inner = getattr(model, "module", model)
    return inner if isinstance(inner, nn.Module) else model


class _DeepSpeedZeroAdapter:
    """One ZeRO stage of ``deepspeed.initialize`` (see [Note: DeepSpeed mapping])."""

    name = "deepspeed-zero"
    stage = 0
    protocol_version = 3
    strategies: tuple[str | None, ...] = ()
    #: Stages 1 and 2 declare nothing: every row of a declarable capability wraps with a strategy that
    #: shards parameters, which they refuse (test_capabilities_closed).
    capabilities: frozenset[Capability] = frozenset()

    def unavailable_reason(self) -> str | None:
        try:
            deepspeed = _deepspeed()
        except Exception as exc:  # noqa: BLE001 - any import failure makes the adapter unusable
            return f"{type(exc).__name__}: {exc} (install with: {_INSTALL})"
        version = str(deepspeed.__version__)
        if not version.startswith(_SUPPORTED):
            return f"deepspeed {version} is installed; this adapter is written for {_SUPPORTED}x"
        return None

    def supports_strategy(self, strategy: str | None) -> bool:
        return strategy in self.strategies

    def units_per_module(self, strategy: str | None) -> bool:
        """Stage 3 gathers per module owning parameters; stages 1 and 2 are one engine-wide unit."""
        return self.stage == 3

    def config(self, spec: WrapSpec) -> dict[str, Any]:
        """The DeepSpeed config for one wrap: this stage, one micro-step per step, no gradient clipping,
        every parameter released after its module's forward (see [Note: DeepSpeed mapping])."""
        zero: dict[str, Any] = {"stage": self.stage}
        if self.stage == 3:
            zero["stage3_param_persistence_threshold"] = 0
            zero["stage3_max_reuse_distance"] = 0
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_allow_untested_optimizer": True,
            "gradient_clipping": 0.0,  # DeepSpeed 0.19 clips to norm 1.0 unless told otherwise
            "zero_optimization": zero,
        }
        config.update(spec.extra.get("config", {}))
        return config

    def wrap(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        refuse_inexpressible(self.name, spec, strategies=self.strategies, features=_UNEXPRESSED)
        if spec.mixed_precision is not None:  # DeepSpeed's bf16/fp16 configs keep no FSDP-style reduce dtype
            raise ValueError(f"{self.name} does not express MixedPrecisionSpec; use spec.extra['config']")
        deepspeed = _deepspeed()
        if any(isinstance(m, deepspeed.DeepSpeedEngine) for m in module.modules()):
            raise ValueError(f"{self.name}: DeepSpeed builds one engine per model; "
                             "a module holding an engine cannot be wrapped again")
        if spec.device_id is not None and torch.device(spec.device_id).type != _device().type:
            raise ValueError(f"{self.name} computes on {_device()}, not on {spec.device_id}")
        if spec.process_group is not None and dist.get_world_size(spec.process_group) != dist.get_world_size():
            raise ValueError(f"{self.name} shards over the world group only; got a group of "
                             f"{dist.get_world_size(spec.process_group)} ranks")
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
        _forget_destroyed_groups()
        make_optim = spec.extra.get("optimizer", lambda params: torch.optim.SGD(params, lr=0.0))
        params = list(module.parameters())  # a module without parameters gets no optimizer (torch refuses one)
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=make_optim(params) if params else None,
                                               config=self.config(spec))
        return engine  # type: ignore[no-any-return]

    def optimizer(self, model: nn.Module, cls: type[torch.optim.Optimizer], **kwargs: Any) -> Any:
        """The engine's ZeRO optimizer, stepping ``cls(**kwargs)`` over its partitions.

        ZeRO builds its partitions around the torch optimizer given at ``deepspeed.initialize`` (``wrap``'s
        placeholder) and steps that optimizer over its flat fp32 partitions; here a ``cls`` over the same
        partitions, with fresh state, takes its place (as DeepSpeed itself rebuilds an ``Adagrad``).
        """
        zero = getattr(model, "optimizer", None)
        if zero is None:
            raise ValueError(f"{self.name}: the engine has no optimizer (its module has no parameters)")
        groups = [{"params": list(group["params"])} for group in zero.optimizer.param_groups]
        zero.optimizer = cls(groups, **kwargs)
        return zero

    #: ``engine.step()`` ends with its ZeRO optimizer's ``zero_grad``: a DeepSpeed loop calls none itself.
    step_zeroes_grads = True

    def step(self, model: nn.Module, optim: Any) -> None:
        """``engine.step()``: the ZeRO optimizer's step over the reduced partitions, then its zero_grad."""
        model.step()  # type: ignore[operator]

    def release(self, model: nn.Module) -> None:
        """``engine.destroy()``: DeepSpeed's way to release an engine, its optimizer and its model."""
        model.destroy()  # type: ignore[operator]

    def units(self, model: nn.Module) -> list[UnitInfo]:
        """Stage 3: the root, then each module owning parameters (gathered per module); else one root unit."""
        user = _user_module(model)
        group = dist.group.WORLD
        device = _device()
        if self.stage != 3:
            params = list(user.parameters())
            return [UnitInfo("", user, group, None, device, [p.detach() for p in params],
                             [p.grad for p in params], None)]
        from deepspeed.utils import safe_get_local_grad

        out = []
        for fqn, owner in user.named_modules():
            params = list(owner.parameters(recurse=False))
            if fqn and not params:
                continue
            shards = [getattr(p, "ds_tensor") for p in params]  # noqa: B009 - set by DeepSpeed
            # Every rank's partition of a parameter has ceil(numel / world) elements, padded: a rank past the end
            # holds padding only.
            rank = dist.get_rank()
            empty = [rank * s.ds_numel >= getattr(p, "ds_numel") for p, s in zip(params, shards, strict=True)]  # noqa: B009
            out.append(UnitInfo(fqn, owner, group, None, device, shards, [safe_get_local_grad(p) for p in params],
                                _released(params), empty_shards=empty))
        return out

    def full_params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        user = _user_module(model)
        with self._gathered(user):
            return {name: p.detach().clone() for name, p in user.named_parameters()}

    def full_grads(self, model: nn.Module) -> dict[str, torch.Tensor | None] | None:
        """Each parameter's reduced gradient from the ZeRO optimizer's partitions (``safe_get_full_grad``);
        ``None`` where a rank is outside the window stages 1 and 2 expose them in ("Gradients are only
        available immediately after backward and before engine step", ``tensor_fragment``)."""
        from deepspeed.utils import safe_get_full_grad

        user = _user_module(model)
        if not _in_gradient_window(user):
            return None
        grads = {name: safe_get_full_grad(p) for name, p in user.named_parameters()}
        return {name: None if g is None else g.detach().clone() for name, g in grads.items()}

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        user = _user_module(model)
        with self._gathered(user):
            return {name: value.detach().clone() for name, value in user.state_dict().items()}

    def sharded_state_dict(self, model: nn.Module) -> dict[str, Any]:
        raise NotImplementedError(f"{self.name}: DeepSpeed's sharded checkpoints go through save_checkpoint")

    def load_state_dict(self, model: nn.Module, state: dict[str, Any], *, sharded: bool) -> None:
        if sharded:
            raise NotImplementedError(f"{self.name}: DeepSpeed's sharded checkpoints go through load_checkpoint")
        user = _user_module(model)
        with self._gathered(user, modifier_rank=0):
            user.load_state_dict(state)
        self._set_master_params(user)

    def _set_master_params(self, user: nn.Module) -> None:
        """Copy each parameter's loaded value into the ZeRO optimizer's fp32 partition, from which
        ``engine.step()`` rewrites the parameters (``deepspeed.utils.safe_set_full_fp32_param``, DeepSpeed's
        routine for "modifying the fp32 master parameters" outside the training loop)."""
        from deepspeed.utils import safe_set_full_fp32_param

        with self._gathered(user):
            for param in user.parameters():
                safe_set_full_fp32_param(param, param.detach())

    def optim_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, *, sharded: bool) -> dict[str, Any]:
        raise NotImplementedError(f"{self.name}: DeepSpeed owns the optimizer; its state goes through checkpoints")

    def load_optim_state_dict(
        self, model: nn.Module, optim: torch.optim.Optimizer, state: dict[str, Any], *, sharded: bool
    ) -> None:
        raise NotImplementedError(f"{self.name}: DeepSpeed owns the optimizer; its state goes through checkpoints")

    def _gathered(self, user: nn.Module, modifier_rank: int | None = None) -> Any:
        from contextlib import nullcontext

        if self.stage != 3:
            return nullcontext()
        return _deepspeed().zero.GatheredParameters(list(user.parameters()), modifier_rank=modifier_rank)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _forget_destroyed_groups() -> None:
    """Drop DeepSpeed's cached groups once torch has destroyed them (see [Note: DeepSpeed groups])."""
    from deepspeed.utils import groups

    cached = groups._WORLD_GROUP
    if cached is not None and cached not in dist.distributed_c10d._world.pg_map:
        groups._release_process_group_references(None)


# [Note: DeepSpeed groups]
# DeepSpeed creates its groups once per process (a clone of the world group,
# the data-parallel group) and keeps them in ``deepspeed.utils.groups``'s
# module globals, forgetting them only when they are destroyed through
# ``deepspeed.comm.destroy_process_group``. The suite destroys every group a
# case created through ``torch.distributed`` and may run the next case in the
# same process, whose engine would then broadcast over a destroyed clone
# ("Group ... is not registered"). ``wrap`` forgets such groups first, as
# DeepSpeed's own destroy would have.


def _in_gradient_window(user: nn.Module) -> bool:
    """Whether every rank holds the reduced gradients stages 1 and 2 map their parameters to (agreed over the
    world, since reading them is collective)."""
    mappings = [m for p in user.parameters() if (m := getattr(p, "_hp_mapping", None)) is not None]
    held = all((m.offload_gradient_dict if m.use_offload else m.gradient_dict).get(m.param_group_index) is not None
               for m in mappings)
    flag = torch.tensor([int(held)], device=_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _released(params: list[Any]) -> bool | None:
    if not params:
        return None
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in params)


class DeepSpeedZero1Adapter(_DeepSpeedZeroAdapter):
    """ZeRO stage 1: optimizer state partitioned; parameters and gradients whole on every rank."""

    name = "deepspeed-zero1"
    stage = 1
    strategies = (None, "NO_SHARD")


class DeepSpeedZero2Adapter(_DeepSpeedZeroAdapter):
    """ZeRO stage 2: optimizer state and gradients partitioned; parameters whole on every rank."""

    name = "deepspeed-zero2"
    stage = 2
    strategies = (None, "NO_SHARD")


class DeepSpeedZero3Adapter(_DeepSpeedZeroAdapter):
    """ZeRO stage 3: optimizer state, gradients and parameters partitioned, gathered per module."""

    name = "deepspeed-zero3"
    stage = 3
    strategies = (None, "FULL_SHARD")
    capabilities = frozenset({Capability.FULL_STATE_DICT})
