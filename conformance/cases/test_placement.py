"""placement: device placement — where parameters live before, during and after wrapping.

CPU rows pin the compute device to the CPU; rows the catalogue marks GPU
declare ``gpus=ANY_GPU`` (they also run with ranks sharing one GPU) or
``gpus=distinct_gpus(2)`` (they need ``cuda:{rank}`` per rank) and compute on
``ctx.device``. A behaviour the catalogue checks on both (its "GPU variant")
is one case with the grid parameter ``on`` (``gpus=gpu_rows``).
Every case here requires :attr:`Capability.COMPUTE_DEVICE` (``device_id`` is
honoured) and/or :attr:`Capability.PLACEMENT_MESSAGES` (FSDP1's exact
placement warnings and errors). Where a module ends up is checked in rows that
need only the former; FSDP1's warning or error for the same setup is a row of
its own (``..._warns``, ``..._raises``) that needs the latter; see
[Note: CPU groups] in ``fixtures/cpu_groups.py`` for why, and for the
gloo groups the CPU-pinned cases use.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import replace
from itertools import chain
from typing import TYPE_CHECKING, Any, cast

import pytest
import torch
import torch.nn as nn

from conformance.contract import optional
from conformance.contract.adapter import AutoWrap, Capability, FSDPAdapter, WrapSpec
from conformance.contract.case import ANY_GPU, TWO_OR_MORE, Exact, case, distinct_gpus, gpu_rows
from fixtures.cpu_groups import cpu_world_group, cuda_device
from fixtures.misc_models import NoParamsModel, SeqAndLinear
from fixtures.models import NestedModel, PairOfLinears, TiedTransformer
from fixtures.parity import assert_close_named, assert_runs_match, assert_same_across_ranks, run_steps
from fixtures.seeding import generator, rank_seed

if TYPE_CHECKING:
    from harness import RankContext

CPU = torch.device("cpu")
COMPUTE = [Capability.COMPUTE_DEVICE]
MESSAGES = [Capability.PLACEMENT_MESSAGES]
SYNC_CPU_ERROR = "The module has CPU parameters or buffers when `sync_module_states=True`"
#: A case with GPU rows only: no row of it has run at another size yet.
GPU_ONLY = Exact(2, reason="GPU rows only, not yet run at another size")
#: A module or a message that spans two GPUs, one per rank.
TWO_GPUS = Exact(2, reason="two distinct GPUs, one per rank")


def _assert_units_on(impl: FSDPAdapter, model: nn.Module, device: torch.device, what: str) -> None:
    """Every unit computes on ``device`` and every local shard lives there (at least one shard)."""
    units = impl.units(model)
    shards = [(u.fqn, s.device) for u in units for s in u.local_shards]
    assert shards, f"{what}: no unit reports a local shard"
    wrong = [(fqn, str(dev)) for fqn, dev in shards if dev != device]
    assert not wrong, f"{what}: shards not on {device}: {wrong}"
    compute = {u.fqn: u.compute_device for u in units}
    off = {fqn: str(dev) for fqn, dev in compute.items() if dev != device}
    assert not off, f"{what}: compute devices not {device}: {off}"


def _warned(caught: Iterable[object], pattern: str) -> bool:
    return any(
        issubclass(w.category, UserWarning) and re.search(pattern, str(w.message))  # type: ignore[attr-defined]
        for w in caught
    )


# -- sync_module_states with a CPU module ----------------------------------------------


def _rank_buffers(model: NestedModel, rank: int) -> None:
    model.register_buffer("buf", torch.full((2, 2), float(rank)))
    model.module[0].register_buffer("buf", torch.full((3, 2), float(rank)))


def _check_synced_buffers(ctx: RankContext, model: NestedModel, device: torch.device) -> None:
    """Buffers registered per rank (value = rank) now hold rank 0's zeros, on ``device``."""
    # Attribute access, as a user reads them: an FSDP1 wrapper around module[0] forwards ``buf``.
    buffers: dict[str, torch.Tensor] = {"buf": cast(torch.Tensor, model.buf),
                                        "module.0.buf": cast(torch.Tensor, model.module[0].buf)}
    for name, buf in buffers.items():
        assert buf.device == device, f"{name} on {buf.device}, expected {device}"
        assert torch.equal(buf.cpu(), torch.zeros_like(buf, device="cpu")), (
            f"rank {ctx.rank}: {name} = {buf.tolist()}, expected rank 0's zeros"
        )


