"""legacy_state_dicts: FSDP1's optimizer state-dict functions and its state-dict settings, against a local model.

Each row wraps :class:`fixtures.models.ThreeLinear` (every ``Linear`` its own unit, flat parameters) and
trains it and a local copy two Adam steps on the same batches on every rank ([Note: state dict baseline] in
:mod:`conformance.cases.test_state_dict`). What torch 2.13's docstrings promise, in values a user reads:

- ``full_optim_state_dict``: "the full optimizer state" keyed by "full parameter names ... instead of
  parameter IDs", so equal to the local optimizer's state under the local model's names, and every name in
  ``param_groups``; with ``rank0_only`` "all other ranks return an empty dict". ``group`` is the model's.
- ``full_orig_params``: with ``use_orig_params=True`` the FULL ``optim_state_dict`` (``optim_state_dict``: "all
  states are unflattened and not sharded") equals the local optimizer's state in the same way, on every rank.
  ``ThreeLinear(dim=1)``'s parameters have one element each, so every rank holds none of some of them and
  gets their state from the others; with ``rank0_only``, the model's ``state_dict()`` gives rank 0 the local
  values and the other ranks an empty dict. ``offload_to_cpu`` is off: with it on, on a CPU model, torch 2.13's
  FSDP1 saves ``exp_avg`` as ``exp_avg_sq`` (docs/findings/fsdp1-full-optim-state-orig-params.md, measured
  by ``state_dict/roundtrip[kind=FULL]``).
- ``load_full[via=shard|scatter]``: ``shard_full_optim_state_dict`` (each rank holds the full dict) or
  ``scatter_full_optim_state_dict`` (only rank 0 does; "the argument is ignored on nonzero ranks") gives
  what a fresh wrapped model's optimizer loads; with the model's full state dict loaded, the next two
  steps match the local model's.
- ``sharded_roundtrip``: ``sharded_optim_state_dict`` saved with the model's sharded state dict, loaded
  through ``flatten_sharded_optim_state_dict``: the next two steps match the local model's.
- ``rekey[key_type=PARAM_ID]``: a full optimizer state dict re-keyed to parameter ids loads into a local
  optimizer, which then steps like the original local one (the docstring's first example);
  ``[key_type=PARAM_NAME]``: a local optimizer's state dict re-keyed to names loads into a wrapped model
  through ``shard_full_optim_state_dict`` (its second example). The keys are the ids / names.
- ``settings[kind=FULL|SHARDED|LOCAL]``: ``set_state_dict_type`` returns the settings held before (the type
  a unit starts with is FULL_STATE_DICT, as ``StateDictType`` documents) and ``get_state_dict_type`` returns
  what was set. FULL with ``offload_to_cpu`` and ``rank0_only`` for the model and the optimizer: the
  model's own ``state_dict()`` and ``optim_state_dict`` give rank 0 the local values on the CPU and the
  other ranks an empty dict. SHARDED and LOCAL: the model's ``state_dict()`` / ``load_state_dict()`` and
  the optimizer state dicts take the type without a ``state_dict_type`` context, and a fresh model wrapped
  the same way and loaded so trains on like the local model (``StateDictType``: a local state dict is each
  rank's flat-parameter shard; ``optim_state_dict`` documents no form for LOCAL, "not supported yet", so
  only its round trip is asserted).
- ``offload[kind=SHARDED|LOCAL]``: the type's ``offload_to_cpu`` for the model and the optimizer
  (``StateDictConfig`` / ``OptimStateDictConfig``: "offloads the state dict values to CPU"): every local
  value equals the one saved with it off, and a fresh model loading what was saved trains on like the
  local model. Where the values live is checked only where the model is on a GPU: on the CPU every value
  is on the CPU with or without offloading, so that check could not fail there (the row says so).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from conformance.contract import optional
from conformance.contract.adapter import AutoWrap, Capability, FSDPAdapter, WrapSpec
from conformance.contract.case import TWO_OR_MORE, case
from conformance.contract.results import CaseReport
from conformance.contract.state_dict_api import StateDictSettingsSpec
from fixtures.models import ThreeLinear
from fixtures.parity import COPIED, assert_close_named, assert_close_seq
from fixtures.seeding import generator

if TYPE_CHECKING:
    from harness import RankContext

LINEARS = AutoWrap((nn.Linear,))
FUNCTIONS = [Capability.OPTIM_STATE_DICT_FUNCTIONS]
LOADS = [Capability.OPTIM_STATE_DICT_FUNCTIONS, Capability.FULL_STATE_DICT]
SETTINGS = [Capability.STATE_DICT_SETTINGS, Capability.FULL_STATE_DICT, Capability.SHARDED_STATE_DICT]
#: A ``settings`` / ``offload`` row's ``kind`` -> the ``StateDictType`` member it sets.
KINDS = {"FULL": "FULL_STATE_DICT", "SHARDED": "SHARDED_STATE_DICT", "LOCAL": "LOCAL_STATE_DICT"}


def _settings_requires(params: Mapping[str, Any]) -> list[Capability]:
    return SETTINGS + [Capability.LOCAL_STATE_DICT] * (params["kind"] == "LOCAL")


class _Run:
    """A wrapped model and a local copy, with their Adam optimizers and the same batches on every rank."""

    def __init__(self, ctx: RankContext, impl: FSDPAdapter, dim: int = 10, use_orig_params: bool = False) -> None:
        self.ctx, self.impl, self.dim, self.use_orig_params = ctx, impl, dim, use_orig_params
        self.model = self.wrap(seed=0)
        self.optim = optional.optimizer(impl, self.model, torch.optim.Adam, lr=1e-2)
        self.local = ThreeLinear(seed=0, dim=dim).to(ctx.device)
        self.local_optim = torch.optim.Adam(self.local.parameters(), lr=1e-2)
        gen = generator(17)
        self.batches = [self.local.get_input(ctx.device, gen)[0] for _ in range(4)]

    def wrap(self, seed: int) -> nn.Module:
        return self.impl.wrap(ThreeLinear(seed=seed, dim=self.dim).to(self.ctx.device),
                              WrapSpec(auto_wrap=LINEARS, use_orig_params=self.use_orig_params))

    def fresh(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = self.wrap(seed=1)
        return model, optional.optimizer(self.impl, model, torch.optim.Adam, lr=1e-2)

    def train(self, model: nn.Module, optim: torch.optim.Optimizer, wrapped: bool, first: int,
              last: int) -> list[torch.Tensor]:
        losses = []
        for inp in self.batches[first:last]:
            loss = model(inp).sum()
            loss.backward()
            optional.step(self.impl, model, optim) if wrapped else optim.step()
            optim.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        return losses

    def first_steps(self) -> None:
        self.train(self.model, self.optim, True, 0, 2)
        self.train(self.local, self.local_optim, False, 0, 2)

    def assert_trains_like_local(self, model: nn.Module, optim: torch.optim.Optimizer, what: str) -> None:
        """The next two steps' losses, and the parameters after them, match the local model's."""
        assert_close_seq(self.train(model, optim, True, 2, 4), self.train(self.local, self.local_optim, False, 2, 4),
                         what=f"rank {self.ctx.rank}: losses after {what} vs the local model")
        assert_close_named(self.impl.full_params(model), {n: p.detach() for n, p in self.local.named_parameters()},
                           what=f"rank {self.ctx.rank}: params two steps after {what}")

    def local_state(self) -> dict[str, torch.Tensor]:
        """The local optimizer's per-parameter tensors, as ``name/key``."""
        names = {id(p): n for n, p in self.local.named_parameters()}
        return {f"{names[id(p)]}/{k}": v for p, state in self.local_optim.state.items() for k, v in state.items()}


