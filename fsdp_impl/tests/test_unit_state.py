"""The unit state seam: what a unit is, what its state holds, what the top class exposes over it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fsdp_impl import FSDP, CPUOffload, ShardingStrategy
from fsdp_impl.construct import UnitArgs, _split_ignored
from fsdp_impl.init import Groups
from fsdp_impl.unit_state import is_unit, named_unit_states, unit_state
from fsdp_impl.wrap import ModuleWrapPolicy
from harness.ranks.context import RankContext

one_rank = pytest.mark.ranks(world_size=1, modes=("thread",))


@one_rank
def test_only_wrapped_modules_are_units(ctx: RankContext) -> None:
    plain = nn.Linear(2, 2)
    assert not is_unit(plain) and unit_state(plain) is None
    model = FSDP(plain, sharding_strategy=ShardingStrategy.NO_SHARD)
    state = unit_state(model)
    assert state is not None and is_unit(model)
    assert state.module is model.module is plain
    assert not is_unit(plain), "the wrapped module itself is not a unit"


@one_rank
def test_public_surface_reads_the_state(ctx: RankContext) -> None:
    model = FSDP(
        nn.Linear(2, 2),
        sharding_strategy=ShardingStrategy.NO_SHARD,
        cpu_offload=CPUOffload(offload_params=True),
        forward_prefetch=True,
    )
    state = unit_state(model)
    assert state is not None
    assert model.sharding_strategy is state.config.sharding_strategy is ShardingStrategy.NO_SHARD
    assert model.cpu_offload == state.config.cpu_offload == CPUOffload(offload_params=True)
    assert model.forward_prefetch is state.config.forward_prefetch is True
    assert model.compute_device == state.compute_device
    assert model.process_group is state.groups.process_group
    assert model._inter_node_pg is state.groups.inter_node_pg is None
    assert state.handle is not None and model.flat_param is state.handle.flat_param
    assert state.groups.dp_world_size == ctx.world_size


@one_rank
def test_auto_wrapped_children_share_settings_and_groups(ctx: RankContext) -> None:
    model = FSDP(
        nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)),
        sharding_strategy=ShardingStrategy.NO_SHARD,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        limit_all_gathers=False,
        use_orig_params=True,
    )
    named = named_unit_states(model)
    assert [name for name, _ in named] == ["", "_fsdp_wrapped_module.0", "_fsdp_wrapped_module.1"]
    root = named[0][1]
    for _, child in named[1:]:
        assert child.config == root.config
        assert child.groups.process_group is root.groups.process_group


def test_children_get_resolved_groups_and_no_policy() -> None:
    ignored = nn.Linear(1, 1)
    args = UnitArgs(auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), forward_prefetch=True, device_mesh=object())
    groups = Groups("shard", "replicate")  # type: ignore[arg-type]  # stand-ins: only passed through
    children = args.for_children(groups, ShardingStrategy.HYBRID_SHARD, {ignored})
    assert children.process_group == ("shard", "replicate")
    assert children.sharding_strategy is ShardingStrategy.HYBRID_SHARD
    assert children.auto_wrap_policy is None and children.device_mesh is None
    assert children.ignored_modules == [ignored]
    assert children.forward_prefetch is True
    assert set(children.as_kwargs()) == set(UnitArgs.__dataclass_fields__)
    param = nn.Parameter(torch.zeros(1))
    by_params = args.for_children(groups, ShardingStrategy.HYBRID_SHARD, set(), [param])
    assert by_params.ignored_modules is None and by_params.ignored_states == [param]  # torch takes one of the two


@one_rank
def test_construction_warnings_point_at_the_caller(ctx: RankContext) -> None:
    with ctx.catch_warnings() as record:
        FSDP(nn.ModuleList([nn.Linear(2, 2)]), sharding_strategy=ShardingStrategy.NO_SHARD)
    [warning] = [w for w in record if "containers" in str(w.message)]
    assert warning.filename == __file__, warning.filename


def test_ignored_states_are_parameters_or_modules_and_exclude_ignored_modules() -> None:
    """As torch's ``_init_ignored_module_states``: one of the two arguments, one kind of state."""
    lin = nn.Linear(1, 1)
    assert _split_ignored(None, [lin.weight]) == (None, [lin.weight])
    assert _split_ignored(None, [lin]) == ([lin], [])
    assert _split_ignored([lin], None) == ([lin], [])
    with pytest.raises(ValueError, match="Cannot pass both ignored_modules and ignored_states"):
        _split_ignored([lin], [lin.weight])
    with pytest.raises(ValueError, match=r"all nn.Parameter or all nn.Module .* \['Linear', 'Parameter'\]"):
        _split_ignored(None, [lin, lin.weight])
