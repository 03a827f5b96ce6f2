"""checkpoint: activation checkpointing and activation offload compose with units.

The adapter's activation-checkpoint wrappers (torch's ``checkpoint_wrapper`` /
``offload_wrapper`` unless it brings its own, see
:func:`conformance.contract.optional.activation_checkpoint_wrapper`) and
``torch.utils.checkpoint`` are placed outside units, inside them, or around a
whole unit; every placement must train like the model without them (torch's
default tolerances: see ``_assert_same_step``).

[Note: save-on-CPU spy]
"Activations really were offloaded" is checked on the hook the offload wrapper
itself calls: ``OffloadWrapper.forward`` enters the ``save_on_cpu`` it finds as
a global of ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``; an
adapter's own offload wrapper enters ``torch.autograd.graph.save_on_cpu``.
:func:`spy_save_on_cpu` swaps both for one that builds the real hooks
and counts, per calling thread, the tensors its pack hook moves. Thread ranks
share the module, so the swap is reference-counted under a lock and the counts
are keyed by thread; a count above zero means autograd packed activations
through the wrapper's hook, not merely that the wrapper was constructed.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import pytest
import torch
import torch.autograd.graph as autograd_graph
import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as ckpt_wrapper_module
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from conformance.contract.adapter import AutoWrap, Capability, FSDPAdapter, WrapSpec
from conformance.contract.case import TWO_OR_MORE, case
from conformance.contract.exposures import parameter_exposures, under_exposure
from conformance.contract.optional import activation_checkpoint_wrapper, full_grads
from fixtures.checkpointing import FFN, CheckpointBlock, CheckpointTower, ffn_layers
from fixtures.parity import assert_close_named, assert_close_seq
from fixtures.seeding import generator, rank_seed

if TYPE_CHECKING:
    from harness import RankContext

# -- the save-on-CPU spy ([Note: save-on-CPU spy]) -------------------------------------------
_spy_lock = threading.Lock()
_spy_depth = 0
_SPIED = (ckpt_wrapper_module, autograd_graph)
_spy_original: Callable[..., Any] | None = None
_packed: dict[int, int] = {}


def _counting_save_on_cpu(*args: Any, **kwargs: Any) -> Any:
    assert _spy_original is not None
    hooks = _spy_original(*args, **kwargs)
    pack = hooks.pack_hook

    def counting_pack(tensor: torch.Tensor) -> Any:
        ident = threading.get_ident()
        _packed[ident] = _packed.get(ident, 0) + 1
        return pack(tensor)

    hooks.pack_hook = counting_pack
    return hooks


@contextlib.contextmanager
def spy_save_on_cpu() -> Iterator[Callable[[], int]]:
    """Count this thread's activations packed by the offload wrapper; yields a reader."""
    global _spy_depth, _spy_original
    with _spy_lock:
        if _spy_depth == 0:
            _spy_original = autograd_graph.save_on_cpu
            for module in _SPIED:
                module.save_on_cpu = _counting_save_on_cpu  # type: ignore[misc,assignment]
        _spy_depth += 1
    ident = threading.get_ident()
    _packed[ident] = 0
    try:
        yield lambda: _packed[ident]
    finally:
        with _spy_lock:
            _spy_depth -= 1
            if _spy_depth == 0:
                for module in _SPIED:
                    module.save_on_cpu = _spy_original  # type: ignore[misc,assignment]
                _spy_original = None
        _packed.pop(ident, None)


# -- shared pieces ---------------------------------------------------------------------------
def _requires(params: Mapping[str, Any]) -> list[Capability]:
    return [Capability.CPU_OFFLOAD] if params["cpu_offload"] else []


def _grid(fn: Callable[..., Any]) -> Callable[..., Any]:
    """cpu_offload (parameters) x offload_activations, as the seed; the seed's third axis, use_orig_params,
    is run inside each row ([Note: parameter exposures] in ``conformance.contract.exposures``)."""
    fn = pytest.mark.parametrize("offload_activations", [True, False])(fn)
    return pytest.mark.parametrize("cpu_offload", [True, False])(fn)


def _layers(device: torch.device) -> list[nn.Module]:
    """The three seed-0 linears every model in a case starts from (equal values each call),
    on the rank's device: units are given no ``device_id``, so modules start where they compute."""
    return [layer.to(device) for layer in ffn_layers(seed=0)]


def _activation_wrapper(impl: FSDPAdapter, offload_activations: bool) -> Callable[[nn.Module], nn.Module]:
    return lambda module: activation_checkpoint_wrapper(impl, module, offload=offload_activations)


def _input(ctx: RankContext) -> torch.Tensor:
    # Reentrant checkpointing needs an input that requires grad.
    return (
        torch.randn(10, 3, generator=generator(rank_seed(0, ctx.rank)))
        .to(ctx.device)
        .requires_grad_()
    )


