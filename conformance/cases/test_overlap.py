"""overlap: communication hides behind compute, and a non-overlapping run is detected.

[Note: overlap timing]
The machinery lives in :mod:`fixtures.timing` (shared with
``bench/overlap_repeat.py``). Three units of ``LinearWithSleep`` (forward sleeps ``compute_ms``, backward
``2 * compute_ms``); every collective is delayed by ``comm_ms``: on CPU by the
harness's communication worker ([Note: communication worker]), on GPU by a
device sleep on a side stream, as in the seed. The seed's GPU numbers
(compute 25 ms, comm 10 ms, buffer 2 ms per pass) are multiplied by one factor,
:data:`SCALE`, so that timer and scheduler jitter on a loaded CPU box stays
inside the buffer; the ratios are the seed's. Bounds:

- forward <= comm + 3 * compute + buffer (only the first all-gather is exposed);
- forward + backward <= that + 2 * comm + 6 * compute + 2 * buffer.

Forward+backward passes are timed up to ``case_settings.timing_repeats`` times (``--timing-repeats``), the
forward's time taken inside each, after a warm-up step (which also records the order prefetching follows,
and neither computes nor communicates with delays: it is not timed); the medians are compared, and the
passes stop once no further pass could change the verdict ([Note: decided median] in
:mod:`fixtures.timing`). The negative control times forward-only passes. Every rank checks its own time.
Efficiency = ideal time (the bound without buffers) / measured median, reported in the matrix reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from conformance.contract import optional
from conformance.contract.adapter import Capability, FSDPAdapter, WrapSpec
from conformance.contract.case import CaseSettings, Exact, case, distinct_gpus, not_applicable
from conformance.contract.optional import PostOptimEventUnsupported, set_post_optim_event
from conformance.contract.results import CaseReport
from fixtures.timing import (
    COMM_MS,
    COMPUTE_MS,
    FWD_BOUND_MS,
    FWD_BWD_BOUND_MS,
    FWD_BWD_IDEAL_MS,
    SCALE,
    LinearWithSleep,
    measure_overlap,
    overlap_summary,
)

if TYPE_CHECKING:
    from harness import RankContext

#: The timing bounds ([Note: overlap timing]) are calibrated for 2 rank processes.
TIMED_AT = Exact(2, reason="a timing case: its bounds are calibrated at 2 ranks")


def _passes(ran: int, case_settings: CaseSettings) -> str:
    """The medians' basis, for the report ([Note: decided median])."""
    return f"median of {ran} of up to {case_settings.timing_repeats} passes"


@case("overlap/training_overlap", clause="C12", world_size=TIMED_AT, modes=("process",), timeout_s=300, timing=True)
def test_training_overlap(ctx: RankContext, impl: FSDPAdapter, case_settings: CaseSettings) -> CaseReport:
    """With prefetching, three sleeping units whose collectives are each delayed by ``comm_ms`` finish the
    median forward within comm + 3 * compute + buffer and forward+backward within that plus 2 * comm
    + 6 * compute + 2 * buffer, on every rank: communication hides behind compute ([Note: overlap timing])."""
    # Process ranks only: thread ranks share one GIL-bound process and the worker
    # thread cannot resolve a thread rank's process group ([Note: communication worker]).
    times = measure_overlap(ctx, impl, prefetch=True, repeats=case_settings.timing_repeats, decide=True)
    fwd_ms, fwd_bwd_ms = times.forward_ms, times.forward_backward_ms
    assert fwd_bwd_ms is not None
    summary = f"{overlap_summary(fwd_ms, fwd_bwd_ms)}, {_passes(times.passes, case_settings)}"
    late = "\n".join(times.trace.splitlines()[-12:])
    assert fwd_ms <= FWD_BOUND_MS, f"rank {ctx.rank}: forward does not overlap: {summary}\n{late}"
    assert fwd_bwd_ms <= FWD_BWD_BOUND_MS, f"rank {ctx.rank}: backward does not overlap: {summary}\n{late}"
    return CaseReport(reason=summary, metrics={"forward_ms": fwd_ms, "forward_backward_ms": fwd_bwd_ms,
                                               "efficiency": FWD_BWD_IDEAL_MS / fwd_bwd_ms})


