"""user_hooks: the user's own module hooks on a sharded model run as they do on the unwrapped one.

``module_hooks[api=wrap|fully_shard]`` registers, before sharding, a forward pre-hook doubling ``b1``'s input, a
forward hook adding 1 to ``b2``'s output and a full backward hook halving the gradient ``b3`` passes back to its
input, on :class:`~fixtures.blocks.Blocks`, each block its own unit (FSDP1's ``wrap`` with the original
parameters, or ``fully_shard`` on each block and the root). Over two SGD steps, each rank on its own batch, every
output is the local model's with the same hooks, and then the full parameters are (stepped on the mean of every
rank's loss). A hook is the model's own code: torch documents ``nn.Module``'s hooks for any module, and neither
FSDP API documents an exception, so a sharded model must run them where the unwrapped one does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import torch

from conformance.contract import optional
from conformance.contract.adapter import AutoWrap, Capability, FSDPAdapter, WrapSpec
from conformance.contract.case import TWO_OR_MORE, case
from fixtures.blocks import Blocks, block_batch
from fixtures.parity import assert_close_named
from fixtures.sharded_blocks import LR, full_of, mesh_over, shard_blocks

if TYPE_CHECKING:
    from harness import RankContext


def _hooked(model: Blocks) -> Blocks:
    """``model`` with the module docstring's three hooks registered."""
    model.b1.register_forward_pre_hook(lambda _module, args: (args[0] * 2, *args[1:]))
    model.b2.register_forward_hook(lambda _module, _args, output: output + 1)
    model.b3.register_full_backward_hook(
        lambda _module, grad_input, _grad_output: tuple(None if g is None else g * 0.5 for g in grad_input))
    return model


def _requires(params: dict[str, Any]) -> list[Capability]:
    return [Capability.FULLY_SHARD] if params.get("api") == "fully_shard" else []


@case("user_hooks/module_hooks", clause="C1", world_size=TWO_OR_MORE, requires=_requires)
@pytest.mark.parametrize("api", ["wrap", "fully_shard"])
def test_module_hooks(ctx: RankContext, impl: FSDPAdapter, api: str) -> None:
    """A forward pre-hook, a forward hook and a full backward hook registered on three blocks before sharding:
    outputs and then parameters over two SGD steps are those of the unwrapped model with the same hooks."""
    plain = _hooked(Blocks(seed=0).to(ctx.device))
    local = _hooked(Blocks(seed=0).to(ctx.device))
    if api == "wrap":
        model = impl.wrap(plain, WrapSpec(auto_wrap=AutoWrap.submodules(plain, plain.blocks()), use_orig_params=True))
    else:
        model = shard_blocks(impl, plain, mesh_over(ctx))
    optim = optional.optimizer(impl, model, torch.optim.SGD, lr=LR)
    local_optim = torch.optim.SGD(local.parameters(), lr=LR)
    for step in range(2):
        optim.zero_grad(set_to_none=True)
        out = model(block_batch(step, ctx.rank, ctx.device))
        want = local(block_batch(step, ctx.rank, ctx.device)).detach()
        assert_close_named({"output": out.detach()}, {"output": want}, what=f"rank {ctx.rank}: output of step {step}")
        out.sum().backward()
        optional.step(impl, model, optim)
        local_optim.zero_grad(set_to_none=True)
        losses = [local(block_batch(step, rank, ctx.device)).sum() for rank in range(ctx.world_size)]
        (torch.stack(losses).sum() / ctx.world_size).backward()
        local_optim.step()
    full = impl.full_params(model) if api == "wrap" else full_of(model)
    assert_close_named(full, dict(local.named_parameters()),
                       what=f"rank {ctx.rank}: parameters after two steps")

