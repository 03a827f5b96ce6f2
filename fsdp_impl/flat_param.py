"""One unit's parameters as a single padded flat tensor, sharded across the shard group.

[Note: flat parameter layout]
A unit's unique original parameters (registration order) live in one flat
tensor of ``padded_numel`` elements, sharded across the shard group as [Note:
shard layouts] in ``layout.py`` says (the wrapper: concatenated, zero-padded at
the end, rank ``r`` owning ``[r * shard_numel, (r + 1) * shard_numel)``). A
rank's elements are its *local shard*, the data of ``flat_param``. The
*unsharded* flat parameter ``full`` is one persistent leaf tensor per unit whose
storage is resized to 0 when resharded and re-allocated before each all-gather,
so autograd's saved views of it stay valid across free/re-gather cycles. It is
only written through ``.data`` (a separate version counter), so re-gathering in
backward never trips autograd's in-place checks. Module parameters are set to
views of ``full`` for compute; gradients accumulate into ``full.grad``, which is
reduce-scattered into the local shard's gradient.

With ``use_orig_params=True`` the original ``nn.Parameter`` objects stay
registered while sharded: their ``.data`` is this rank's piece of the local
shard (1-D, possibly empty; original shape for a shard group of one) and their
``.grad`` the matching piece of the sharded gradient; ``fully_shard`` registers
DTensor parameters over the same pieces instead. With ``use_orig_params=False``
the module exposes only ``flat_param`` (registered as ``_flat_param``).

[Note: mixed precision]
With a ``MixedPrecision`` policy the unsharded leaf ``full`` is in
``param_dtype``: the local shard is cast before its all-gather, so the
all-gather, forward and backward run in that dtype while ``flat_param`` keeps
its own. There is one leaf per dtype (:meth:`FlatParamHandle.set_full_precision`
switches while sharded): eval with ``FSDP_USE_FULL_PREC_IN_EVAL=1`` and
``summon_full_params`` gather into a leaf in the parameter's dtype. Gradients
are reduced in ``reduce_dtype`` (``unit.py``) and cast to the parameter's dtype
when accumulated, unless ``keep_low_precision_grads``; a gradient in another
dtype than its parameter is attached with :func:`set_grad`.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_impl import collectives
from fsdp_impl.api import MixedPrecision, ShardedState
from fsdp_impl.layout import MeshSharding, ParamSlot, ShardLayout, build_slots, local_tensor

__all__ = ["FlatParamHandle", "FLAT_PARAM_NAME", "unsafe_setattr_enabled", "set_grad"]

FLAT_PARAM_NAME = "_flat_param"


def unsafe_setattr_enabled() -> bool:
    """``FSDP_USE_UNSAFE_SETATTR=1`` bypasses modules' ``__setattr__`` overrides, as torch does."""
    return os.environ.get("FSDP_USE_UNSAFE_SETATTR", "") == "1"


def set_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """``param.grad = grad``, also for a gradient in another dtype (``keep_low_precision_grads``):
    autograd rejects assigning one, so it is attached through ``.grad.data``."""
    if grad.dtype == param.dtype:
        param.grad = grad
        return
    param.grad = torch.empty(grad.shape, dtype=param.dtype, device=grad.device)
    param.grad.data = grad


def _set_tensor(module: nn.Module, name: str, tensor: torch.Tensor, unsafe: bool) -> None:
    """Make ``module.name`` a plain tensor (a view), removing a registered parameter first."""
    module._parameters.pop(name, None)
    if unsafe:
        object.__setattr__(module, name, tensor)
    else:
        setattr(module, name, tensor)


def _set_param(module: nn.Module, name: str, param: nn.Parameter, unsafe: bool) -> None:
    """Re-register ``param`` as ``module.name``, dropping any plain-tensor attribute."""
    module.__dict__.pop(name, None)
    if unsafe:
        module._parameters[name] = param
    else:
        setattr(module, name, param)


