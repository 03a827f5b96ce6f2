"""user_hooks: the user's own hooks on a sharded model run as they do on the unwrapped one.

``module_hooks[api=wrap|fully_shard]`` registers, before sharding, a forward pre-hook doubling ``b1``'s input, a
forward hook adding 1 to ``b2``'s output and a full backward hook halving the gradient ``b3`` passes back to its
input, on :class:`~fixtures.blocks.Blocks`, each block its own unit (FSDP1's ``wrap`` with the original
parameters, or ``fully_shard`` on each block and the root). Over two SGD steps, each rank on its own batch, every
output is the local model's with the same hooks, and then the full parameters are (stepped on the mean of every
rank's loss). ``post_accumulate_grad_hooks`` registers, after ``fully_shard``, a hook halving the gradient on the
sharded parameters of ``b2`` and the root's ``head``: full gradients after each backward and parameters after each
step are the local model's with the same hooks. A hook is the model's own code: torch documents ``nn.Module``'s
hooks for any module, and neither FSDP API documents an exception, so a sharded model must run them where the
unwrapped one does.
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
from fixtures.sharded_blocks import LR, full_grads_of, full_of, local_step, mesh_over, shard_blocks, sharded_step

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
        local_step(ctx, local, local_optim, step, range(ctx.world_size))
    full = impl.full_params(model) if api == "wrap" else full_of(model)
    assert_close_named(full, dict(local.named_parameters()),
                       what=f"rank {ctx.rank}: parameters after two steps")


def _halving_grads(model: Blocks, paths: tuple[str, ...]) -> Blocks:
    """``model`` with a post-accumulate-grad hook halving the gradient of every parameter under ``paths``."""
    def halve(param: torch.Tensor) -> None:
        assert param.grad is not None
        param.grad.mul_(0.5)

    for name, param in model.named_parameters():
        if name.startswith(paths):
            param.register_post_accumulate_grad_hook(halve)
    return model


@case("user_hooks/post_accumulate_grad_hooks", clause=("C1", "C2"), world_size=TWO_OR_MORE,
      requires=[Capability.FULLY_SHARD])
def test_post_accumulate_grad_hooks(ctx: RankContext, impl: FSDPAdapter) -> None:
    """A post-accumulate-grad hook halving the gradient, registered after ``fully_shard`` on ``b2``'s parameters
    and the root's ``head`` (the sharded parameters that replaced the module's own): once a backward has reduced a
    parameter's gradient, the hook sees it (FSDP2 runs such hooks itself after the reduction,
    pytorch/pytorch#129450) and halves it, so the
    full gradients after each backward and the parameters after each SGD step are the local model's with the same
    hooks. FSDP1's wrap is not checked: its original parameters are not the tensors autograd accumulates into, and
    torch documents nothing of such hooks under it."""
    paths = ("b2.", "head.")
    model = _halving_grads(shard_blocks(impl, Blocks(seed=0).to(ctx.device), mesh_over(ctx)), paths)
    local = _halving_grads(Blocks(seed=0).to(ctx.device), paths)
    optim = optional.optimizer(impl, model, torch.optim.SGD, lr=LR)
    local_optim = torch.optim.SGD(local.parameters(), lr=LR)
    for step in range(2):  # a step leaves the gradients it took
        sharded_step(ctx, impl, model, optim, step)
        local_step(ctx, local, local_optim, step, range(ctx.world_size))
        assert_close_named(full_grads_of(model), {n: p.grad for n, p in local.named_parameters()},
                           what=f"rank {ctx.rank}: gradients of step {step}")
    assert_close_named(full_of(model), dict(local.named_parameters()), what=f"rank {ctx.rank}: parameters")
