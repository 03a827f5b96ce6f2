"""Adapter for PyTorch's ``torch.distributed.fsdp.FullyShardedDataParallel`` (FSDP1)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
import torch.nn as nn

from conformance.adapters._fsdp1_like import FSDP1LikeAdapter
from conformance.contract.adapter import Capability, UnitInfo

__all__ = ["TorchFSDP1Adapter"]


class TorchFSDP1Adapter(FSDP1LikeAdapter):
    """FSDP1 as shipped with the installed torch.

    Without an accelerator, FSDP1 needs ``device_id=torch.device("cpu")`` to
    compute on CPU, so the adapter passes it whenever a spec names no device.
    """

    name = "torch-fsdp1"
    capabilities = frozenset(
        {
            Capability.EXEC_ORDER_VALIDATION,
            Capability.FLAT_PARAM,
            Capability.MANUAL_NESTING,
            Capability.RESHARD_INTROSPECTION,
            Capability.HYBRID_VIA_PG_TUPLE,
            Capability.HYBRID_AUTO_GROUPS,
            Capability.HYBRID_MANUAL_WRAP_CHECK,
            Capability.HYBRID_PG_VALIDATION,
            Capability.SYNC_MODULE_STATES,
            Capability.CPU_OFFLOAD,
            Capability.IGNORED_MODULES,
            Capability.META_MATERIALIZATION,
            Capability.PARAM_INIT_FUNCTION,
            Capability.COMPUTE_DEVICE,
            Capability.PLACEMENT_MESSAGES,
            Capability.DEVICE_MESH,
            Capability.WORLD_SIZE_1_SWITCH,
            Capability.CONTAINER_WARNING,
            Capability.HOMOGENEOUS_ATTRIBUTES,
            Capability.UNSAFE_SETATTR,
            Capability.OPTIM_IN_BACKWARD_CHECK,
            Capability.FORWARD_PREFETCH,
            Capability.BACKWARD_PREFETCH,
            Capability.NO_SYNC,
            Capability.FULL_STATE_DICT,
            Capability.SHARDED_STATE_DICT,
            Capability.OPTIM_STATE_DICT,
            Capability.MIXED_PRECISION,
            Capability.MP_CAST_FORWARD_INPUTS,
            Capability.MP_KEEP_LOW_PRECISION_GRADS,
            Capability.MP_BUFFER_DTYPE,
            Capability.MP_FULL_PRECISION_IN_EVAL,
            Capability.THREAD_RANKS,
            Capability.OPTIM_STATE_DICT_FUNCTIONS,
            Capability.STATE_DICT_SETTINGS,
            Capability.LOCAL_STATE_DICT,
            Capability.WRAPPER_METHODS,
            Capability.IGNORED_STATES,
            Capability.MP_CAST_UNIT_FORWARD_INPUTS,
        }
    )
    #: FSDP1 times its state-dict sections with ``torch.distributed.fsdp._debug_utils.SimpleProfiler``,
    #: whose set of running sections is a class attribute: on thread ranks, the second rank to enter
    #: a section raises (reproduced in conformance/tests/contract/test_adapter_capabilities.py).
    thread_rank_limits = {
        Capability.OPTIM_STATE_DICT: "its optimizer state-dict sections are timed by SimpleProfiler, "
        "whose running sections are shared by every thread, so a second rank entering one raises",
        Capability.FULL_STATE_DICT: "its FULL state-dict load hook is timed by SimpleProfiler, "
        "whose running sections are shared by every thread, so a second rank entering it raises",
        Capability.OPTIM_STATE_DICT_FUNCTIONS: "its optimizer state-dict sections are timed by SimpleProfiler, "
        "whose running sections are shared by every thread, so a second rank entering one raises",
        Capability.STATE_DICT_SETTINGS: "its optimizer state-dict sections are timed by SimpleProfiler, "
        "whose running sections are shared by every thread, so a second rank entering one raises",
        Capability.LOCAL_STATE_DICT: "its optimizer state-dict sections are timed by SimpleProfiler, "
        "whose running sections are shared by every thread, so a second rank entering one raises",
    }
    #: A SHARDED state dict saves on thread ranks, but its load hook all-gathers each parameter inside a
    #: SimpleProfiler section, which the second rank to arrive finds already running and raises.
    thread_rank_load_limits = {
        Capability.SHARDED_STATE_DICT: "its SHARDED state-dict load hook all-gathers inside a SimpleProfiler "
        "section, whose running sections are shared by every thread, so a second rank entering it raises",
    }

    def _api(self) -> ModuleType:
        import torch.distributed.fsdp as api

        return api

    def _wrap_api(self) -> ModuleType:
        import torch.distributed.fsdp.wrap as wrap

        return wrap

    def _default_device_id(self) -> torch.device | None:
        return None if torch.cuda.is_available() else torch.device("cpu")

    def full_grads(self, model: nn.Module) -> dict[str, torch.Tensor | None] | None:
        """``None`` for flat parameters: FSDP1 summons gradients only with ``use_orig_params=True``. Raises
        where summoning would abort the process (:func:`_refuse_mixed_dtype_gather`)."""
        if not getattr(model, "_use_orig_params", False):
            return None
        _refuse_mixed_dtype_gather(self._api().FullyShardedDataParallel, model)
        return super().full_grads(model)

    def summoned_params(self, model: nn.Module, path: str, *, recurse: bool, rank0_only: bool, offload_to_cpu: bool,
                        with_grads: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor | None] | None]:
        """Raises where summoning would end the process (:func:`_refuse_mixed_dtype_gather`,
        :func:`_refuse_offload_of_cpu_params`)."""
        if with_grads:
            _refuse_mixed_dtype_gather(self._api().FullyShardedDataParallel, model)
        if offload_to_cpu:
            _refuse_offload_of_cpu_params(model)
        return super().summoned_params(model, path, recurse=recurse, rank0_only=rank0_only,
                                       offload_to_cpu=offload_to_cpu, with_grads=with_grads)

    def _unit_info(self, fqn: str, module: nn.Module) -> UnitInfo:
        unit: Any = module  # FSDP1's attributes are untyped through nn.Module.__getattr__
        handle = getattr(unit, "_handle", None)
        inter = getattr(unit, "_inter_node_pg", None)
        hybrid = unit.sharding_strategy.name in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
        if handle is None:
            return UnitInfo(fqn, unit, unit.process_group, inter if hybrid else None,
                            unit.compute_device, [], [], True, unit.sharding_strategy.name)
        flat = handle.flat_param
        # Before the first forward (lazy init) a flat parameter already holds its
        # shard but has no ``_local_shard`` / ``_full_param_padded`` yet; NO_SHARD
        # never gets them (the flat parameter is the shard).
        local = getattr(flat, "_local_shard", flat)
        resharded = flat.data_ptr() == local.data_ptr()
        padded = getattr(flat, "_full_param_padded", None)
        if handle.uses_sharded_strategy and padded is not None:
            resharded = resharded and padded.untyped_storage().size() == 0
        return UnitInfo(
            fqn=fqn,
            module=unit,
            shard_group=unit.process_group,
            replicate_group=inter if hybrid else None,
            compute_device=unit.compute_device,
            local_shards=[local],
            local_grads=[flat.grad],
            empty_shards=[not any(info.in_shard for info in flat._shard_param_infos)],
            resharded=resharded,
            strategy=unit.sharding_strategy.name,
        )


def _refuse_mixed_dtype_gather(fsdp_cls: Any, model: nn.Module) -> None:
    """Raise ``RuntimeError`` on every rank where ``summon_full_params(with_grads=True)`` would abort a rank.

    For a sharded unit whose flat parameter has a gradient on some ranks but not on others, FSDP1's
    ``FlatParamHandle.unshard_grad`` all-gathers zeros in the default dtype on the ranks without one, so a
    gradient of another dtype (float64) meets them in an all-gather of mismatched sizes, which gloo ends
    with ``abort()`` (docs/findings/fsdp1-summon-grads-float64-padding-shard.md). Every rank learns every
    rank's gradients first (one all-gather), so they all raise alike, before any gather."""
    import torch.distributed as dist

    handles = [unit._handle for unit in fsdp_cls.fsdp_modules(model) if getattr(unit, "_handle", None) is not None]
    mine = [None if h.flat_param.grad is None else str(h.flat_param.grad.dtype) for h in handles]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    default = str(torch.get_default_dtype())
    for index, handle in enumerate(handles):
        dtypes = {ranks[index] for ranks in every}
        if handle.uses_sharded_strategy and None in dtypes and dtypes - {None, default}:
            raise RuntimeError(
                "summon_full_params(with_grads=True) would abort the process: a sharded FlatParameter has a "
                f"gradient of dtype {sorted(dtypes - {None})} on some ranks and none on others, which FSDP1 "
                f"all-gathers as zeros of the default dtype {default} (gloo: Received data size doesn't "
                "match expected size)")