@case("placement/cpu_init_with_sync_module_states", clause=("C14", "C6"), world_size=TWO_OR_MORE, gpus=gpu_rows,
      requires=[Capability.SYNC_MODULE_STATES, Capability.COMPUTE_DEVICE])
@pytest.mark.parametrize("on", ["cpu", "gpu"])
def test_cpu_init_with_sync_module_states(ctx: RankContext, impl: FSDPAdapter, on: str) -> None:
    """A CPU module + sync_module_states gives every rank the same params and rank 0's buffers, on
    ``device_id``; computing on a GPU without ``device_id`` it raises a ValueError about CPU parameters."""
    device, group = (cuda_device(ctx), None) if on == "gpu" else (CPU, cpu_world_group(ctx))
    if on == "gpu":
        with pytest.raises(ValueError, match=SYNC_CPU_ERROR):
            impl.wrap(NestedModel(seed=ctx.rank), WrapSpec(sync_module_states=True))
    inner = NestedModel(seed=ctx.rank)
    _rank_buffers(inner, ctx.rank)
    spec = WrapSpec(auto_wrap=AutoWrap((nn.Linear,)), device_id=device, sync_module_states=True, process_group=group)
    fsdp = impl.wrap(inner, spec)
    _check_synced_buffers(ctx, inner, device)
    assert_same_across_ranks(impl.full_params(fsdp), what="params after sync_module_states")


# -- CPU offload, ignored modules, parameterless modules --------------------------------


def _device_id_cpu_offload(
    ctx: RankContext, impl: FSDPAdapter, device: torch.device, group: object, use_orig_params: bool
) -> None:
    """Offloaded flat parameters stay on the CPU, and train like the same model without offload.

    Compared with default tolerances: offloading copies parameters and gradients
    between devices, which may change the kernels (and the last bits) on another
    machine ([Note: exact comparisons] in ``fixtures/parity.py``).

    On a CPU-only machine the placement check cannot tell offload from no offload
    (everything is on the CPU); the training comparison still exercises the offload
    path's own gradient handling there.
    """
    spec = WrapSpec(auto_wrap=AutoWrap((nn.Sequential,)), cpu_offload=True, device_id=device,
                    use_orig_params=use_orig_params, process_group=group)
    fsdp = impl.wrap(SeqAndLinear(seed=0), spec)
    units = impl.units(fsdp)
    assert len([u for u in units if u.local_shards]) >= 2, "expected the root and seq to own parameters"
    _assert_shards_on(units, CPU, "offloaded params")
    plain = impl.wrap(SeqAndLinear(seed=0), replace(spec, cpu_offload=False))
    inp = torch.randn((4, 10), generator=generator(rank_seed(0, ctx.rank))).to(device)
    runs = {
        name: run_steps(model, optional.optimizer(impl, model, torch.optim.SGD, lr=0.1), [(inp,)] * 2, _square_sum,
                        adapter=impl)
        for name, model in (("offload", fsdp), ("no offload", plain))
    }
    assert_runs_match(runs, reference="no offload")
    assert_close_named(impl.full_params(fsdp), impl.full_params(plain), what="params with vs without offload")
    _assert_shards_on(impl.units(fsdp), CPU, "offloaded params after training")


def _square_sum(out: torch.Tensor, batch: object) -> torch.Tensor:
    return out.square().sum()


def _assert_shards_on(units: list, device: torch.device, what: str) -> None:
    wrong = [(u.fqn, str(s.device)) for u in units for s in u.local_shards if s.device != device]
    assert not wrong, f"{what}: shards not on {device}: {wrong}"


@case("placement/device_id_cpu_offload", clause="C14", world_size=TWO_OR_MORE, gpus=gpu_rows,
      requires=[Capability.CPU_OFFLOAD, Capability.COMPUTE_DEVICE])