class FlatParamHandle:
    """Owns one unit's flat parameter: layout, storage lifecycle, views and sharded grads.

    ``sharding`` selects ``fully_shard``'s presentation ([Note: two front doors]):
    the PER_PARAMETER layout, and every original parameter replaced by a DTensor
    parameter whose local tensor is its piece of the local shard.
    """

    def __init__(
        self,
        named_params: list[tuple[str, nn.Module, str, nn.Parameter]],
        *,
        compute_device: torch.device,
        offload_params: bool,
        shard_group: dist.ProcessGroup | None,
        shard_size: int,
        shard_rank: int,
        use_orig_params: bool,
        mixed_precision: MixedPrecision | None = None,
        sharding: MeshSharding | None = None,
    ) -> None:
        self.compute_device = compute_device
        self.offload_params = offload_params
        self.shard_group = shard_group
        self.shard_size = shard_size
        self.shard_rank = shard_rank
        self.use_orig_params = use_orig_params or sharding is not None
        self.sharding = sharding
        self.slots = build_slots(named_params)
        self.layout = ShardLayout([s.shape for s in self.slots], shard_size, shard_rank, sharding is not None)
        for slot, offset in zip(self.slots, self.layout.offsets, strict=True):
            slot.offset = offset
        self.numel, self.shard_numel = self.layout.numel, self.layout.shard_numel
        self.padded_numel = self.layout.padded_numel
        self.state = ShardedState.SHARDED
        self._pending: collectives.Pending | None = None
        # reshard_after_forward=<int>: this rank's piece of the gathered parameter and the group to gather it over
        self._post_forward: tuple[torch.Tensor, dist.ProcessGroup] | None = None
        self._hooked: set[int] = set()  # ids of the leaves whose post-accumulate hook is registered
        self.flat_param = self._build_flat_param()
        mp = mixed_precision or MixedPrecision()
        self._policy_dtype = mp.param_dtype
        self.param_dtype = mp.param_dtype or self.flat_param.dtype
        self.keep_low_precision_grads = mp.keep_low_precision_grads
        self._leaves: dict[torch.dtype, torch.Tensor] = {}
        self.full = self._leaf(self.param_dtype)
        if sharding is not None:
            for slot in self.slots:
                exposed = self._exposed(slot, self.sharded_view(slot, self.flat_param.data))
                slot.param = nn.Parameter(exposed, requires_grad=slot.param.requires_grad)
        if self.use_orig_params:
            self.install_sharded_params()
        else:
            # The originals keep no storage of their own: each views its piece of the shard.
            for slot in self.slots:
                slot.param.data = self.sharded_view(slot, self.flat_param.data)
            # Stale views (storage freed) keep attribute access and repr working between uses.
            self._alloc_storage()
            with torch.no_grad():
                self.install_unsharded_views()
            self._free_storage()

    # -- construction ---------------------------------------------------------------
    def _storage_device(self) -> torch.device:
        """The CPU when offloading, else where the parameters are (a CPU module wrapped without
        ``device_id`` stays there, torch's contract; the first forward reports it)."""
        if self.offload_params:
            return torch.device("cpu")
        return self.slots[0].param.device if self.slots else self.compute_device

    def _build_flat_param(self) -> nn.Parameter:
        storage_device = self._storage_device()
        with torch.no_grad():
            dtype = self.slots[0].param.dtype if self.slots else torch.float32
            full = torch.zeros(self.padded_numel, dtype=dtype, device=storage_device)
            for slot in self.slots:
                full[slot.offset : slot.offset + slot.numel] = slot.param.detach().reshape(-1).to(storage_device)
            shard = self.layout.shard_of(full).clone()
        requires = {slot.param.requires_grad for slot in self.slots}
        if not self.use_orig_params and len(requires) > 1:
            names = [(slot.fqn, slot.param.requires_grad) for slot in self.slots]
            raise ValueError(
                f"use_orig_params=False needs uniform requires_grad within a unit, got {names}"
            )
        return nn.Parameter(shard, requires_grad=any(requires) if requires else False)

    def follow_moved_params(self) -> None:
        """After ``nn.Module._apply`` (``to_empty``, ``.to``) gave the parameters new local data: a
        local shard where and in the dtype they now are, filled from them, that they view again."""
        pieces = [local_tensor(slot.param) for slot in self.slots]
        with torch.no_grad():
            shard = torch.zeros(self.shard_numel, dtype=pieces[0].dtype, device=pieces[0].device)
            for slot, piece in zip(self.slots, pieces, strict=True):
                lo, hi = self.local_range(slot)
                shard[lo:hi] = piece.reshape(-1)
        self.flat_param = nn.Parameter(shard, requires_grad=self.flat_param.requires_grad)
        if self._policy_dtype is None and self.param_dtype != shard.dtype:
            self.param_dtype = shard.dtype
            self.full = self._leaf(shard.dtype)
        self.install_sharded_params()

    # -- introspection -------------------------------------------------------------------
    @property
    def is_resharded(self) -> bool:
        """Unsharded storage freed and nothing outstanding: only the local shard exists."""
        freed = self.state is ShardedState.SHARDED and self.full.untyped_storage().size() == 0
        return freed and self._post_forward is None

    def requires_grad(self) -> bool:
        if self.use_orig_params:
            return any(slot.param.requires_grad for slot in self.slots)
        return self.flat_param.requires_grad

    def local_range(self, slot: ParamSlot) -> tuple[int, int]:
        """``slot``'s piece of the local shard as ``[lo, hi)`` offsets (empty: ``lo == hi``)."""
        return self.layout.local_range(slot.index)

    # -- storage lifecycle -------------------------------------------------------------
    def _leaf(self, dtype: torch.dtype) -> torch.Tensor:
        """The unsharded leaf of ``dtype`` (storage freed when new), see [Note: mixed precision]."""
        if dtype not in self._leaves:
            leaf = torch.empty(self.padded_numel, dtype=dtype, device=self.compute_device)
            leaf.untyped_storage().resize_(0)
            self._leaves[dtype] = leaf
        return self._leaves[dtype]

    def set_full_precision(self, full_precision: bool) -> None:
        """Gather into the parameter's dtype (``True``) or ``param_dtype`` from the next unshard on."""
        leaf = self._leaf(self.flat_param.dtype if full_precision else self.param_dtype)
        if leaf is self.full:
            return
        if self.state is not ShardedState.SHARDED:
            self.reshard()
        self.full = leaf
        if not self.use_orig_params:
            with torch.no_grad():  # module attributes point at views of the current leaf
                self._alloc_storage()
                self.install_unsharded_views()
                self._free_storage()

    def _free_storage(self) -> None:
        self.full.untyped_storage().resize_(0)

    def _alloc_storage(self) -> None:
        storage = self.full.untyped_storage()
        nbytes = self.padded_numel * self.full.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)

    def start_unshard(self) -> None:
        """Allocate the unsharded storage and issue its all-gather (no wait): of the local shard
        over the shard group, or of the piece ``reshard_to`` kept over its smaller group."""
        if self.state is not ShardedState.SHARDED:
            return
        self._writeback_orig_params()
        self._alloc_storage()
        shard = self.flat_param.data.to(self.compute_device, self.full.dtype)  # no copy if both match
        source, group = self._post_forward or (shard, self.shard_group)
        self._post_forward = None
        if self.shard_size == 1:
            self.full.data.copy_(source)
            self._pending = None
        else:
            out = self.full.data if self.layout.gathers_in_place else torch.empty_like(self.full.data)
            self._pending = collectives.all_gather(out, source, group)
        self.state = ShardedState.UNSHARDING

    def wait_unshard(self) -> None:
        """Block until the unsharded parameter is valid (issuing the all-gather if needed)."""
        if self.state is ShardedState.SHARDED:
            self.start_unshard()
        if self.state is ShardedState.UNSHARDING:
            if self._pending is not None:
                gathered = self._pending.wait()
                if not self.layout.gathers_in_place:
                    self.layout.to_param_major(gathered, self.full.data)
                self._pending = None
            self.state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        """Free the unsharded storage and expose the sharded parameters again."""
        if self.state is ShardedState.UNSHARDING:
            self.wait_unshard()
        self._free_storage()
        self._post_forward = None
        self.state = ShardedState.SHARDED
        if self.use_orig_params:
            self.install_sharded_params()

    def reshard_to(self, group: dist.ProcessGroup) -> None:
        """Reshard, keeping this rank's piece of the gathered parameter for a later all-gather over
        ``group``: consecutive ranks of the shard group, each keeping the shards of as many
        consecutive ranks (``reshard_after_forward=<int>``, see [Note: unit lifecycle])."""
        self.wait_unshard()
        gathered = self.layout.to_rank_major(self.full.data)
        piece = gathered.numel() // collectives.group_size(group)
        start = collectives.group_rank(group) * piece
        kept = gathered[start : start + piece].clone()
        self.reshard()
        self._post_forward = (kept, group)

    def _writeback_orig_params(self) -> None:
        """Copy an original parameter's data back if something replaced it (``param.data = ...``)."""
        if not self.use_orig_params:
            return
        shard = self.flat_param.data
        for slot in self.slots:
            lo, hi = self.local_range(slot)
            data = local_tensor(slot.param)
            if hi > lo and data.data_ptr() != shard[lo:hi].data_ptr():
                with torch.no_grad():
                    shard[lo:hi].copy_(data.reshape(-1))

    # -- views -------------------------------------------------------------------------
    def unsharded_views(self, full: torch.Tensor | None = None) -> list[torch.Tensor]:
        """One view of ``full`` (default: the gathered parameters) per slot, in its original shape
        (autograd-linked in grad mode)."""
        full = self.full if full is None else full
        views = []
        for slot in self.slots:
            view = full[slot.offset : slot.offset + slot.numel].view(slot.shape)
            if self.use_orig_params and not slot.param.requires_grad:
                view = view.detach()
            views.append(view)
        return views

    def install_unsharded_views(self) -> None:
        """Point every registration at its view of ``full`` (the module computes on these)."""
        if self.requires_grad() and torch.is_grad_enabled():
            self.full.requires_grad_(True)
        else:
            self.full.requires_grad_(False)
        unsafe = unsafe_setattr_enabled()
        for slot, view in zip(self.slots, self.unsharded_views(), strict=True):
            for module, name in slot.registrations:
                if self.sharding is None:
                    _set_tensor(module, name, view, unsafe)
                else:  # the DTensor parameter stays registered ([Note: two front doors])
                    module.__dict__[name] = view

    def sharded_view(self, slot: ParamSlot, tensor: torch.Tensor) -> torch.Tensor:
        """``slot``'s piece of a shard-sized ``tensor``, in its layout's local shape."""
        lo, hi = self.local_range(slot)
        return tensor[lo:hi].view(self.layout.local_shape(slot.index))

    def _exposed(self, slot: ParamSlot, piece: torch.Tensor) -> torch.Tensor:
        """``piece`` as the user sees it: a DTensor under ``fully_shard``, else itself."""
        return piece if self.sharding is None else self.layout.as_dtensor(slot.index, piece, self.sharding)

    def install_sharded_params(self) -> None:
        """use_orig_params: re-register the original parameters over their local pieces."""
        unsafe = unsafe_setattr_enabled()
        shard = self.flat_param.data
        for slot in self.slots:
            piece = self.sharded_view(slot, shard)
            if self.sharding is None:
                slot.param.data = piece
            else:  # the DTensor parameter's local data is its piece ([Note: two front doors])
                slot.param._local_tensor = piece  # type: ignore[attr-defined]
            for module, name in slot.registrations:
                _set_param(module, name, slot.param, unsafe)

    # -- gradients ---------------------------------------------------------------------
    def register_post_accumulate_hook(self, hook: object) -> None:
        """Register ``hook(full)`` once, when ``full`` first requires grad."""
        if id(self.full) not in self._hooked and self.full.requires_grad:
            self.full.register_post_accumulate_grad_hook(hook)  # type: ignore[arg-type]
            self._hooked.add(id(self.full))

    def accumulate_sharded_grad(self, grad: torch.Tensor) -> None:
        """Add a reduced, averaged shard-sized gradient into the exposed gradients."""
        if self.offload_params:
            grad = grad.cpu()
        if not self.keep_low_precision_grads:
            grad = grad.to(self.flat_param.dtype)
        if not self.use_orig_params:
            previous = self.flat_param.grad
            set_grad(self.flat_param, grad if previous is None else previous.add_(grad))
            return
        # Existing per-parameter grads (None after zero_grad) are folded in, then every
        # original parameter's .grad becomes a view of one shard-sized flat gradient.
        previous = self.sharded_grad()
        total = grad if previous is None else previous.add_(grad)
        set_grad(self.flat_param, total)
        for slot in self.slots:
            if slot.param.requires_grad:  # empty pieces too, so every rank has optimizer state
                set_grad(slot.param, self._exposed(slot, self.sharded_view(slot, total)))

    def drop_unviewed_grad(self) -> None:
        """Forget the flat gradient once no original parameter has a gradient (``zero_grad`` set them
        to None), so it is not held through the next backward (``use_orig_params`` only)."""
        if self.use_orig_params and all(slot.param.grad is None for slot in self.slots):
            self.flat_param.grad = None

    def sharded_grad(self) -> torch.Tensor | None:
        """The local gradient as one shard-sized tensor (``None`` if no parameter has one)."""
        if not self.use_orig_params:
            return self.flat_param.grad
        grads = [
            (s, local_tensor(s.param.grad))
            for s in self.slots
            if s.param.grad is not None and s.param.grad.numel()
        ]
        if not grads:
            return None
        out = torch.zeros_like(self.flat_param.data, dtype=grads[0][1].dtype)
        for slot, grad in grads:
            lo, hi = self.local_range(slot)
            out[lo:hi] = grad.reshape(-1)
        return out