def _assert_same_step(
    ctx: RankContext,
    step: int,
    names: list[str],
    results: list[tuple[torch.Tensor, torch.Tensor]],
    models: list[nn.Module],
) -> None:
    """Every model's loss, output and accumulated grads equal the first model's (default tolerances).

    Not bit-exact: activation offload and recomputation may take other kernels on
    another machine (1-2 ULP seen on a 16-core CPU), see [Note: exact comparisons]
    in ``fixtures/parity.py``.
    """
    ref_loss, ref_out = results[0]
    ref_grads = [p.grad for p in models[0].parameters()]
    for name, (loss, out), model in zip(names[1:], results[1:], models[1:], strict=True):
        label = f"rank {ctx.rank} iteration {step}: {name} vs {names[0]}"
        assert_close_seq(
            [loss, out], [ref_loss, ref_out], what=f"{label} (loss, output)"
        )
        assert_close_seq(
            [p.grad for p in model.parameters()], ref_grads, what=f"{label} grads"
        )


def _check_offload(ctx: RankContext, step: int, name: str, packed: int, expect: bool) -> None:
    if expect:
        assert packed > 0, (
            f"rank {ctx.rank} iteration {step}: {name} offloads activations but packed none "
            "through the offload wrapper's save_on_cpu"
        )
    else:
        assert packed == 0, (
            f"rank {ctx.rank} iteration {step}: {name} packed {packed} activations; expected none"
        )


def _plain_forward(_name: str, model: nn.Module, inp: torch.Tensor) -> torch.Tensor:
    return model(inp)


def _train_side_by_side(
    ctx: RankContext,
    models: dict[str, nn.Module],
    steps: int,
    offloads: Callable[[str], bool],
    forward: Callable[[str, nn.Module, torch.Tensor], torch.Tensor] = _plain_forward,
) -> None:
    """Each step, every model runs forward and backward on the same input and must match the first
    model (:func:`_assert_same_step`); in the first step, exactly the models ``offloads`` names pack
    activations through ``save_on_cpu``."""
    names, modules = list(models), list(models.values())
    inp = _input(ctx)
    with spy_save_on_cpu() as packed:
        for step in range(steps):
            results = []
            for name, model in models.items():
                before = packed()
                out = forward(name, model, inp)
                if step == 0:
                    _check_offload(ctx, step, name, packed() - before, expect=offloads(name))
                loss = out.sum()
                loss.backward()
                results.append((loss.detach(), out.detach()))
            _assert_same_step(ctx, step, names, results, modules)


#: Builds a model given ``unit``, what to make of each module that is to be a unit.
_Builder = Callable[[Callable[[Callable[[nn.Module], nn.Module]], nn.Module]], nn.Module]


def _roots(impl: FSDPAdapter, spec: WrapSpec) -> _Builder:
    """Each module ``unit`` is given is wrapped as a root of its own."""
    return lambda make: make(lambda module: impl.wrap(module, spec))


def _nested(impl: FSDPAdapter, spec: WrapSpec) -> _Builder:
    """The model is wrapped once, with each module ``unit`` was given a unit under the root (a plan)."""
    def build(make: Callable[[Callable[[nn.Module], nn.Module]], nn.Module]) -> nn.Module:
        chosen: list[nn.Module] = []

        def keep(module: nn.Module) -> nn.Module:
            chosen.append(module)
            return module

        model = make(keep)
        return impl.wrap(model, replace(spec, auto_wrap=AutoWrap.submodules(model, chosen)))

    return build


# -- cases -------------------------------------------------------------------------------------
@case("checkpoint/checkpoint_fsdp_wrapping", world_size=TWO_OR_MORE, requires=_requires, uses=[Capability.FLAT_PARAM],
      clause="C17")
@_grid
@pytest.mark.parametrize("nesting", ["roots", "under_root"])
def test_checkpoint_fsdp_wrapping(
    ctx: RankContext, impl: FSDPAdapter, cpu_offload: bool, offload_activations: bool, nesting: str
) -> None:
    """The activation wrapper outside per-layer units and inside each unit give the loss, output and
    grads of the units alone over two steps; with offload on, both pack activations through ``save_on_cpu``.
    For every parameter exposure the implementation offers (original parameters; also flat ones where it
    declares flat_param).

    ``roots``: each layer's unit is its own root, as in the seed; roots keep their
    parameters between forward and backward. ``under_root``: the same units nested
    under one root unit (what auto-wrapping produces), so FULL_SHARD frees each
    layer's parameters after forward and recomputation in backward must gather
    them again.
    """
    wrapper = _activation_wrapper(impl, offload_activations)
    for use_orig_params in parameter_exposures(impl):
        spec = WrapSpec(cpu_offload=cpu_offload, use_orig_params=use_orig_params)
        build = _nested(impl, spec) if nesting == "under_root" else _roots(impl, spec)
        models = {
            "wrapper outside units": build(lambda unit: wrapper(FFN(_layers(ctx.device), unit))),
            "wrapper inside each unit": build(
                lambda unit: FFN(_layers(ctx.device), lambda layer: unit(wrapper(layer)))),
            "units only": build(lambda unit: FFN(_layers(ctx.device), unit)),
        }
        with under_exposure(use_orig_params):
            _train_side_by_side(ctx, models, 2, lambda name: offload_activations and name != "units only")