def _flat(osd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A name-keyed optimizer state dict's tensors as ``name/key``, on the CPU."""
    return {f"{name}/{k}": torch.as_tensor(v).detach().cpu() for name, state in osd["state"].items()
            for k, v in state.items()}


def _assert_full(ctx: RankContext, run: _Run, osd: dict[str, Any], what: str) -> None:
    """``osd`` is the local optimizer's state keyed by the local model's parameter names."""
    names = sorted(n for n, _ in run.local.named_parameters())
    assert sorted(osd.get("state", {})) == names, f"rank {ctx.rank}: {what}: state keys {sorted(osd.get('state', {}))}"
    listed = sorted(name for group in osd["param_groups"] for name in group["params"])
    assert listed == names, f"rank {ctx.rank}: {what}: param_groups list {listed}, expected {names}"
    expected = {k: torch.as_tensor(v).detach().cpu() for k, v in run.local_state().items()}
    assert_close_named(_flat(osd), expected, what=f"rank {ctx.rank}: {what}")


@case("legacy_state_dicts/full_optim_state_dict", clause="C4", world_size=TWO_OR_MORE, requires=FUNCTIONS)
@pytest.mark.parametrize("rank0_only", [True, False])
def test_full_optim_state_dict(ctx: RankContext, impl: FSDPAdapter, rank0_only: bool) -> None:
    """After two steps the full optimizer state dict equals the local optimizer's state keyed by names; with
    ``rank0_only`` only rank 0 holds it and the others get an empty dict."""
    run = _Run(ctx, impl)
    run.first_steps()
    osd = optional.full_optim_state_dict(impl, run.model, run.optim, rank0_only=rank0_only, group=dist.group.WORLD)
    if rank0_only and ctx.rank != 0:
        assert osd == {}, f"rank {ctx.rank}: expected an empty dict with rank0_only, got keys {sorted(osd)}"
        return
    _assert_full(ctx, run, osd, f"full_optim_state_dict(rank0_only={rank0_only})")


@case("legacy_state_dicts/full_orig_params", clause="C4", world_size=TWO_OR_MORE,
      requires=[Capability.STATE_DICT_SETTINGS, Capability.FULL_STATE_DICT])
def test_full_orig_params(ctx: RankContext, impl: FSDPAdapter) -> None:
    """With ``use_orig_params=True`` and one-element parameters (every rank holds none of some of them), the
    FULL optimizer state dict equals the local optimizer's state keyed by names on every rank; it is not
    loaded back. With ``rank0_only`` (and no offload), the model's ``state_dict()`` gives rank 0 the local
    model's values and the other ranks an empty dict."""
    run = _Run(ctx, impl, dim=1, use_orig_params=True)
    run.first_steps()
    optional.set_state_dict_type(impl, run.model, StateDictSettingsSpec("FULL_STATE_DICT", optim_offload_to_cpu=False))
    _assert_full(ctx, run, optional.optim_state_dict_as_set(impl, run.model, run.optim),
                 "optim_state_dict under FULL_STATE_DICT with use_orig_params=True")
    optional.set_state_dict_type(impl, run.model, StateDictSettingsSpec("FULL_STATE_DICT", rank0_only=True,
                                                                        optim_offload_to_cpu=False))
    model_state = run.model.state_dict()
    if ctx.rank != 0:
        assert model_state == {}, f"rank {ctx.rank}: expected an empty dict with rank0_only, got {sorted(model_state)}"
        return
    assert_close_named(dict(model_state), dict(run.local.state_dict()),
                       what="rank 0: state_dict() under FULL_STATE_DICT with rank0_only and use_orig_params=True")


@case("legacy_state_dicts/load_full", clause="C4", world_size=TWO_OR_MORE, requires=LOADS)
@pytest.mark.parametrize("via", ["shard", "scatter"])
def test_load_full(ctx: RankContext, impl: FSDPAdapter, via: str) -> None:
    """A full optimizer state dict, sharded by every rank or scattered from rank 0, loads into a fresh
    wrapped model's optimizer: with the model's full state dict loaded, training goes on like the local model."""
    run = _Run(ctx, impl)
    run.first_steps()
    scatter = via == "scatter"
    full_osd = optional.full_optim_state_dict(impl, run.model, run.optim, rank0_only=scatter)
    model_state = impl.full_state_dict(run.model)
    model, optim = run.fresh()
    impl.load_state_dict(model, model_state, sharded=False)
    if scatter:
        held = full_osd if ctx.rank == 0 else None
        to_load = optional.scatter_full_optim_state_dict(impl, held, model, optim, group=dist.group.WORLD)
    else:
        to_load = optional.shard_full_optim_state_dict(impl, full_osd, model, optim)
    optim.load_state_dict(to_load)
    run.assert_trains_like_local(model, optim, f"loading the full optimizer state dict ({via})")


@case("legacy_state_dicts/sharded_roundtrip", clause="C4", world_size=TWO_OR_MORE,
      requires=[Capability.OPTIM_STATE_DICT_FUNCTIONS, Capability.SHARDED_STATE_DICT])
def test_sharded_roundtrip(ctx: RankContext, impl: FSDPAdapter) -> None:
    """``sharded_optim_state_dict`` with the model's sharded state dict, loaded into a fresh model through
    ``flatten_sharded_optim_state_dict``: training goes on like the local model."""
    run = _Run(ctx, impl)
    run.first_steps()
    model_state = impl.sharded_state_dict(run.model)
    sharded_osd = optional.sharded_optim_state_dict(impl, run.model, run.optim)
    model, optim = run.fresh()
    impl.load_state_dict(model, model_state, sharded=True)
    optim.load_state_dict(optional.flatten_sharded_optim_state_dict(impl, sharded_osd, model, optim))
    run.assert_trains_like_local(model, optim, "the sharded optimizer state dict round trip")


@case("legacy_state_dicts/rekey", clause="C4", world_size=TWO_OR_MORE, requires=FUNCTIONS)
@pytest.mark.parametrize("key_type", ["PARAM_ID", "PARAM_NAME"])
def test_rekey(ctx: RankContext, impl: FSDPAdapter, key_type: str) -> None:
    """PARAM_ID: the wrapped model's full optimizer state dict keyed by ids loads into a local optimizer that
    then steps like the original local one. PARAM_NAME: the local optimizer's state dict keyed by names loads
    into a fresh wrapped model through ``shard_full_optim_state_dict``, which then trains like the local one."""
    run = _Run(ctx, impl)
    run.first_steps()
    names = [n for n, _ in run.local.named_parameters()]
    if key_type == "PARAM_ID":
        full_osd = optional.full_optim_state_dict(impl, run.model, run.optim, rank0_only=False)
        other = ThreeLinear(seed=1).to(ctx.device)
        other_optim = torch.optim.Adam(other.parameters(), lr=1e-2)
        by_id = optional.rekey_optim_state_dict(impl, full_osd, key_type, other, other_optim)
        assert sorted(by_id["state"]) == list(range(len(names))), f"rank {ctx.rank}: keys {sorted(by_id['state'])}"
        other.load_state_dict(run.local.state_dict())
        other_optim.load_state_dict(by_id)
        assert_close_seq(run.train(other, other_optim, False, 2, 4), run.train(run.local, run.local_optim, False, 2, 4),
                         what=f"rank {ctx.rank}: losses of a local model loading the re-keyed state")
        return
    by_name = optional.rekey_optim_state_dict(impl, run.local_optim.state_dict(), key_type, run.local, run.local_optim)
    assert sorted(by_name["state"]) == sorted(names), f"rank {ctx.rank}: keys {sorted(by_name['state'])}"
    model, optim = run.fresh()
    impl.load_state_dict(model, {k: v.detach().clone() for k, v in run.local.state_dict().items()}, sharded=False)
    optim.load_state_dict(optional.shard_full_optim_state_dict(impl, by_name, model, optim))
    run.assert_trains_like_local(model, optim, "loading the local optimizer's state re-keyed by names")


@case("legacy_state_dicts/settings", clause="C4", world_size=TWO_OR_MORE, requires=_settings_requires)
@pytest.mark.parametrize("kind", ["FULL", "SHARDED", "LOCAL"])
def test_settings(ctx: RankContext, impl: FSDPAdapter, kind: str) -> None:
    """``set_state_dict_type`` returns the settings held before and ``get_state_dict_type`` what was set;
    later ``state_dict()`` and optimizer state dicts take that type and its options."""
    run = _Run(ctx, impl)
    run.first_steps()
    full = kind == "FULL"
    settings = (StateDictSettingsSpec("FULL_STATE_DICT", offload_to_cpu=True, rank0_only=True,
                                      optim_offload_to_cpu=True, optim_rank0_only=True)
                if full else StateDictSettingsSpec(KINDS[kind], optim_offload_to_cpu=False))
    previous = optional.set_state_dict_type(impl, run.model, settings)
    assert previous is not None and previous.kind == "FULL_STATE_DICT", (
        f"rank {ctx.rank}: set_state_dict_type returned {previous}, expected the FULL_STATE_DICT units start with")
    got = optional.get_state_dict_type(impl, run.model)
    assert got == settings, f"rank {ctx.rank}: get_state_dict_type returned {got}, expected {settings}"
    if full:
        _check_full_settings(ctx, run)
    else:
        _check_sharded_settings(ctx, run, settings)


def _check_full_settings(ctx: RankContext, run: _Run) -> None:
    """FULL with ``offload_to_cpu`` and ``rank0_only``: rank 0 gets the local values on the CPU, the others {}."""
    model_state = run.model.state_dict()
    osd = optional.optim_state_dict_as_set(run.impl, run.model, run.optim)
    if ctx.rank != 0:
        assert model_state == {} and osd == {}, (
            f"rank {ctx.rank}: expected empty dicts with rank0_only, got keys {sorted(model_state)} / {sorted(osd)}")
        return
    tensors = [v for v in model_state.values()] + [v for s in osd["state"].values() for v in s.values()
                                                  if isinstance(v, torch.Tensor)]
    off = [t.device for t in tensors if t.device.type != "cpu"]
    assert not off, f"rank 0: offload_to_cpu left tensors on {off}"
    assert_close_named({k: v for k, v in model_state.items()},
                       {n: p.detach().cpu() for n, p in run.local.state_dict().items()},
                       what="rank 0: the model's state_dict() under FULL_STATE_DICT")
    _assert_full(ctx, run, osd, "optim_state_dict under FULL_STATE_DICT")


def _check_sharded_settings(ctx: RankContext, run: _Run, settings: StateDictSettingsSpec) -> None:
    """SHARDED or LOCAL: the model's own state dict calls and the optimizer state dicts round trip without a
    context."""
    model_state = run.model.state_dict()
    osd = optional.optim_state_dict_as_set(run.impl, run.model, run.optim)
    model, optim = run.fresh()
    optional.set_state_dict_type(run.impl, model, settings)
    model.load_state_dict(model_state)
    optional.load_optim_state_dict_as_set(run.impl, model, optim, osd)
    run.assert_trains_like_local(model, optim, f"a {settings.kind} round trip through the settings set")


@case("legacy_state_dicts/offload", clause="C4", world_size=TWO_OR_MORE, requires=_settings_requires)
@pytest.mark.parametrize("kind", ["SHARDED", "LOCAL"])
def test_offload(ctx: RankContext, impl: FSDPAdapter, kind: str) -> CaseReport | None:
    """With the type's ``offload_to_cpu`` on, the model's and the optimizer's local values equal those saved
    with it off, lie on the CPU (checked where the model is on a GPU), and load into a fresh model that then
    trains like the local model."""
    run = _Run(ctx, impl)
    run.first_steps()
    saved = {}
    for offload in (False, True):
        optional.set_state_dict_type(impl, run.model, StateDictSettingsSpec(
            KINDS[kind], offload_to_cpu=offload, optim_offload_to_cpu=offload))
        saved[offload] = (run.model.state_dict(), optional.optim_state_dict_as_set(impl, run.model, run.optim))
    (model_off, osd_off), (model_on, osd_on) = saved[False], saved[True]
    for what, on, off in (("model", _local_values(model_on), _local_values(model_off)),
                          ("optimizer", _local_values(osd_on["state"]), _local_values(osd_off["state"]))):
        assert_close_named({n: v.cpu() for n, v in on.items()}, {n: v.cpu() for n, v in off.items()},
                           what=f"rank {ctx.rank}: {kind} {what} state dict with offload_to_cpu vs without",
                           exact=COPIED)
    placed = ctx.device.type != "cpu"
    if placed:
        off_cpu = {n: str(v.device) for n, v in {**_local_values(model_on), **_local_values(osd_on["state"])}.items()
                   if v.device.type != "cpu"}
        assert not off_cpu, f"rank {ctx.rank}: {kind} values not offloaded to the CPU: {off_cpu}"
    model, optim = run.fresh()
    optional.set_state_dict_type(impl, model, StateDictSettingsSpec(KINDS[kind], offload_to_cpu=True,
                                                                    optim_offload_to_cpu=True))
    model.load_state_dict(model_on)
    optional.load_optim_state_dict_as_set(impl, model, optim, osd_on)
    run.assert_trains_like_local(model, optim, f"loading a {kind} state dict saved with offload_to_cpu")
    return None if placed else CaseReport(
        reason="where offloaded values live is not checked: the model is on the CPU, so every value is there "
               "with or without offload_to_cpu (the GPU job checks it)")


def _local_values(state: Mapping[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in ``state`` (nested dicts flattened as ``a/b``) as this rank holds it: a
    ``ShardedTensor``'s local shards concatenated, a ``DTensor``'s local tensor, a tensor itself."""
    values: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            values.update(_local_values(value, f"{name}/"))
        elif callable(getattr(value, "local_shards", None)):
            shards = [shard.tensor.reshape(-1) for shard in value.local_shards()]
            values[name] = torch.cat(shards) if shards else torch.empty(0, dtype=value.dtype)
        elif callable(getattr(value, "to_local", None)):
            values[name] = value.to_local()
        elif isinstance(value, torch.Tensor):
            values[name] = value
    return values
