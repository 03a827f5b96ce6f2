"""Construction-time contracts and single-rank runtime behaviour (one-rank gloo group)."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn as nn

from fixtures.models import OptionalSecondOutputModel, PairOfLinears, SetattrLinear, TwoOutputModel
from fsdp_impl import FSDP, CPUOffload, ShardingStrategy
from fsdp_impl.wrap import ModuleWrapPolicy, always_wrap_policy
from harness.ranks.context import RankContext

S = ShardingStrategy
pytestmark = pytest.mark.ranks(world_size=1, modes=("thread", "process"))


@pytest.mark.parametrize("strategy", [None, S.FULL_SHARD, S.SHARD_GRAD_OP])
def test_world_size_1_switches_to_no_shard_with_exact_warning(
    ctx: RankContext, strategy: ShardingStrategy | None
) -> None:
    shown = S.FULL_SHARD if strategy is None else strategy
    expected = f"FSDP is switching to use `NO_SHARD` instead of {shown} since the world size is 1."
    with ctx.catch_warnings() as record:
        model = FSDP(nn.Linear(2, 2), sharding_strategy=strategy)
    assert [str(w.message) for w in record if "switching" in str(w.message)] == [expected]
    assert model.sharding_strategy is S.NO_SHARD


def test_no_shard_at_world_size_1_does_not_warn(ctx: RankContext) -> None:
    with ctx.catch_warnings() as record:
        FSDP(nn.Linear(2, 2), sharding_strategy=S.NO_SHARD)
    assert not record, [str(w.message) for w in record]


@pytest.mark.parametrize("kind", ["list", "dict"])
def test_container_without_forward_warns(ctx: RankContext, kind: str) -> None:
    layer = nn.Linear(2, 2)
    container = nn.ModuleList([layer]) if kind == "list" else nn.ModuleDict({"a": layer})
    with ctx.catch_warnings() as record:
        FSDP(container, sharding_strategy=S.NO_SHARD)
    expected = "FSDP will not all-gather parameters for containers that do not implement forward"
    assert [w.category for w in record if expected in str(w.message)] == [UserWarning]


@pytest.mark.parametrize("attr", ["use_orig_params", "limit_all_gathers", "use_full_prec_in_eval"])
def test_inconsistent_homogeneous_attrs_error_at_first_forward(
    ctx: RankContext, attr: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    if attr == "use_full_prec_in_eval":
        monkeypatch.setenv("FSDP_USE_FULL_PREC_IN_EVAL", "1")
        model[0] = FSDP(model[0], sharding_strategy=S.NO_SHARD)
        monkeypatch.delenv("FSDP_USE_FULL_PREC_IN_EVAL")
        root = FSDP(model, sharding_strategy=S.NO_SHARD)
    else:
        model[0] = FSDP(model[0], sharding_strategy=S.NO_SHARD, **{attr: True})
        root = FSDP(model, sharding_strategy=S.NO_SHARD, **{attr: False})
    with pytest.raises(ValueError, match=f"Expects one homogeneous value for _?{attr}"):
        root(torch.randn(1, 2))


@pytest.mark.parametrize("strategy", [S.HYBRID_SHARD, S._HYBRID_SHARD_ZERO2])
def test_manual_hybrid_needs_groups(ctx: RankContext, strategy: ShardingStrategy) -> None:
    with pytest.raises(
        ValueError, match="requires explicit specification of process group or device_mesh."
    ):
        FSDP(nn.Linear(2, 2), sharding_strategy=strategy)


def test_hybrid_with_single_group_and_auto_wrap_rejected(ctx: RankContext) -> None:
    import torch.distributed as dist

    with pytest.raises(ValueError, match="Expected process_group to be passed in"):
        FSDP(
            nn.Sequential(nn.Linear(2, 2)),
            process_group=dist.group.WORLD,
            sharding_strategy=S.HYBRID_SHARD,
            auto_wrap_policy=always_wrap_policy,
        )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"sharding_strategy": "FULL_SHARD"},
            TypeError,
            "sharding_strategy must be ShardingStrategy",
        ),
        ({"device_id": -1}, ValueError, r"non-negative device index, got -1"),
        ({"device_id": "cpu"}, TypeError, "device_id must be"),
        ({"cpu_offload": True}, TypeError, "cpu_offload must be CPUOffload"),
        ({"auto_wrap_policy": 3}, TypeError, "auto_wrap_policy must be"),
        ({"ignored_modules": [3]}, TypeError, "ignored_modules must contain nn.Module"),
    ],
)
def test_bad_arguments_fail_at_construction(
    ctx: RankContext, kwargs: dict, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        FSDP(nn.Sequential(nn.Linear(2, 2)), **kwargs)


@pytest.mark.parametrize("orig", [False, True])
@pytest.mark.parametrize("unsafe", ["", "0", "1"])
def test_unsafe_setattr_env(
    ctx: RankContext, orig: bool, unsafe: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FSDP_USE_UNSAFE_SETATTR", unsafe)
    inner = SetattrLinear()
    model = FSDP(inner, sharding_strategy=S.NO_SHARD, use_orig_params=orig)
    inner.setattr_calls.clear()
    model(torch.randn(2, 5)).sum().backward()
    assert ("weight" in inner.setattr_calls) == (unsafe != "1"), inner.setattr_calls


@pytest.mark.parametrize("with_init_fn", [False, True])
def test_ignored_meta_module_stays_on_meta(ctx: RankContext, with_init_fn: bool) -> None:
    with torch.device("meta"):
        model = PairOfLinears(dim=3, buffer_on_a=True)
    calls: list[nn.Module] = []

    def init_fn(module: nn.Module) -> None:
        calls.append(module)
        module.to_empty(device="cpu", recurse=False)

    fsdp = FSDP(
        model,
        ignored_modules=[model.a],
        sharding_strategy=S.NO_SHARD,
        param_init_fn=init_fn if with_init_fn else None,
        device_id=torch.device("cpu"),
    )
    assert model.a.weight.is_meta and model.a.buf.is_meta
    assert fsdp.flat_param is not None and not fsdp.flat_param.is_meta
    assert fsdp.shard_info["numel"] == 3 * 3 + 3
    assert (model.b in calls) == with_init_fn and model.a not in calls


@pytest.mark.parametrize("device_id", [None, torch.device("cpu")])
def test_module_without_params(ctx: RankContext, device_id: torch.device | None) -> None:
    model = FSDP(nn.Sequential(nn.ReLU()), sharding_strategy=S.NO_SHARD, device_id=device_id)
    assert model.flat_param is None
    torch.testing.assert_close(model(torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 2.0]))


@pytest.mark.parametrize("orig", [False, True])
def test_cpu_offload_keeps_flat_params_on_cpu(ctx: RankContext, orig: bool) -> None:
    model = FSDP(
        nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)),
        sharding_strategy=S.NO_SHARD,
        cpu_offload=CPUOffload(offload_params=True),
        device_id=torch.device("cpu"),
        use_orig_params=orig,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    for unit in FSDP.fsdp_modules(model):
        if unit.flat_param is not None:
            assert unit.flat_param.device.type == "cpu" and unit.compute_device.type == "cpu"
            assert unit.is_resharded


def test_optimizer_in_backward_requires_orig_params(ctx: RankContext) -> None:
    from torch.distributed.optim import _apply_optimizer_in_backward

    model = FSDP(nn.Linear(2, 2), sharding_strategy=S.NO_SHARD, use_orig_params=False)
    _apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1})
    with pytest.raises(RuntimeError, match="only supported with use_orig_params=True"):
        model(torch.randn(1, 2))


class _PassThrough(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, nt: tuple) -> tuple:
        return nt


def test_namedtuple_output_fields_get_backward_hooks(ctx: RankContext) -> None:
    pair = collections.namedtuple("pair", "a b")
    model = FSDP(_PassThrough(), sharding_strategy=S.NO_SHARD)
    out = model(pair(torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)))
    assert isinstance(out, pair)
    assert all(field._backward_hooks for field in out)


@pytest.mark.parametrize("use_second", [False, True])
@pytest.mark.parametrize("strategy", [S.NO_SHARD, None])
def test_unused_submodule_gets_none_grad(
    ctx: RankContext, use_second: bool, strategy: ShardingStrategy | None
) -> None:
    with ctx.catch_warnings():
        fsdp = FSDP(
            OptionalSecondOutputModel(use_second),
            sharding_strategy=strategy,
            auto_wrap_policy=always_wrap_policy,
        )
    x = y = torch.randn(10, 10)
    for _ in range(4):
        out = fsdp(x, y)
        (out[0] if use_second else out).sum().backward()
        assert fsdp.module.a.flat_param.grad is not None
        assert fsdp.module.b.flat_param.grad is None
        assert all(u.is_resharded for u in FSDP.fsdp_modules(fsdp))


@pytest.mark.parametrize("orig", [False, True])
def test_grad_accumulates_without_zero_grad_and_respects_it(ctx: RankContext, orig: bool) -> None:
    model = FSDP(TwoOutputModel(), sharding_strategy=S.NO_SHARD, use_orig_params=orig)
    x = torch.randn(3, 4)
    model(x)[0].sum().backward()
    first = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model(x)[0].sum().backward()
    second = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    torch.testing.assert_close(second, [2 * g for g in first])
    model.zero_grad(set_to_none=True)
    model(x)[0].sum().backward()
    torch.testing.assert_close([p.grad for p in model.parameters() if p.grad is not None], first)


def test_size_based_policy_counts_only_unwrapped_params(ctx: RankContext) -> None:
    import functools

    from fsdp_impl.wrap import size_based_auto_wrap_policy

    model = nn.Sequential(nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10)), nn.Linear(2, 2))
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=100)
    fsdp = FSDP(model, sharding_strategy=S.NO_SHARD, auto_wrap_policy=policy)
    units = {name: u.shard_info["numel"] for name, u in fsdp.named_modules() if isinstance(u, FSDP)}
    # Each 110-element Linear is wrapped; their parent then holds nothing to wrap.
    assert units == {"": 6, "_fsdp_wrapped_module.0.0": 110, "_fsdp_wrapped_module.0.1": 110}, units


@pytest.mark.parametrize("orig", [False, True])
def test_parameter_shared_with_nested_unit_is_rejected(ctx: RankContext, orig: bool) -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model[1].weight = model[0].weight
    model[0] = FSDP(model[0], sharding_strategy=S.NO_SHARD, use_orig_params=orig)
    with pytest.raises(ValueError, match=r"parameter '1.weight' is shared with nested unit"):
        FSDP(model, sharding_strategy=S.NO_SHARD, use_orig_params=orig)