@pytest.mark.parametrize("on", ["cpu", "gpu"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_device_id_cpu_offload(ctx: RankContext, impl: FSDPAdapter, use_orig_params: bool, on: str) -> None:
    """device_id names the compute device (the CPU, or the rank's GPU), yet offloaded parameters stay on the CPU."""
    if on == "gpu":
        _device_id_cpu_offload(ctx, impl, cuda_device(ctx), None, use_orig_params)
    else:
        _device_id_cpu_offload(ctx, impl, CPU, cpu_world_group(ctx), use_orig_params)


def _meta_requires(params: Mapping[str, Any]) -> list[Capability]:
    init = Capability.PARAM_INIT_FUNCTION if params["use_param_init_fn"] else Capability.META_MATERIALIZATION
    return [Capability.IGNORED_MODULES, Capability.COMPUTE_DEVICE, init]


@case("placement/ignored_module_meta", clause="C14", world_size=TWO_OR_MORE,
      requires=_meta_requires)
@pytest.mark.parametrize("use_param_init_fn", [False, True])
def test_ignored_module_meta(ctx: RankContext, impl: FSDPAdapter, use_param_init_fn: bool) -> None:
    """Wrapping a meta-device module materialises it onto ``device_id`` (by ``param_init_fn``, or without
    one by ``reset_parameters()``), leaves its ignored submodule's params on meta and puts every unit's local
    shards on the rank's device. Both variants rely on materialisation at wrap time
    (:attr:`Capability.PARAM_INIT_FUNCTION`, else :attr:`Capability.META_MATERIALIZATION`)."""
    with torch.device("meta"):
        model = PairOfLinears()
    init_fn = (lambda m: m.to_empty(device=ctx.device, recurse=False)) if use_param_init_fn else None
    spec = WrapSpec(device_id=ctx.device, ignored_modules=[model.a], use_orig_params=True, param_init_fn=init_fn)
    fsdp = impl.wrap(model, spec)
    assert all(p.device.type == "meta" for p in model.a.parameters()), (
        f"ignored module left meta: {[str(p.device) for p in model.a.parameters()]}"
    )
    _assert_shards_on(impl.units(fsdp), ctx.device, "materialised params")


def _ignored_params_not_moved(impl: FSDPAdapter, device: torch.device, group: object) -> None:
    model = PairOfLinears(buffer_on_a=True)
    before = {id(t): (t.device, t.data_ptr()) for t in chain(model.a.parameters(), model.a.buffers())}
    impl.wrap(model, WrapSpec(device_id=device, ignored_modules=[model.a], use_orig_params=True, process_group=group))
    after = {id(t): (t.device, t.data_ptr()) for t in chain(model.a.parameters(), model.a.buffers())}
    assert after == before, f"ignored module's tensors changed: before {before}, after {after}"
    assert all(dev == CPU for dev, _ in after.values()), f"ignored tensors moved: {after}"


@case("placement/ignored_params_not_moved", clause="C14", world_size=TWO_OR_MORE, gpus=gpu_rows,
      requires=[Capability.IGNORED_MODULES, Capability.COMPUTE_DEVICE])
@pytest.mark.parametrize("on", ["cpu", "gpu"])
def test_ignored_params_not_moved(ctx: RankContext, impl: FSDPAdapter, on: str) -> None:
    """The ignored module keeps its very tensors (same objects, same storage, still CPU), even when
    device_id names the rank's GPU."""
    if on == "gpu":
        _ignored_params_not_moved(impl, cuda_device(ctx), None)
    else:
        _ignored_params_not_moved(impl, CPU, cpu_world_group(ctx))


@case("placement/no_params", clause="C14", world_size=TWO_OR_MORE,
      requires=lambda p: COMPUTE if p["use_device_id"] else [])
@pytest.mark.parametrize("use_device_id", [False, True])
def test_no_params(ctx: RankContext, impl: FSDPAdapter, use_device_id: bool) -> None:
    """A module with no parameters wraps without error and its forward gives exactly ``relu(input)``
    (nothing to shard is not an error)."""
    fsdp = impl.wrap(NoParamsModel(), WrapSpec(device_id=ctx.device if use_device_id else None))
    inp = torch.randn((3, 4), generator=generator(rank_seed(0, ctx.rank))).to(ctx.device)
    torch.testing.assert_close(fsdp(inp), torch.relu(inp), rtol=0, atol=0)


# -- GPU-only placement rows ------------------------------------------------------------


NO_INDEX = WrapSpec(auto_wrap=AutoWrap((nn.Linear,)), device_id=torch.device("cuda"))


@case("placement/device_id", clause="C14", world_size=GPU_ONLY, gpus=ANY_GPU, requires=COMPUTE)
@pytest.mark.parametrize("use_index", [True, False])
def test_device_id(ctx: RankContext, impl: FSDPAdapter, use_index: bool) -> None:
    """``device_id`` given as the rank's GPU index or device puts every unit's compute device and local
    shards on that GPU, for a CPU module and a GPU one; ``device_id=cuda`` without an index puts them on
    the current GPU (the rank's)."""
    device = cuda_device(ctx)
    device_id: int | torch.device = device.index if use_index else device
    spec = WrapSpec(auto_wrap=AutoWrap((nn.Linear,)), device_id=device_id)
    _assert_units_on(impl, impl.wrap(NestedModel(seed=0), spec), device, "CPU module + device_id")
    _assert_units_on(impl, impl.wrap(NestedModel(seed=0).to(device), spec), device, "GPU module + device_id")
    _assert_units_on(impl, impl.wrap(NestedModel(seed=0), NO_INDEX), device, "device_id=cuda without index")


@case("placement/device_id_without_index_warns", clause="C14", world_size=GPU_ONLY, gpus=ANY_GPU,
      requires=COMPUTE + MESSAGES)
def test_device_id_without_index_warns(ctx: RankContext, impl: FSDPAdapter) -> None:
    """``device_id=cuda`` without an index warns, as FSDP1 does, that it "does not have an explicit index"
    (where the module then lives is ``placement/device_id``)."""
    cuda_device(ctx)
    with ctx.catch_warnings() as caught:
        impl.wrap(NestedModel(seed=0), NO_INDEX)
    assert _warned(caught, "does not have an explicit index"), [str(w.message) for w in caught]


@case("placement/cpu_init_stays_on_cpu", clause="C14", world_size=GPU_ONLY, gpus=ANY_GPU, requires=MESSAGES)
def test_cpu_init_stays_on_cpu(ctx: RankContext, impl: FSDPAdapter) -> None:
    """A CPU module wrapped without ``device_id`` on a GPU host warns that the passed-in module is on CPU
    and keeps its params on the CPU; moved to the GPU afterwards, it takes a CPU input, gives its output
    on the GPU and runs backward."""
    device = cuda_device(ctx)
    with ctx.catch_warnings() as caught:
        fsdp = impl.wrap(NestedModel(seed=0), WrapSpec(auto_wrap=AutoWrap((nn.Linear,))))
    assert _warned(caught, "passed-in `module` is on CPU"), [str(w.message) for w in caught]
    devices = {p.device for p in fsdp.parameters()}
    assert devices == {CPU}, f"params moved without device_id: {devices}"
    fsdp = fsdp.to(device)
    (inp,) = NestedModel.get_input(CPU, generator(rank_seed(0, ctx.rank)))
    out = fsdp(inp)
    assert out.device == device, f"CPU input not moved to {device}: output on {out.device}"
    out.sum().backward()


@case("placement/module_device_mismatches_device_id", world_size=TWO_GPUS, gpus=distinct_gpus(2),
      requires=COMPUTE + MESSAGES,
      clause="C14")
@pytest.mark.parametrize("has_params", [True, False])
def test_module_device_mismatches_device_id(ctx: RankContext, impl: FSDPAdapter, has_params: bool) -> None:
    """A module on cuda:{rank} with device_id=0 is rejected on every rank but 0."""
    device = cuda_device(ctx)
    module = (NestedModel(seed=0) if has_params else NoParamsModel()).to(device)
    pattern = f"cuda:{ctx.rank} vs cuda:0" if has_params else f"Inconsistent.*cuda:{ctx.rank} vs cuda:0"
    if ctx.rank == 0:
        impl.wrap(module, WrapSpec(device_id=0))
    else:
        with pytest.raises(ValueError, match=pattern):
            impl.wrap(module, WrapSpec(device_id=0))


def _cpu_gpu_module(device: torch.device) -> PairOfLinears:
    """``a`` on ``device``, ``b`` on the CPU."""
    model = PairOfLinears()
    model.a.to(device)
    return model


@case("placement/cpu_gpu_module", clause="C14", world_size=GPU_ONLY, gpus=ANY_GPU, requires=COMPUTE)
def test_cpu_gpu_module(ctx: RankContext, impl: FSDPAdapter) -> None:
    """A module with one submodule on the GPU and one on the CPU is moved wholly to ``device_id``."""
    device = cuda_device(ctx)
    fsdp = impl.wrap(_cpu_gpu_module(device), WrapSpec(device_id=device))
    devices = {p.device for p in fsdp.parameters()}
    assert devices == {device}, f"mixed module with device_id: params on {devices}, expected {device}"


@case("placement/cpu_gpu_module_without_device_id_raises", clause="C14", world_size=GPU_ONLY, gpus=ANY_GPU,
      requires=MESSAGES)
def test_cpu_gpu_module_without_device_id_raises(ctx: RankContext, impl: FSDPAdapter) -> None:
    """A module with one submodule on the GPU and one on the CPU, wrapped without ``device_id``, raises
    FSDP1's RuntimeError asking to "please pass in device_id"."""
    device = cuda_device(ctx)
    with pytest.raises(RuntimeError, match="please pass in device_id"):
        impl.wrap(_cpu_gpu_module(device), WrapSpec())


@case("placement/multigpu_module", clause="C14", world_size=TWO_GPUS, gpus=distinct_gpus(2), requires=MESSAGES)
def test_multigpu_module(ctx: RankContext, impl: FSDPAdapter) -> None:
    """Wrapping a module whose two submodules sit on two different GPUs raises a RuntimeError "FSDP only
    supports single device modules"."""
    cuda_device(ctx)
    model = PairOfLinears()
    model.a.to(torch.device("cuda", ctx.local_rank))
    model.b.to(torch.device("cuda", (ctx.local_rank + 1) % ctx.world_size))
    with pytest.raises(RuntimeError, match="FSDP only supports single device modules"):
        impl.wrap(model, WrapSpec())


@case("placement/training_device_mismatch", clause="C14", world_size=Exact(1, reason=GPU_ONLY.reason), gpus=ANY_GPU,
      requires=[Capability.PLACEMENT_MESSAGES, Capability.CPU_OFFLOAD])
def test_training_device_mismatch(ctx: RankContext, impl: FSDPAdapter) -> None:
    """Forward raises a RuntimeError naming the mismatch for a module wrapped on the CPU on a GPU host
    ("...unexpectedly has parameters on cpu. Make sure to move the module to cuda:N...") and for a
    CPU-offloaded module moved to the GPU ("...has parameters on cuda:N. Make sure to not move...")."""
    device = cuda_device(ctx)
    inp = torch.randn((2, 10), generator=generator(0))
    fsdp = impl.wrap(nn.Linear(10, 10), WrapSpec())
    left_on_cpu = re.escape(
        f"An FSDP-managed module unexpectedly has parameters on cpu. Make sure to move the module to {device} "
        "before training."
    )
    with pytest.raises(RuntimeError, match=left_on_cpu):
        fsdp(inp)
    fsdp = impl.wrap(nn.Linear(10, 10), WrapSpec(cpu_offload=True)).to(torch.device("cuda"))
    moved = re.escape(
        f"An FSDP-managed module with parameter CPU offloading enabled has parameters on {device}. "
        "Make sure to not move the module from CPU when offloading parameters."
    )
    with pytest.raises(RuntimeError, match=moved):
        fsdp(inp)


# -- device_id reaches auto-wrapped units -------------------------------------------------

TRANSFORMER_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def _device_id_auto_wrap(impl: FSDPAdapter, device: torch.device, group: object, kind: str) -> None:
    spec = WrapSpec(auto_wrap=AutoWrap(TRANSFORMER_LAYERS, kind=kind), device_id=device, process_group=group)
    model = TiedTransformer(seed=0)
    layers = [name for name, m in model.named_modules() if isinstance(m, TRANSFORMER_LAYERS)]
    fsdp = impl.wrap(model, spec)
    # Each of the 2 encoder + 2 decoder layers is a unit, or (a per-parameter design) holds units of its own.
    fqns = [u.fqn for u in impl.units(fsdp)]
    uncovered = [name for name in layers if not any(f == name or f.startswith(name + ".") for f in fqns)]
    assert len(layers) == 4 and not uncovered, f"auto wrap ({kind}): layers {uncovered} hold no unit; units {fqns}"
    _assert_units_on(impl, fsdp, device, f"auto wrap ({kind})")


@case("placement/device_id_auto_wrap", clause="C14", world_size=TWO_OR_MORE, gpus=gpu_rows, requires=COMPUTE)
@pytest.mark.parametrize("on", ["cpu", "gpu"])
@pytest.mark.parametrize("kind", ["module_classes", "transformer"])
def test_device_id_auto_wrap(ctx: RankContext, impl: FSDPAdapter, kind: str, on: str) -> None:
    """device_id (the CPU, or the rank's GPU) reaches every nested unit, for a policy object and a policy callable."""
    if on == "gpu":
        _device_id_auto_wrap(impl, cuda_device(ctx), None, kind)
    else:
        _device_id_auto_wrap(impl, CPU, cpu_world_group(ctx), kind)
