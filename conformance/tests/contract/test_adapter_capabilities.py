"""Capabilities an adapter withholds, or limits to process ranks, are withheld for a reason that still holds.

Each test here reproduces the torch behaviour behind one withheld capability or
thread-rank limit. When torch changes and a test starts failing, lift the limit
and delete the test: the matrix then runs the cases it gates.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import harness
from conformance.adapters.torch_fsdp1 import TorchFSDP1Adapter
from conformance.contract.adapter import Capability


def _fsdp1_optim_state_dict(ctx: harness.RankContext) -> list[str]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    with ctx.rng(0):
        model = FullyShardedDataParallel(nn.Linear(4, 4), device_id=torch.device("cpu"))
    optim = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    return sorted(FullyShardedDataParallel.optim_state_dict(model, optim)["state"])


def _fsdp1_state_dict(ctx: harness.RankContext, kind: str, load: bool) -> list[str]:
    """The keys of an FSDP1 model's state dict of type ``kind``, saved and (with ``load``) loaded back."""
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

    with ctx.rng(0):
        model = FullyShardedDataParallel(nn.Linear(4, 4), device_id=torch.device("cpu"))
    with FullyShardedDataParallel.state_dict_type(model, StateDictType[kind]):
        state = model.state_dict()
        if load:
            model.load_state_dict(state)
    return sorted(state)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_fsdp1_sharded_state_dict_load_collides_on_thread_ranks() -> None:
    """FSDP1's SHARDED load hook all-gathers inside a SimpleProfiler section; its save runs on thread ranks."""
    assert Capability.SHARDED_STATE_DICT in TorchFSDP1Adapter.thread_rank_load_limits
    assert Capability.SHARDED_STATE_DICT not in TorchFSDP1Adapter.thread_rank_limits
    sharded, keys = "SHARDED_STATE_DICT", [["bias", "weight"]] * 2
    assert harness.run(_fsdp1_state_dict, world_size=2, mode="process", args=(sharded, True)) == keys
    assert harness.run(_fsdp1_state_dict, world_size=2, mode="thread", args=(sharded, False)) == keys
    with pytest.raises(harness.RankRaised, match=r"KeyError|already being profiled"):
        harness.run(_fsdp1_state_dict, world_size=2, mode="thread", args=(sharded, True))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_fsdp1_full_state_dict_collides_on_thread_ranks() -> None:
    """FSDP1's model state-dict load profiles its sections in the same class-level set."""
    assert Capability.FULL_STATE_DICT in TorchFSDP1Adapter.thread_rank_limits
    full = "FULL_STATE_DICT"
    assert harness.run(_fsdp1_state_dict, world_size=2, mode="process", args=(full, True)) == [["bias", "weight"]] * 2
    with pytest.raises(harness.RankRaised, match=r"KeyError|already being profiled"):
        harness.run(_fsdp1_state_dict, world_size=2, mode="thread", args=(full, True))


# The collision also leaves a profiling generator that raises when it is closed.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_fsdp1_optim_state_dict_collides_on_thread_ranks() -> None:
    """FSDP1 profiles its optimizer state-dict sections in a class-level set every thread shares."""
    assert Capability.OPTIM_STATE_DICT in TorchFSDP1Adapter.thread_rank_limits
    assert harness.run(_fsdp1_optim_state_dict, world_size=2, mode="process") == [["bias", "weight"]] * 2
    with pytest.raises(harness.RankRaised, match=r"KeyError|already being profiled"):
        harness.run(_fsdp1_optim_state_dict, world_size=2, mode="thread")
