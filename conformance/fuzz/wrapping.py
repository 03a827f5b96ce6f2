"""A stateful program's wrapped model, what of programs an adapter can run, and a program's reproducer.

[Note: hybrid programs]
Where the world is several "nodes" of :data:`~conformance.fuzz.ops.NODE`
ranks (:func:`~conformance.fuzz.ops.hybrid_fits`), a ``wrap`` program's
``FULL_SHARD`` or ``SHARD_GRAD_OP`` may become its hybrid counterpart
(``HYBRID_SHARD``, ``_HYBRID_SHARD_ZERO2``) for every unit, given an explicit
``(shard, replicate)`` group tuple: shard groups of ``NODE`` consecutive ranks,
replicate groups of the ranks at the same place in each node
(``fixtures.meshes.hybrid_groups``). Drawn only where the adapter can express
both strategies with a group tuple (:attr:`Capability.HYBRID_VIA_PG_TUPLE`).
Training must look as it does on the whole world with any other strategy: the
shadow averages every rank's gradient, so a replica left out of the reduction,
or a mean over the shard group only, shows in the gradients and parameters.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from conformance.contract.adapter import AutoWrap, Capability, FSDPAdapter, WrapSpec
from conformance.contract.applicability import missing_reason
from conformance.contract.messages import NO_SHARD_SWITCH
from conformance.contract.optional import (
    activation_checkpoint_wrapper,
    capabilities_of,
    supports_no_sync,
    takes_param_dtype,
    thread_rank_load_limits,
)
from conformance.fuzz.controls import fully_shard_features, fully_shard_requires
from conformance.fuzz.drawn_precision import mixed_precision_spec, precision_features, required
from conformance.fuzz.example import source
from conformance.fuzz.ops import HYBRID_OF, NODE, Program, ProgramConfig, WrapConfig
from fixtures.meshes import hybrid_groups
from fixtures.parity import assert_close_named
from harness.ranks.rank_mode import RankMode

if TYPE_CHECKING:
    from harness import RankContext

__all__ = ["assert_ignored_kept", "features_of", "given_groups", "missing_operations", "wrap_config",
           "render_program"]


def features_of(impl: FSDPAdapter) -> frozenset[str]:
    """The configuration :data:`~conformance.fuzz.ops.FEATURES` ``impl`` can express."""
    caps = capabilities_of(impl)
    cpu_offload = {"cpu_offload"} if Capability.CPU_OFFLOAD in caps else set()
    cast = {"cast_forward_inputs"} if {Capability.MIXED_PRECISION, Capability.MP_CAST_FORWARD_INPUTS} <= caps else set()
    hybrid = Capability.HYBRID_VIA_PG_TUPLE in caps and all(
        impl.supports_strategy(s) for s in HYBRID_OF.values())
    keep_low = {"keep_low_precision_grads"} if {Capability.MIXED_PRECISION,
                                                Capability.MP_KEEP_LOW_PRECISION_GRADS} <= caps else set()
    ignored = {"ignored_modules"} if Capability.IGNORED_MODULES in caps else set()
    float64 = {"float64"} if takes_param_dtype(impl, torch.float64) else set()
    return (precision_features(impl) | cpu_offload | cast | keep_low | ignored | ({"hybrid"} if hybrid else set())
            | float64 | fully_shard_features(impl))


def missing_operations(impl: FSDPAdapter, mode: RankMode, wrapped_with: str | None = None) -> dict[str, str]:
    """Operations ``impl`` cannot run in rank ``mode`` -> why (they are skipped); ``wrapped_with``: the strategy
    of a program that wraps (``no_sync`` is missing where the adapter has none under it)."""
    needs = {"no_sync": [Capability.NO_SYNC], "full save": [Capability.FULL_STATE_DICT],
             "sharded save": [Capability.SHARDED_STATE_DICT], "optimizer save": [Capability.OPTIM_STATE_DICT],
             "full load": [Capability.FULL_STATE_DICT], "clip_grad_norm": [Capability.WRAPPER_METHODS],
             "apply_with_full_params": [Capability.WRAPPER_METHODS], "reshard": [Capability.FULLY_SHARD_CONTROLS]}
    reasons = {op: missing_reason(impl, caps, mode) for op, caps in needs.items()}
    reasons["sharded load"] = reasons["sharded save"] or _load_limit(impl, Capability.SHARDED_STATE_DICT, mode)
    reasons["summoned_params"] = reasons["clip_grad_norm"] or (
        None if callable(getattr(impl, "summoned_params", None)) else f"{impl.name} has no summoned_params")
    if reasons["no_sync"] is None and wrapped_with is not None and not supports_no_sync(impl, wrapped_with):
        reasons["no_sync"] = f"{impl.name} has no no_sync under strategy {wrapped_with}"
    return {op: reason for op, reason in reasons.items() if reason is not None}


def _load_limit(impl: FSDPAdapter, capability: Capability, mode: RankMode) -> str | None:
    """Why ``impl`` cannot load a ``capability`` state dict on ``mode`` ranks though it saves one there."""
    limit = thread_rank_load_limits(impl).get(capability) if mode is RankMode.THREAD else None
    return None if limit is None else f"{impl.name} loads {capability} state dicts on process ranks only: {limit}"


def given_groups(ctx: RankContext, config: ProgramConfig) -> tuple[Any, Any] | None:
    """The ``(shard, replicate)`` groups of a hybrid program ([Note: hybrid programs]), made anew; else ``None``."""
    return hybrid_groups(ctx, NODE) if config.hybrid else None


def wrap_config(ctx: RankContext, impl: FSDPAdapter, model: nn.Module, config: WrapConfig,
                groups: tuple[Any, Any] | None) -> nn.Module:
    """Checkpoint the config's paths (deepest first), then wrap the root with each of the config's wrap paths a
    unit under it (a plan; a block both checkpointed and a unit: its checkpoint wrapper inside its unit); a
    hybrid strategy with ``groups`` (:func:`given_groups`). At world size 1 the wrap must warn of the switch
    to ``NO_SHARD`` where the adapter declares it."""
    ignored = tuple(model.get_submodule(p) for p in config.ignored)
    units = {path: model.get_submodule(path) for path in config.wrap}
    for path in sorted(config.checkpoint, key=lambda p: p.count("."), reverse=True):
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        checkpointed = activation_checkpoint_wrapper(impl, getattr(parent, name), offload=False)
        setattr(parent, name, checkpointed)
        if path in units:
            units[path] = checkpointed
    plan = AutoWrap.submodules(model, units.values()) if units else None
    spec = WrapSpec(strategy=config.strategy, use_orig_params=config.use_orig_params, process_group=groups,
                    mixed_precision=mixed_precision_spec(config.policy), cpu_offload=config.cpu_offload,
                    auto_wrap=plan, ignored_modules=ignored)
    with ctx.catch_warnings() as caught:
        root = impl.wrap(model, spec)
    switched = [w for w in caught if str(w.message).startswith(NO_SHARD_SWITCH)]
    declared = Capability.WORLD_SIZE_1_SWITCH in capabilities_of(impl)
    if ctx.world_size == 1 and config.strategy != "NO_SHARD" and declared and not switched:
        raise AssertionError(f"wrapping at world size 1 with {config.strategy} did not warn {NO_SHARD_SWITCH!r}..., "
                             "as the adapter declares (Capability.WORLD_SIZE_1_SWITCH)")
    return root


def assert_ignored_kept(ignored: dict[str, nn.Module], local: nn.Module) -> None:
    """Each ignored module (the user's object) still holds its own full parameters, equal to the shadow's
    ([Note: ignored modules in programs] in :mod:`conformance.fuzz.configs`)."""
    for path, module in ignored.items():
        got = {name: param.detach() for name, param in module.named_parameters()}
        want = {name: param.detach() for name, param in local.get_submodule(path).named_parameters()}
        sharded = sorted(name for name, value in got.items() if hasattr(value, "full_tensor"))
        if sharded:
            raise AssertionError(f"ignored module {path!r} holds sharded parameters (DTensors): {sharded}")
        if sorted(got) != sorted(want) or any(got[n].shape != want[n].shape for n in want):
            shapes = [{name: tuple(value.shape) for name, value in side.items()} for side in (got, want)]
            raise AssertionError(f"ignored module {path!r} holds parameters {shapes[0]}, the shadow's "
                                 f"{shapes[1]}: an ignored module keeps its own full parameters")
        assert_close_named(got, want, what=f"ignored {path}")


def render_program(program: Program, message: str) -> str:
    """A ready-to-paste case reproducing ``program`` (for ``conformance/cases/test_fuzz.py``)."""
    digest = hashlib.sha1(repr(program).encode()).hexdigest()[:8]
    found = " ".join(message.split())[:300]
    wrapped = program.config if isinstance(program.config, WrapConfig) else None  # fully_shard's needs: below
    needs = [f"Capability.{cap.name}" for cap in required(wrapped.policy if wrapped else None)]
    needs += ["Capability.CPU_OFFLOAD"] * bool(wrapped and wrapped.cpu_offload)
    needs += ["Capability.HYBRID_VIA_PG_TUPLE"] * program.config.hybrid
    needs += ["Capability.IGNORED_MODULES"] * bool(program.config.ignored)
    needs += [f"Capability.{cap.name}" for cap in fully_shard_requires(program)]
    requires = f", requires=[{', '.join(needs)}]" if needs else ""
    return (
        f"# Found by the stateful fuzzer: {found}\n"
        "# Name it by the behaviour it pins, fuzz/repro_<behaviour> (docs/ADDING_A_CASE.md): "
        f"repro_{digest} is a placeholder\n"
        f'@case("fuzz/repro_{digest}", clause=("C1", "C2"), world_size={program.config.world_size}{requires}, '
        f"uses=NEIGHBOURS_USE)\n"
        f"def test_repro_{digest}(ctx: RankContext, impl: FSDPAdapter) -> None:\n"
        f"    run_program(ctx, impl, {source(program)})\n"
    )