@case("checkpoint/basic_checkpoint_end_to_end", world_size=TWO_OR_MORE, requires=_requires,
      uses=[Capability.FLAT_PARAM],
      clause="C17")
@_grid
def test_basic_checkpoint_end_to_end(
    ctx: RankContext, impl: FSDPAdapter, cpu_offload: bool, offload_activations: bool
) -> None:
    """A unit alone, the activation wrapper around a unit, a unit around the wrapper, and reentrant
    ``checkpoint()`` of a unit give the same loss, output and grads over six steps (default tolerances);
    with offload on, every model but the plain unit packs activations through ``save_on_cpu`` in step one.
    For every parameter exposure the implementation offers.
    """
    wrapper = _activation_wrapper(impl, offload_activations)

    def forward(name: str, model: nn.Module, inp: torch.Tensor) -> torch.Tensor:
        if not name.startswith("checkpoint("):
            return model(inp)
        # Offload here is the caller's own save_on_cpu (as in the seed), built through the spy so
        # that its packed activations are counted too.
        offload = _counting_save_on_cpu(pin_memory=True) if offload_activations else contextlib.nullcontext()
        with offload:
            return cast(torch.Tensor, checkpoint(model, inp, use_reentrant=True))

    for use_orig_params in parameter_exposures(impl):
        spec = WrapSpec(cpu_offload=cpu_offload, use_orig_params=use_orig_params)
        seq = FFN(_layers(ctx.device))
        models = {
            "unit only": impl.wrap(copy.deepcopy(seq), spec),
            "wrapper(unit)": wrapper(impl.wrap(copy.deepcopy(seq), spec)),
            "unit(wrapper)": impl.wrap(wrapper(copy.deepcopy(seq)), spec),
            "checkpoint(unit), reentrant": impl.wrap(copy.deepcopy(seq), spec),
        }
        with under_exposure(use_orig_params):
            _train_side_by_side(ctx, models, 6, lambda name: offload_activations and name != "unit only", forward)


@case("checkpoint/checkpoint_submodule", clause="C17", world_size=TWO_OR_MORE, strategies=["NO_SHARD"])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_submodule(ctx: RankContext, impl: FSDPAdapter, use_reentrant: bool) -> None:
    """``torch.utils.checkpoint`` inside NO_SHARD units gives the grads of the plain model.

    The catalog row is the seed's non-reentrant variant. The reentrant one is added:
    its nested backward flushes the unit's gradient before the outer backward is done
    with the unit, so a unit's post-backward work runs more than once per backward,
    the bug the seed's test was written for (and had to leave disabled).
    """
    model = CheckpointTower(seed=0, use_reentrant=use_reentrant).to(ctx.device)
    checkpointed = copy.deepcopy(model)
    checkpointed.enable_checkpointing()
    blocks = [m for m in checkpointed.modules() if isinstance(m, CheckpointBlock)]
    assert len(blocks) == 4 and all(b.checkpoint for b in blocks), (
        "enable_checkpointing missed a block"
    )
    spec = WrapSpec(strategy="NO_SHARD")
    for tower in (model, checkpointed):
        tower.stage1 = impl.wrap(tower.stage1, spec)  # type: ignore[assignment]
        tower.stage2 = impl.wrap(tower.stage2, spec)  # type: ignore[assignment]
    x = torch.randn(2, 32, generator=generator(rank_seed(0, ctx.rank))).to(ctx.device)
    model(x).sum().backward()
    checkpointed(x).sum().backward()
    grads = _tower_grads(impl, model)
    assert all(g is not None for g in grads.values()), (
        f"unused parameters: {[n for n, g in grads.items() if g is None]}"
    )
    assert_close_named(
        _tower_grads(impl, checkpointed),
        grads,
        what=f"rank {ctx.rank}: grads with {'' if use_reentrant else 'non-'}reentrant checkpoint vs without",
    )


def _tower_grads(impl: FSDPAdapter, tower: nn.Module) -> dict[str, torch.Tensor | None]:
    """Each parameter's gradient after backward: the wrapped stages' full gradients where the adapter exposes
    them (an implementation that keeps gradients in its own storage, DeepSpeed's ZeRO partitions), keyed
    ``stage.name``; else every parameter's ``.grad``. Collective: every rank calls it."""
    stages = {name: full_grads(impl, getattr(tower, name)) for name in ("stage1", "stage2")}
    if any(grads is None for grads in stages.values()):
        return {n: p.grad for n, p in tower.named_parameters()}
    out = {f"{stage}.{n}": g for stage, grads in stages.items() for n, g in (grads or {}).items()}
    out.update({n: p.grad for n, p in tower.named_parameters() if not n.startswith(("stage1.", "stage2."))})
    return out
