"""A DTensor-based, per-parameter FSDP is seen as it is: its collectives recorded, delayed and measured.

The implementation under test is :mod:`conformance.tests.adapters.toy_dtensor_fsdp`:
its collectives are functional collectives issued by DTensor, which never touch
the ``torch.distributed`` functions ([Note: observing collectives]).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import fixtures.timing as timing
import harness
from conformance.contract.adapter import MixedPrecisionSpec, WrapSpec
from conformance.tests.adapters.toy_dtensor_fsdp import ToyDTensorAdapter, ToySummingAdapter

MODES = ["process", "thread"]
TOY = "toy-dtensor=conformance.tests.adapters.toy_dtensor_fsdp:ToyDTensorAdapter"


def _model(ctx: harness.RankContext) -> nn.Module:
    """The same seeded model on every rank and every call; thread ranks share the global RNG, so the
    construction holds the harness's RNG lock (``ctx.rng``)."""
    with ctx.rng(0):
        return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))


def _step_trace(ctx: harness.RankContext, reduce: str, param_dtype: torch.dtype | None) -> list[tuple[Any, ...]]:
    adapter = ToyDTensorAdapter() if reduce == "avg" else ToySummingAdapter()
    mp = None if param_dtype is None else MixedPrecisionSpec(param_dtype=param_dtype)
    model = adapter.wrap(_model(ctx), WrapSpec(mixed_precision=mp))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(ctx.rank)).to(param_dtype or torch.float32)
    with ctx.record_collectives() as trace:
        model(x).float().sum().backward()
    return [(c.op, c.dtype, c.reduce_op, c.group_ranks, c.layer, c.rank) for c in trace.calls]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("reduce", "param_dtype"), [("avg", None), ("sum", None), ("avg", torch.bfloat16)])
def test_toy_gathers_and_reduce_scatters_are_recorded(mode: str, reduce: str, param_dtype: torch.dtype | None) -> None:
    """Four parameters: four all-gathers in forward, four reduce-scatters in backward, with their dtype."""
    dtype = "float32" if param_dtype is None else "bfloat16"
    for rank, calls in enumerate(harness.run(_step_trace, world_size=2, mode=mode, args=(reduce, param_dtype))):
        kinds = Counter((op, dt, red) for op, dt, red, *_ in calls)
        assert kinds == {("all_gather_into_tensor", dtype, None): 4,
                         ("reduce_scatter_tensor", dtype, reduce.upper()): 4}, calls
        assert {(group, layer, who) for *_, group, layer, who in calls} == {((0, 1), "functional", rank)}


def _toy_overlap(ctx: harness.RankContext, delayed: frozenset[str] | None) -> tuple[float, float, int] | str:
    """The overlap case's measurement for the toy; ``delayed`` replaces the kinds the delay applies to."""
    saved = timing.DELAYED_OPS
    timing.DELAYED_OPS = saved if delayed is None else delayed
    try:
        times = timing.measure_overlap(ctx, ToyDTensorAdapter(), prefetch=True, repeats=1)
    except AssertionError as exc:
        return str(exc)
    finally:
        timing.DELAYED_OPS = saved  # rank processes are pooled: the next case sees the original
    assert times.forward_backward_ms is not None
    return (times.forward_ms, times.forward_backward_ms,
            sum("all_gather_into_tensor" in line for line in times.trace.splitlines()))


@pytest.mark.timing  # bounds measured durations: alone under -n
def test_toy_overlap_is_measured_as_absent() -> None:
    """Every gather is waited for at once: the forward exceeds the overlap bound (the case FAILs)."""
    for fwd, _fwd_bwd, gathers in harness.run(_toy_overlap, world_size=2, mode="process", args=(None,),
                                              timeout_s=120):
        assert gathers >= 3, ("each of the toy's three units must all-gather on the communication worker in the "
                              "timed pass (the untimed warm-up's collectives are not delayed)")
        assert fwd > timing.FWD_BOUND_MS, f"forward {fwd:.0f} ms is within {timing.FWD_BOUND_MS:.0f} ms"


def test_overlap_without_any_delayed_collective_cannot_pass() -> None:
    """Negative control: when the delay sees no collective, the measurement refuses to report a time."""
    for message in harness.run(_toy_overlap, world_size=2, mode="process", args=(frozenset(),), timeout_s=120):
        assert isinstance(message, str) and "no collective was delayed" in message, message


@pytest.mark.timing
@pytest.mark.nightly  # [Note: nightly tests]: 10 s alone at the end of each torch's session
def test_overlap_case_fails_for_the_toy(tmp_path: Path) -> None:
    """The case itself, run by the CLI against the toy registered without packaging."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_")}
    env["FSDP_CONFORMANCE_ADAPTERS"] = TOY
    out = tmp_path / "r.json"
    run = subprocess.run([sys.executable, "-m", "conformance", "run", "--impl", "toy-dtensor", "--rank-mode",
                          "process", "--timing-repeats", "1", "-k", "training_overlap", "--json", str(out)],
                         env=env, capture_output=True, text=True, timeout=600, check=False)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["case"], r["outcome"]) for r in rows] == [("overlap/training_overlap", "FAIL")], run.stdout[-3000:]
    assert "forward does not overlap" in rows[0]["reason"], rows[0]["reason"]


def _grads_vs_mean(ctx: harness.RankContext, reduce: str) -> str:
    """One step of the toy against the contract (the local model's mean gradient); the failure text, if any."""
    from fixtures.parity import assert_close_named

    adapter = ToyDTensorAdapter() if reduce == "avg" else ToySummingAdapter()
    model, local = adapter.wrap(_model(ctx), WrapSpec()), _model(ctx)
    batches = [torch.randn(3, 4, generator=torch.Generator().manual_seed(r)) for r in range(ctx.world_size)]
    model(batches[ctx.rank]).sum().backward()
    for batch in batches:
        (local(batch).sum() / ctx.world_size).backward()
    want = {n: p.grad for n, p in local.named_parameters()}
    try:
        assert_close_named(adapter.full_grads(model), want, what=f"rank {ctx.rank} grads")
    except AssertionError as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize("mode", MODES)
def test_summing_toy_is_diagnosed_averaging_toy_passes(mode: str) -> None:
    assert harness.run(_grads_vs_mean, world_size=2, mode=mode, args=("avg",)) == ["", ""]
    for rank, message in enumerate(harness.run(_grads_vs_mean, world_size=2, mode=mode, args=("sum",))):
        assert message.startswith(f"rank {rank} grads[0.weight]: gradients are 2 x expected: "
                                  "the implementation sums where the contract averages"), message
