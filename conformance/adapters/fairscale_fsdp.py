"""Adapter for FairScale's ``FullyShardedDataParallel`` (0.4.13), the ancestor of torch's FSDP1.

An optional extra: ``pip install --no-deps fairscale==0.4.13`` (``--no-deps`` so
that it never replaces the installed torch). Without it the adapter is
unavailable, with the reason.

[Note: FairScale mapping]
FairScale has no ``ShardingStrategy``: ``reshard_after_forward=True`` is
FULL_SHARD, ``False`` is SHARD_GRAD_OP; it has neither NO_SHARD nor hybrid
sharding (``supports_strategy`` says so, so those rows are ``n/a``).
``use_orig_params=False`` is ``flatten_parameters=True`` (one flat parameter
per unit). Auto-wrapping uses FairScale's own ``enable_wrap``/``auto_wrap``
with a policy selecting the spec's module classes. ``state_dict()`` is the
full state dict (gathered on every rank) and ``local_state_dict()`` this
rank's shards; FairScale's optimizer state dicts are keyed by parameter index
and consolidated on one rank, so the optimizer-state methods are not offered
(the cases needing them are ``n/a`` through the state-dict capabilities).

On a machine without CUDA its forward pass and ``summon_full_params`` fail
(``docs/findings/fairscale-fsdp-needs-cuda.md``).
"""

from __future__ import annotations

import re
from contextlib import AbstractContextManager
from typing import Any, cast

import torch
import torch.nn as nn

from conformance.adapters._inexpressible import refuse_inexpressible
from conformance.contract.adapter import Capability, UnitInfo, WrapSpec

__all__ = ["FairScaleFSDPAdapter"]

_WRAPPERS = re.compile(r"(_fsdp_wrapped_module|_fpw_module)\.")
_STRATEGIES = (None, "FULL_SHARD", "SHARD_GRAD_OP")


def _clean(name: str) -> str:
    return _WRAPPERS.sub("", name)


class FairScaleFSDPAdapter:
    """``fairscale.nn.data_parallel.FullyShardedDataParallel`` (see [Note: FairScale mapping])."""

    name = "fairscale-fsdp"
    protocol_version = 3
    #: No THREAD_RANKS: FairScale keeps process-global state (the auto-wrap context is a class attribute),
    #: so ranks that are threads of one process collide.
    capabilities = frozenset({Capability.FLAT_PARAM, Capability.NO_SYNC})
    #: FairScale's constructor refuses parameters other than float32 unless it runs in pure float16
    #: (``compute_dtype=float16`` without ``mixed_precision``), which the adapter never asks for: "Expecting FP16
    #: param type in FP32 & MP modes." is raised for a float64 model (the message names FP16; the check is float32).
    param_dtypes = frozenset({torch.float32})

    def unavailable_reason(self) -> str | None:
        try:
            import fairscale
            from fairscale.nn.data_parallel import FullyShardedDataParallel  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any import failure makes the adapter unusable
            return f"{type(exc).__name__}: {exc} (install with: pip install --no-deps fairscale==0.4.13)"
        if fairscale.__version__ != "0.4.13":
            return f"fairscale {fairscale.__version__} is installed; this adapter is written for 0.4.13"
        return None

    def supports_strategy(self, strategy: str | None) -> bool:
        return strategy in _STRATEGIES

    def wrap(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
        from fairscale.nn.wrap import auto_wrap, enable_wrap

        kwargs = self._kwargs(spec)
        if spec.auto_wrap is None:
            return FSDP(module, **kwargs)
        with enable_wrap(wrapper_cls=FSDP, **kwargs):
            inner = auto_wrap(module, auto_wrap_policy=_policy(spec, module))
        return FSDP(inner, **kwargs)

    @staticmethod
    def _kwargs(spec: WrapSpec) -> dict[str, Any]:
        refuse_inexpressible("fairscale-fsdp", spec, strategies=_STRATEGIES, features=(
            "device_mesh", "cpu_offload", "sync_module_states", "ignored_modules", "param_init_fn"))
        # forward_prefetch is a performance hint FairScale has no switch for; it is not refused.
        kwargs: dict[str, Any] = {
            "reshard_after_forward": spec.strategy != "SHARD_GRAD_OP",
            "flatten_parameters": not spec.use_orig_params,
        }
        if spec.process_group is not None:
            kwargs["process_group"] = spec.process_group
        if spec.device_id is not None:
            device = spec.device_id
            kwargs["compute_device"] = torch.device("cuda", device) if isinstance(device, int) else device
        elif not torch.cuda.is_available():
            kwargs["compute_device"] = torch.device("cpu")
        kwargs.update(spec.extra)
        return kwargs

    def units(self, model: nn.Module) -> list[UnitInfo]:
        from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

        out = []
        for fqn, unit in model.named_modules():
            if not isinstance(unit, FSDP):
                continue
            params: list[Any] = list(unit.params)
            shards = [getattr(p, "_fp32_shard", p.data) for p in params]
            out.append(UnitInfo(_clean(fqn), unit, unit.process_group, None, unit.compute_device,
                                shards, [p.grad for p in params], None))
        return out

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        """FairScale's ``no_sync()`` on the root unit (it applies to every unit below it)."""
        root: Any = model
        return cast(AbstractContextManager[Any], root.no_sync())

    def full_params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        buffers = {_clean(n) for n, _ in model.named_buffers()}
        return {k: v.detach().clone() for k, v in self.full_state_dict(model).items() if k not in buffers}

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        return {_clean(k): v for k, v in model.state_dict().items()}

    def sharded_state_dict(self, model: nn.Module) -> dict[str, Any]:
        root: Any = model  # FairScale's sharded state dict is a method of the root unit
        return dict(root.local_state_dict())

    def load_state_dict(self, model: nn.Module, state: dict[str, Any], *, sharded: bool) -> None:
        if sharded:
            root: Any = model
            root.load_local_state_dict(state)
        else:
            model.load_state_dict(state)

    def optim_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, *, sharded: bool) -> dict[str, Any]:
        raise NotImplementedError("fairscale-fsdp: optimizer state dicts are not offered (see the module docstring)")

    def load_optim_state_dict(
        self, model: nn.Module, optim: torch.optim.Optimizer, state: dict[str, Any], *, sharded: bool
    ) -> None:
        raise NotImplementedError("fairscale-fsdp: optimizer state dicts are not offered (see the module docstring)")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _policy(spec: WrapSpec, root: nn.Module) -> Any:
    auto = spec.auto_wrap
    assert auto is not None
    chosen = {id(module) for module in auto.units_under(root, spec.ignored_modules)}

    def select(module: nn.Module, recurse: bool, unwrapped_params: int, module_is_root: bool = False) -> bool:
        if recurse:
            return True
        return not module_is_root and id(module) in chosen

    return select
