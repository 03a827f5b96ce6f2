"""Repeat the overlap case and its negative control; print pass counts and the spread.

Runs ``overlap/training_overlap``'s measurement for the reference (prefetch on)
and the no-prefetch control ``--runs`` times each on process ranks, alternating
so both see the same machine load, and applies the case's bounds
(:mod:`fixtures.timing`; [Note: overlap timing] in ``conformance/cases/test_overlap.py``). Acceptance:
the reference is within both bounds in every run and the control over the forward bound (what
``overlap/no_overlap_detected`` asserts) in every run; the control's forward+backward is timed here
too, and shown.
"""

from __future__ import annotations

from typing import Any

import harness
from bench._common import base_parser, median, print_table, write_json
from conformance.contract import registry
from fixtures import timing


def _rank(ctx: Any, impl_name: str, prefetch: bool, repeats: int) -> tuple[float, float]:
    times = timing.measure_overlap(ctx, registry.load(impl_name), prefetch, repeats)
    assert times.forward_backward_ms is not None
    return times.forward_ms, times.forward_backward_ms


def main() -> None:
    parser = base_parser("overlap_repeat", __doc__)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--impl", default="reference")
    parser.add_argument("--timing-repeats", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[list[tuple[float, float]]]] = {"prefetch": [], "control": []}
    try:
        for i in range(args.runs):
            for label, prefetch in (("prefetch", True), ("control", False)):
                per_rank = harness.run(_rank, world_size=2, args=(args.impl, prefetch, args.timing_repeats),
                                       timeout_s=600)
                runs[label].append(per_rank)
                verdict = ("within bounds" if all(timing.within_bounds(*r) for r in per_rank)
                           else "fwd over bound" if all(f > timing.FWD_BOUND_MS for f, _ in per_rank)
                           else "fwd+bwd over")
                print(f"run {i + 1:2d} {label:8s} {verdict:14s} "
                      + "  ".join(f"rank{r}: fwd {f:.0f} fwd+bwd {b:.0f} ms" for r, (f, b) in enumerate(per_rank)),
                      flush=True)
    finally:
        harness.shutdown_pools()
    rows = []
    for label, results in runs.items():
        passes = sum(all(timing.within_bounds(*r) for r in per_rank) for per_rank in results)
        over = sum(all(f > timing.FWD_BOUND_MS for f, _ in per_rank) for per_rank in results)
        fwd = [f / timing.FWD_BOUND_MS for per_rank in results for f, _ in per_rank]
        both = [b / timing.FWD_BWD_BOUND_MS for per_rank in results for _, b in per_rank]
        rows.append([label, f"{passes}/{len(results)}", f"{over}/{len(results)}", min(fwd), median(fwd), max(fwd),
                     min(both), median(both), max(both)])
    print_table(["variant", "within both bounds", "forward over bound", "fwd/bound min", "median", "max",
                 "fwd+bwd/bound min", "median", "max"], rows)
    write_json(args.json, {"impl": args.impl, "scale": timing.SCALE, "runs": runs})


if __name__ == "__main__":
    main()
