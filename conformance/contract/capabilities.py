"""What a case may require of an implementation: :class:`Capability`, each member's docstring saying what an
adapter that declares it promises (:mod:`conformance.contract.adapter` exports it with the rest of the contract)."""

from __future__ import annotations

import enum

__all__ = ["Capability"]


class Capability(str, enum.Enum):
    """Behaviours a case may require; an adapter lists the ones it has."""

    EXEC_ORDER_VALIDATION = "exec_order_validation"
    """Checks, with debug level DETAIL, that ranks all-gather units in the same order."""
    FLAT_PARAM = "flat_param"
    """Can expose one flat parameter per unit (``use_orig_params=False``)."""
    MANUAL_NESTING = "manual_nesting"
    """FSDP1's manual nesting: ``wrap`` called on a submodule and then on a module holding it (each call
    with its own spec) nests the first unit in the second. A case that only needs units describes them as
    a plan (``WrapSpec.auto_wrap``) instead, which every adapter realises."""
    FLAT_PARAM_INTROSPECTION = "flat_param_introspection"
    """Deprecated (protocol 1): :attr:`RESHARD_INTROSPECTION`."""
    RESHARD_INTROSPECTION = "reshard_introspection"
    """:meth:`FSDPAdapter.units` reports whether each unit is resharded (``UnitInfo.resharded`` is not None)."""
    HYBRID_VIA_PG_TUPLE = "hybrid_via_pg_tuple"
    """Hybrid strategies accept a ``(shard_group, replicate_group)`` tuple."""
    HYBRID_AUTO_GROUPS = "hybrid_auto_groups"
    """Hybrid + auto-wrap with no group builds intra/inter-node groups itself."""
    HYBRID_MANUAL_WRAP_CHECK = "hybrid_manual_wrap_check"
    """Manual hybrid wrapping without groups raises the catalogued ValueError."""
    HYBRID_PG_VALIDATION = "hybrid_pg_validation"
    """A hybrid strategy given one (non-tuple) process group raises the catalogued ValueError."""
    SYNC_MODULE_STATES = "sync_module_states"
    """``WrapSpec.sync_module_states``: rank 0's parameters and buffers are broadcast at wrap time."""
    CPU_OFFLOAD = "cpu_offload"
    """``WrapSpec.cpu_offload``: sharded parameters and their gradients live on the CPU."""
    IGNORED_MODULES = "ignored_modules"
    """``WrapSpec.ignored_modules``: their parameters stay unsharded and unmanaged, and they and the
    ignored modules' buffers stay where they are (not moved to ``device_id``)."""
    PARAM_INIT_FN = "param_init_fn"
    """Deprecated: :attr:`META_MATERIALIZATION` and :attr:`PARAM_INIT_FUNCTION` together."""
    META_MATERIALIZATION = "meta_materialization"
    """``wrap`` accepts a module on the meta device and materializes it onto the compute device by each
    module's ``reset_parameters()`` (FSDP1's default without ``param_init_fn``). An implementation that leaves
    meta modules to the user after sharding (:attr:`META_INIT`) lacks it."""
    PARAM_INIT_FUNCTION = "param_init_function"
    """``WrapSpec.param_init_fn``: ``wrap`` calls this function on each module of a meta-device model it
    manages, which materializes and initializes it (FSDP1's ``param_init_fn``)."""
    DEVICE_ID = "device_id"
    """Deprecated (protocol 1): :attr:`COMPUTE_DEVICE` and :attr:`PLACEMENT_MESSAGES` together."""
    COMPUTE_DEVICE = "compute_device"
    """Accepts ``WrapSpec.device_id``: computes there and moves the managed parameters there (a
    ``device_id`` without an index: the current device). Nothing about warnings: those are
    :attr:`PLACEMENT_MESSAGES`."""
    PLACEMENT_MESSAGES = "placement_messages"
    """Reports misplaced modules and inputs with FSDP1's exact warnings and errors
    (a CPU module without ``device_id``, a module on another device, a multi-device module)."""
    DEVICE_MESH = "device_mesh"
    """Accepts ``WrapSpec.device_mesh`` (a 1-D mesh, or a 2-D (replicate, shard) mesh for hybrid)."""
    WORLD_SIZE_1_SWITCH = "world_size_1_no_shard_switch"
    """At world size 1 a sharded strategy (explicit or the default) warns, with a ``UserWarning`` starting
    :data:`NO_SHARD_SWITCH`, that it runs ``NO_SHARD`` instead (as torch's FSDP1)."""
    CONTAINER_WARNING = "container_warning"
    HOMOGENEOUS_ATTRIBUTES = "homogeneous_attributes"
    UNSAFE_SETATTR = "unsafe_setattr"
    OPTIM_IN_BACKWARD_CHECK = "optim_in_backward_check"
    FORWARD_PREFETCH = "forward_prefetch"
    """``WrapSpec.forward_prefetch``: the next unit's all-gather is issued before this unit's forward
    computation ends. ``forward_prefetch=True`` alone is a performance hint an adapter without this
    capability may ignore; a case that measures what it promises requires the capability."""
    BACKWARD_PREFETCH = "backward_prefetch"
    """``WrapSpec.backward_prefetch`` other than the default ``BACKWARD_PRE`` (``BACKWARD_POST``, or
    ``None``: no prefetch) is honoured."""
    POST_OPTIM_EVENT = "post_optim_event"
    NO_SYNC = "no_sync"
    """Accumulates gradients without communication (FSDP1's ``no_sync()``); the adapter defines
    ``no_sync(model)`` (:func:`conformance.contract.optional.no_sync`)."""
    FULL_STATE_DICT = "full_state_dict"
    """Saves and loads full (unflattened, unpadded) model state dicts."""
    SHARDED_STATE_DICT = "sharded_state_dict"
    """Saves and loads each rank's shards as a model state dict."""
    OPTIM_STATE_DICT = "optim_state_dict"
    """Saves and loads optimizer state dicts keyed by original parameter names, in each
    model state-dict kind the adapter declares."""
    MIXED_PRECISION = "mixed_precision"
    """Computes in ``MixedPrecisionSpec.param_dtype`` (all-gathers in it) and reduces gradients in
    ``reduce_dtype``; the sharded parameters and their gradients stay in full precision. Nothing about
    the model's inputs: a case that feeds floating inputs in another dtype and relies on the
    implementation casting them requires :attr:`MP_CAST_FORWARD_INPUTS` as well."""
    MP_CAST_FORWARD_INPUTS = "mp_cast_forward_inputs"
    """``MixedPrecisionSpec.cast_forward_inputs``: the root module casts the floating-point tensors of
    its forward inputs to ``param_dtype`` before its forward runs (torch FSDP1's
    ``MixedPrecision.cast_root_forward_inputs``, FSDP2's ``MixedPrecisionPolicy.cast_forward_inputs``),
    so a float32 batch computes in the param dtype as if the caller had cast it."""
    MP_KEEP_LOW_PRECISION_GRADS = "mp_keep_low_precision_grads"
    """``MixedPrecisionSpec.keep_low_precision_grads``: gradients are handed to the optimizer in the
    parameter dtype (torch's FSDP2 has no such option)."""
    MP_BUFFER_DTYPE = "mp_buffer_dtype"
    """``MixedPrecisionSpec.buffer_dtype``: buffers are cast for compute (FSDP2 leaves buffers alone)."""
    MP_FULL_PRECISION_IN_EVAL = "mp_full_precision_in_eval"
    """With ``FSDP_USE_FULL_PREC_IN_EVAL=1`` at wrap time, a unit in eval mode gathers and computes in
    full precision despite its mixed-precision policy (an FSDP1 setting)."""
    FULLY_SHARD = "fully_shard"
    """Shards per module in FSDP2's shape: the adapter defines ``fully_shard(module, *, mesh,
    reshard_after_forward, ignored_params)`` (:func:`conformance.contract.optional.fully_shard`), which
    cases call bottom-up, the root last. Afterwards the module's parameters (and ``state_dict()``
    values) are DTensors sharded on dim 0 over ``mesh``; ``reshard_after_forward`` is a bool. As torch's
    ``fully_shard``, each call groups the module's own parameters (those no nested call took) into one
    all-gather per unshard, which ``reshard/*`` reads to tell units apart."""
    FULLY_SHARD_MODULE_GROUPS = "fully_shard_module_groups"
    """``fully_shard([a, b, ...], ...)`` (FSDP2's list form): the modules' own parameters are one unit,
    all-gathered in one collective per unshard, and a mixed-precision policy casts each grouped module's
    inputs to ``param_dtype`` and its outputs to ``output_dtype``, as torch documents."""
    SHARD_PLACEMENT_FN = "shard_placement_fn"
    """``fully_shard(..., shard_placement_fn=fn)`` (FSDP2's argument): ``fn(param)`` returns a ``Shard(dim)``
    (``None``: ``Shard(0)``) and the parameter is a DTensor sharded on that dim, training as the local model."""
    MP_OUTPUT_DTYPE = "mp_output_dtype"
    """``MixedPrecisionSpec.output_dtype`` (FSDP2's ``MixedPrecisionPolicy.output_dtype``, given to ``fully_shard``):
    the module's floating forward outputs come back in that dtype; backward through the cast is unchanged."""
    FULLY_SHARD_MIXED_PRECISION = "fully_shard_mixed_precision"
    """``fully_shard(..., mixed_precision=spec)`` takes a :class:`MixedPrecisionSpec` of ``param_dtype``,
    ``reduce_dtype`` and ``cast_forward_inputs`` (FSDP2's ``MixedPrecisionPolicy``; ``buffer_dtype`` and
    ``keep_low_precision_grads`` are FSDP1's and are never given): the module computes in ``param_dtype``,
    reduces in ``reduce_dtype`` (``None``: ``param_dtype``) and, with gradient sync off, accumulates in
    ``reduce_dtype`` as torch documents; gradients reach the optimizer in the parameters' dtype."""
    FULLY_SHARD_DP_MESH_DIMS = "fully_shard_dp_mesh_dims"
    """``fully_shard(..., dp_mesh_dims=(shard, replicate))`` names the data-parallel dims of ``mesh``, a full SPMD
    mesh whose parameters are DTensors replicated over it (FSDP2's ``DataParallelMeshDims``)."""
    FULLY_SHARD_TENSOR_PARALLEL = "fully_shard_tensor_parallel"
    """``fully_shard`` takes parameters that are already DTensors sharded over a tensor-parallel dim of the same
    device mesh (``torch.distributed.tensor.parallel``'s ``parallelize_module``, or placements of their own), given
    the data-parallel submesh, or with :attr:`FULLY_SHARD_DP_MESH_DIMS` the full mesh with the tensor-parallel dim
    left out of ``dp_mesh_dims``: it shards them over the data-parallel dim, each parameter's full value staying
    the one tensor parallelism splits (FSDP2's composition with tensor parallelism)."""
    RESHARD_AFTER_FORWARD_INT = "reshard_after_forward_int"
    """``fully_shard(..., reshard_after_forward=k)`` with ``k`` a factor of the mesh size: after forward
    each rank keeps its share for an all-gather over ``k`` ranks in backward."""
    EXPLICIT_PREFETCH = "explicit_prefetch"
    """All-gathers the modules a case lists for a ``fully_shard``-ed module, in that order, right after
    its own in forward or backward: the adapter defines ``set_modules_to_prefetch(module, *, forward,
    backward)`` (:func:`conformance.contract.optional.set_modules_to_prefetch`)."""
    FULLY_SHARD_CONTROLS = "fully_shard_controls"
    """A ``fully_shard``-ed module's own controls (FSDP2's ``FSDPModule`` methods): the adapter defines
    ``unshard(module, *, async_op)``, ``reshard(module)``, ``set_requires_gradient_sync(module, on)`` and
    ``set_reshard_after_backward(module, on)`` (:func:`conformance.contract.optional.unshard` and after). None
    changes a value a user reads: forwards, parameters and, once reduced, gradients stay data-parallel training's."""
    SET_RESHARD_AFTER_FORWARD = "set_reshard_after_forward"
    """``set_reshard_after_forward(module, on, *, recurse)`` (FSDP2's ``FSDPModule`` method): whether the module
    (``recurse``: and those under it) frees its unsharded parameters after forward; no value a user reads changes."""
    GRADIENT_DIVIDE_FACTOR = "gradient_divide_factor"
    """``set_gradient_divide_factor(module, factor)`` (FSDP2's ``FSDPModule`` method, the module's own
    parameters only): their reduction divides the sum over ranks by ``factor`` instead of the world size."""
    REDUCE_SCATTER_DIVIDE_FACTOR = "reduce_scatter_divide_factor"
    """``set_reduce_scatter_divide_factor(module, factor)`` (FSDP2's deprecated alias): as
    ``set_gradient_divide_factor`` (:attr:`GRADIENT_DIVIDE_FACTOR`); a ``DeprecationWarning`` is allowed."""
    ALL_REDUCE_CONTROLS = "all_reduce_controls"
    """On a 2-D (replicate, shard) mesh: ``set_requires_all_reduce(module, on)`` (off, backward reduce-scatters but
    does not all-reduce over the replicas; the next backward that does covers what was kept) and
    ``set_all_reduce_hook(module, hook)`` (``hook`` runs on the all-reduced gradient, in place, before it reaches
    the optimizer); FSDP2's ``FSDPModule`` methods of the same names."""
    RESET_ITER_STATE = "reset_iter_state"
    """``reset_iter_state(module)`` on the root (FSDP2's ``FSDPModule`` method): after an exception raised mid
    forward or backward, the next iteration trains as a fresh one."""
    IS_LAST_BACKWARD = "is_last_backward"
    """``set_is_last_backward(module, on)`` on the root (FSDP2's ``FSDPModule`` method): off, a backward of a
    micro-batch need not finish its gradient reductions; the next backward with it on does, and the gradients
    are then those of every micro-batch."""
    UNSHARD_IN_BACKWARD = "unshard_in_backward"
    """``set_unshard_in_backward(module, on)`` (FSDP2's ``FSDPModule`` method): off, for a module whose
    parameters backward does not read (an embedding), backward computes its gradients without all-gathering them."""
    FORWARD_METHODS = "forward_methods"
    """``register_forward_method(module, name)`` (FSDP2's ``register_fsdp_forward_method``): calling that method
    of a ``fully_shard``-ed module gathers its parameters as ``forward`` does, so it computes what the local
    module's method computes, and backward through it reduces its gradients."""
    CUSTOM_COMMS = "custom_comms"
    """``set_custom_comms(module, *, all_gather, reduce_scatter)`` (FSDP2's ``set_custom_all_gather`` /
    ``set_custom_reduce_scatter``): the module's all-gathers and reduce-scatters go through the given objects,
    torch's protocol (``allocate(size, *, dtype, device)``; ``comm(output, input, group[, op], async_op)``)."""
    REDUCE_SCATTER_UNUSED_PARAMS = "reduce_scatter_unused_params"
    """``set_reduce_scatter_unused_params(module, on)`` (FSDP2's ``FSDPModule`` method, recursive): on, a parameter a
    rank's backward gave no gradient is reduced as zeros, so ranks may use different parameters of a module in one
    backward and the gradients are the mean over ranks as ever."""
    META_INIT = "meta_init"
    """``fully_shard`` accepts a module built on the meta device; ``to_empty(device=...)`` then gives
    every parameter local storage that user code fills (a ``reset_parameters``), and training reads it."""
    DCP_RESHARD = "dcp_reshard"
    """A model the adapter sharded (``fully_shard`` where it declares :attr:`FULLY_SHARD`, else ``wrap``) and
    its optimizer, through ``torch.distributed.checkpoint.state_dict``'s ``get_state_dict``/``set_state_dict``,
    save with DCP on one number of ranks and load on another."""
    OPTIM_STATE_DICT_ON_THREADS = "optim_state_dict_on_threads"
    """Deprecated, ignored: a declared :attr:`OPTIM_STATE_DICT` holds on thread ranks unless ``thread_rank_limits``
    says otherwise."""
    FULL_STATE_DICT_LOAD_ON_THREADS = "full_state_dict_load_on_threads"
    """Deprecated, ignored: a declared :attr:`FULL_STATE_DICT` loads on thread ranks unless ``thread_rank_limits``
    says otherwise."""
    OPTIM_STATE_DICT_FUNCTIONS = "optim_state_dict_functions"
    """FSDP1's optimizer state-dict functions beside ``optim_state_dict``: the adapter defines
    ``full_optim_state_dict``, ``sharded_optim_state_dict``, ``shard_full_optim_state_dict``,
    ``scatter_full_optim_state_dict``, ``flatten_sharded_optim_state_dict`` and ``rekey_optim_state_dict``
    (:func:`conformance.contract.optional.full_optim_state_dict` and after), each as torch documents it."""
    STATE_DICT_SETTINGS = "state_dict_settings"
    """FSDP1's ``set_state_dict_type`` / ``get_state_dict_type`` with their options
    (:class:`StateDictSettingsSpec`): the adapter defines ``set_state_dict_type(model, settings)``,
    ``get_state_dict_type(model)``, ``optim_state_dict_as_set(model, optim)`` and
    ``load_optim_state_dict_as_set(model, optim, osd)``; afterwards the model's own
    ``state_dict()`` and the optimizer state dict take the type and options set."""
    WRAPPER_METHODS = "wrapper_methods"
    """FSDP1's methods on a wrapped model: the adapter defines ``clip_grad_norm``, ``apply_with_full_params``,
    ``check_is_root``, ``fsdp_modules``, ``named_buffers`` and ``register_comm_hook``
    (:mod:`conformance.contract.wrapper_methods`), each as torch documents FSDP1's method."""
    IGNORED_STATES = "ignored_states"
    """``WrapSpec.ignored_states`` (FSDP1's ``ignored_states``: parameters, or modules): they stay whole and
    unreduced, each rank keeping its own gradient, as ``ignored_modules``'."""
    MP_CAST_UNIT_FORWARD_INPUTS = "mp_cast_unit_forward_inputs"
    """``MixedPrecisionSpec.cast_unit_forward_inputs`` is honoured (FSDP1's ``MixedPrecision.cast_forward_inputs``):
    True, every unit casts the floating tensors of its forward inputs to ``param_dtype``; False, a nested unit
    leaves them as its caller gave them."""
    LOCAL_STATE_DICT = "local_state_dict"
    """:attr:`STATE_DICT_SETTINGS` also takes ``kind="LOCAL_STATE_DICT"``: each rank's local shard, loaded into a
    model wrapped the same way on the same world (FSDP1's ``LocalStateDictConfig`` / ``LocalOptimStateDictConfig``)."""
    THREAD_RANKS = "thread_ranks"
    """Runs under the harness's threaded process group (one process, N threads); every case needs it on thread
    ranks (:meth:`CaseSpec.required`): without it those rows are ``n/a``, not failures saying nothing of FSDP."""
    def __str__(self) -> str:
        return self.value