def _refuse_offload_of_cpu_params(model: nn.Module) -> None:
    """Raise ``RuntimeError`` on every rank where reading a parameter inside ``summon_full_params(offload_to_cpu=True)``
    would read freed memory (a segmentation fault, as seen).

    Before torch 2.14, FSDP1's ``FlatParamHandle.to_cpu`` moves the gathered flat parameter to the CPU and then
    frees the gathered copy; when it is on the CPU already, the move is no copy, and what it frees is the storage
    the summoned parameters view (pytorch/pytorch#188989, fixed by #188990 in torch 2.14;
    docs/findings/fsdp1-summon-offload-to-cpu-on-cpu.md). With ``use_orig_params=False`` torch raises itself
    ("setStorage: ... out of bounds for storage of size 0"); with ``use_orig_params=True`` the original parameters
    view the freed storage, and reading them can end the process, so the adapter raises first."""
    fixed = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14)
    if fixed or not getattr(model, "_use_orig_params", False) or getattr(model, "compute_device", None) is None:
        return
    if model.compute_device.type == "cpu":
        raise RuntimeError(
            "summon_full_params(offload_to_cpu=True) would read freed memory: FSDP1 (torch < 2.14) frees the "
            "gathered parameters of a model computing on the CPU when it offloads them there (pytorch/pytorch#188989)")