@case(
    "overlap/no_overlap_detected", clause="C12",
    world_size=TIMED_AT,
    modes=("process",),
    timeout_s=300,
    timing=True,
    requires=[Capability.FORWARD_PREFETCH, Capability.BACKWARD_PREFETCH],
)
def test_no_overlap_detected(ctx: RankContext, impl: FSDPAdapter, case_settings: CaseSettings) -> CaseReport:
    """Negative control: with prefetching off, the same model must exceed the forward bound.

    Only the forward is timed: that is the bound this control proves can fail. That the
    forward+backward bound can fail is proven by ``mutant-no-backward-prefetch``, which keeps
    forward prefetch and must fail ``overlap/training_overlap`` (conformance/selftest/mutants/runtime.py).
    """
    times = measure_overlap(ctx, impl, prefetch=False, repeats=case_settings.timing_repeats, backward=False,
                            decide=True)
    fwd_ms = times.forward_ms
    summary = f"{overlap_summary(fwd_ms, None)}, {_passes(times.passes, case_settings)}"
    assert fwd_ms > FWD_BOUND_MS, f"rank {ctx.rank}: the forward bound cannot fail, it is too loose: {summary}"
    return CaseReport(reason=f"without prefetch: {summary}", metrics={"forward_ms": fwd_ms})


@case(
    "overlap/post_optim_event_overlap", clause="C12",
    world_size=TIMED_AT,
    modes=("process",),
    gpus=distinct_gpus(2),  # timing: ranks sharing a GPU would share its time too
    timeout_s=300,
    timing=True,
    requires=[Capability.POST_OPTIM_EVENT],
)
def test_post_optim_event_overlap(ctx: RankContext, impl: FSDPAdapter) -> None:
    """With a post-optimizer event the next step's all-gather overlaps the optimizer step (GPU)."""
    from torch.distributed.tensor.experimental import implicit_replication

    from fixtures.timing import device_sleep

    model = nn.Sequential(LinearWithSleep(4, COMPUTE_MS / SCALE), nn.Linear(4, 4)).to(ctx.device)
    model[1] = impl.wrap(model[1], WrapSpec(strategy="SHARD_GRAD_OP", use_orig_params=True, device_id=ctx.device))
    optim = optional.optimizer(impl, model, torch.optim.AdamW, lr=1e-2)
    inp = torch.randn(2, 4, device=ctx.device)
    comm_ms, compute_ms, buffer_ms, steps = COMM_MS / SCALE, COMPUTE_MS / SCALE, 4.0, 5
    from harness.collectives.recorder import patch_collectives

    def delayed(op: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if op == "all_gather_into_tensor":
            device_sleep(comm_ms, ctx.device)
        return fn(*args, **kwargs)

    def train(use_event: bool) -> float:
        torch.cuda.synchronize()
        ctx.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            optim.zero_grad()
            with patch_collectives(delayed, barrier=False):
                loss = model(inp).sum()
            loss.backward()
            # The optimizer sees the unwrapped layer's plain tensors next to the unit's
            # DTensors; as in the seed, plain tensors count as replicated DTensors here
            # (without it CUDA's default foreach AdamW rejects the mix, and a crash
            # would pass for the breakage this case looks for).
            with implicit_replication():
                optional.step(impl, model, optim)
            if use_event:
                set_post_optim_event(impl, model[1], torch.cuda.current_stream().record_event())
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    try:
        train(False)
        baseline, with_event = train(False), train(True)
    except PostOptimEventUnsupported as exc:
        not_applicable(str(exc))
    assert baseline <= steps * (3 * compute_ms + comm_ms + buffer_ms)
    expected = steps * (3 * compute_ms + buffer_ms) + comm_ms
    assert with_event <= expected, f"{with_event:.1f} ms > {expected:.1f} ms"
    assert baseline > expected, f"baseline {baseline:.1f} ms does not exceed {expected:.1f} ms"
