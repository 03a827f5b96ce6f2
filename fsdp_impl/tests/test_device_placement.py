"""Device decisions that matter on accelerators, checked without one.

The ``meta`` device stands in for an accelerator compute device (tensors there
have devices but no data), and a patched ``torch.cuda.current_device`` stands in
for the current GPU: the decisions below are about *which* device, never about
moving data to it.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

from fsdp_impl import init
from fsdp_impl.flat_param import FlatParamHandle

META = torch.device("meta")


def _handle(module: nn.Module, *, offload: bool, orig: bool) -> FlatParamHandle:
    params, _ = init.managed_tensors(module, set())
    return FlatParamHandle(
        params, compute_device=META, offload_params=offload, shard_group=None,
        shard_size=1, shard_rank=0, use_orig_params=orig,
    )


@pytest.mark.parametrize("orig", [False, True])
def test_flat_param_stays_where_the_module_is_not_on_the_compute_device(orig: bool) -> None:
    # A CPU module wrapped without device_id on a GPU machine: the compute device is the
    # GPU, the flat parameter stays on the CPU until the user moves the module.
    handle = _handle(nn.Linear(3, 2), offload=False, orig=orig)
    assert handle.flat_param.device == torch.device("cpu")
    assert handle.full.device == META


def test_offloaded_flat_param_is_on_cpu() -> None:
    handle = _handle(nn.Linear(3, 2), offload=True, orig=False)
    assert handle.flat_param.device == torch.device("cpu")


def test_parameterless_module_checks_device_id_against_the_current_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    expected = re.escape("Inconsistent compute device and `device_id` on rank 0: cuda:1 vs cuda:0")
    with pytest.raises(ValueError, match=expected):
        init.place_module(nn.ReLU(), set(), torch.device("cuda", 0), None)
    assert init.place_module(nn.ReLU(), set(), torch.device("cuda", 1), None) == torch.device("cuda", 1)


def test_module_with_parameters_is_moved_not_compared_with_the_current_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # CPU params and device_id=cuda:0 while cuda:1 is current: torch moves the module to
    # device_id, so there is nothing inconsistent (only a parameterless module is compared).
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    moved: list[torch.device] = []
    monkeypatch.setattr(init, "_move", lambda params, buffers, device: moved.append(device))
    assert init.place_module(nn.Linear(2, 2), set(), torch.device("cuda", 0), None) == torch.device("cuda", 0)
    assert moved == [torch.device("cuda", 0)]
