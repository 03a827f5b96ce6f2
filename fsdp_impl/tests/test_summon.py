"""``summon_full_params``'s options on a nested wrap: on a submodule, ``recurse``, ``rank0_only``,
``offload_to_cpu``, ``with_grads``, and the combinations torch documents as unsupported."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from fsdp_impl import FSDP
from harness.ranks.context import RankContext


def _pair(use_orig_params: bool) -> tuple[nn.Module, FSDP]:
    """A local model and its wrap: the root unit owns ``0``, a nested unit owns ``1``; one backward done."""
    local = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    with torch.no_grad():  # the same values on every rank, thread ranks sharing the global generator too
        for i, param in enumerate(local.parameters()):
            param.copy_(torch.linspace(-1.0, 1.0, param.numel()).view_as(param) * (i + 1))
    model = copy.deepcopy(local)
    model[1] = FSDP(model[1], use_orig_params=use_orig_params)
    fsdp = FSDP(model, use_orig_params=use_orig_params)
    x = torch.ones(4, 3)
    fsdp(x).sum().backward()
    local(x).sum().backward()
    return local, fsdp


def _full(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in module.named_parameters()}


@pytest.mark.ranks(world_size=2)
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_summon_options(ctx: RankContext, use_orig_params: bool) -> None:
    local, fsdp = _pair(use_orig_params)
    want = {n: p.detach() for n, p in local.named_parameters()}
    inner = fsdp.module[1]
    with FSDP.summon_full_params(inner, writeback=False):  # a nested unit, recursing
        torch.testing.assert_close(_full(inner), {n[2:]: p for n, p in want.items() if n.startswith("1.")})
    with FSDP.summon_full_params(fsdp, recurse=False, writeback=False):  # the root's own parameters alone
        got = _full(fsdp)
        root_own = ("0.weight", "0.bias")
        torch.testing.assert_close({n: got[n] for n in root_own}, {n: want[n] for n in root_own})
        assert got.get("1.weight", torch.empty(0)).shape != want["1.weight"].shape  # the nested unit stays sharded
    with FSDP.summon_full_params(fsdp.module[0], recurse=False, writeback=False):  # not a unit: nothing summoned
        assert dict(fsdp.module[0].named_parameters()).get("weight", torch.empty(0)).dim() == 1
    with FSDP.summon_full_params(fsdp, rank0_only=True, offload_to_cpu=True, writeback=False):
        got = _full(fsdp)
        if ctx.rank == 0:
            torch.testing.assert_close(got, want)
            assert all(p.device.type == "cpu" for p in got.values())
        else:
            assert got.get("0.weight", torch.empty(0)).shape != want["0.weight"].shape, sorted(got)
    if use_orig_params:
        with FSDP.summon_full_params(fsdp, with_grads=True, rank0_only=True, writeback=False):
            grads = {n: p.grad for n, p in fsdp.named_parameters()}
            if ctx.rank == 0:
                torch.testing.assert_close({n.replace("_fsdp_wrapped_module.", ""): g for n, g in grads.items()},
                                           {n: p.grad for n, p in local.named_parameters()})
    torch.testing.assert_close(_summoned(fsdp), want)  # every context left the parameters as they were
    with pytest.raises(NotImplementedError, match=r"writeback=True, rank0_only=True"), \
            FSDP.summon_full_params(fsdp, rank0_only=True):
        pass
    with pytest.raises(NotImplementedError, match=r"with_grads=True, offload_to_cpu=True"), \
            FSDP.summon_full_params(fsdp, with_grads=True, offload_to_cpu=True):
        pass


def _summoned(fsdp: FSDP) -> dict[str, torch.Tensor]:
    with FSDP.summon_full_params(fsdp, writeback=False):
        return _full(fsdp)
