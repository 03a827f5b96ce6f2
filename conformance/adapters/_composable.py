"""The optional FSDP2-shaped methods (``fully_shard``, ``set_modules_to_prefetch``, a module's controls)
for adapters whose implementation has torch's ``fully_shard`` API: only where that function lives differs;
the rest are the ``FSDPModule`` methods of the sharded module."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.nn as nn

from conformance.contract.adapter import MixedPrecisionSpec

__all__ = ["FullyShardMethods"]


class FullyShardMethods:
    """Mixed into an adapter: :meth:`_fully_shard_fn` names the implementation's ``fully_shard``."""

    def _fully_shard_fn(self) -> Callable[..., nn.Module]:
        raise NotImplementedError

    def _forward_method_fn(self) -> Callable[[nn.Module, str], None]:
        """The implementation's ``register_fsdp_forward_method``."""
        raise NotImplementedError

    def _mp_policy_cls(self) -> Callable[..., Any]:
        """The implementation's ``MixedPrecisionPolicy``."""
        raise NotImplementedError

    def _dp_mesh_dims_cls(self) -> Callable[..., Any]:
        """The implementation's ``DataParallelMeshDims`` (:attr:`Capability.FULLY_SHARD_DP_MESH_DIMS`)."""
        raise NotImplementedError

    def fully_shard(
        self,
        module: nn.Module | Sequence[nn.Module],
        *,
        mesh: Any,
        reshard_after_forward: bool | int,
        ignored_params: frozenset[nn.Parameter],
        mixed_precision: MixedPrecisionSpec | None = None,
        shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
        dp_mesh_dims: tuple[str, str | None] | None = None,
    ) -> nn.Module:
        """``fully_shard(module, mesh=..., reshard_after_forward=..., ignored_params=...)`` (``module`` a module
        or a list of them, one group), with
        ``mp_policy`` from ``mixed_precision`` (its FSDP2 fields), ``shard_placement_fn`` where given, and
        ``dp_mesh_dims`` from the (shard, replicate) dim names where given."""
        placement = {} if shard_placement_fn is None else {"shard_placement_fn": shard_placement_fn}
        policy: dict[str, Any] = {} if mixed_precision is None else {"mp_policy": self._mp_policy_cls()(
            param_dtype=mixed_precision.param_dtype, reduce_dtype=mixed_precision.reduce_dtype,
            output_dtype=mixed_precision.output_dtype, cast_forward_inputs=mixed_precision.cast_forward_inputs)}
        if dp_mesh_dims is not None:
            shard, replicate = dp_mesh_dims
            policy["dp_mesh_dims"] = self._dp_mesh_dims_cls()(shard=shard, replicate=replicate)
        return self._fully_shard_fn()(
            module, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=set(ignored_params) or None,
            **policy, **placement,
        )

    def set_modules_to_prefetch(
        self, module: nn.Module, *, forward: Sequence[nn.Module] | None, backward: Sequence[nn.Module] | None
    ) -> None:
        """FSDP2's ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``."""
        owner: Any = module
        if forward is not None:
            owner.set_modules_to_forward_prefetch(list(forward))
        if backward is not None:
            owner.set_modules_to_backward_prefetch(list(backward))

    def unshard(self, module: nn.Module, *, async_op: bool) -> Any:
        """``FSDPModule.unshard(async_op=...)``."""
        return cast(Any, module).unshard(async_op=async_op)

    def reshard(self, module: nn.Module) -> None:
        """``FSDPModule.reshard()``."""
        cast(Any, module).reshard()

    def set_requires_gradient_sync(self, module: nn.Module, on: bool) -> None:
        """``FSDPModule.set_requires_gradient_sync(on)`` (recursive)."""
        cast(Any, module).set_requires_gradient_sync(on)

    def set_reshard_after_backward(self, module: nn.Module, on: bool) -> None:
        """``FSDPModule.set_reshard_after_backward(on)`` (recursive)."""
        cast(Any, module).set_reshard_after_backward(on)

    def set_reshard_after_forward(self, module: nn.Module, on: bool, *, recurse: bool) -> None:
        """``FSDPModule.set_reshard_after_forward(on, recurse=recurse)``."""
        cast(Any, module).set_reshard_after_forward(on, recurse=recurse)

    def set_gradient_divide_factor(self, module: nn.Module, factor: float) -> None:
        """``FSDPModule.set_gradient_divide_factor(factor)`` (the module's own parameters)."""
        cast(Any, module).set_gradient_divide_factor(factor)

    def set_reduce_scatter_divide_factor(self, module: nn.Module, factor: float) -> None:
        """``FSDPModule.set_reduce_scatter_divide_factor(factor)`` (deprecated for ``set_gradient_divide_factor``)."""
        cast(Any, module).set_reduce_scatter_divide_factor(factor)

    def set_requires_all_reduce(self, module: nn.Module, on: bool) -> None:
        """``FSDPModule.set_requires_all_reduce(on)`` (recursive)."""
        cast(Any, module).set_requires_all_reduce(on)

    def set_all_reduce_hook(self, module: nn.Module, hook: Callable[[torch.Tensor], None]) -> None:
        """``FSDPModule.set_all_reduce_hook(hook)`` (the module's own parameters)."""
        cast(Any, module).set_all_reduce_hook(hook)

    def reset_iter_state(self, module: nn.Module) -> None:
        """``FSDPModule.reset_iter_state()`` on the root."""
        cast(Any, module).reset_iter_state()

    def set_is_last_backward(self, module: nn.Module, on: bool) -> None:
        """``FSDPModule.set_is_last_backward(on)`` on the root."""
        cast(Any, module).set_is_last_backward(on)

    def set_unshard_in_backward(self, module: nn.Module, on: bool) -> None:
        """``FSDPModule.set_unshard_in_backward(on)`` (the module's own parameters)."""
        cast(Any, module).set_unshard_in_backward(on)

    def register_forward_method(self, module: nn.Module, method_name: str) -> None:
        """``register_fsdp_forward_method(module, method_name)``."""
        self._forward_method_fn()(module, method_name)

    def set_custom_comms(self, module: nn.Module, *, all_gather: Any, reduce_scatter: Any) -> None:
        """``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter`` for those given."""
        owner: Any = module
        if all_gather is not None:
            owner.set_custom_all_gather(all_gather)
        if reduce_scatter is not None:
            owner.set_custom_reduce_scatter(reduce_scatter)

    def set_reduce_scatter_unused_params(self, module: nn.Module, on: bool) -> None:
        """``FSDPModule.set_reduce_scatter_unused_params(on)`` (recursive)."""
        cast(Any, module).set_reduce_scatter_unused_params(on)
