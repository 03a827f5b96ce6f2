"""Training step time: reference vs torch FSDP1 vs torch FSDP2 on the same transformer.

CPU, gloo, world size 2, process ranks. For each model size every
implementation trains the same seeded encoder stack (FULL_SHARD, one unit per
layer); sizes are visited round-robin, implementations interleaved within a
round (see [Note: benchmark honesty] in ``bench/_common.py``). A step is
forward + backward + Adam; the figure per implementation is the median over
rounds of the slowest rank's median step.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn as nn

import harness
from bench._common import base_parser, median, print_table, save_plot, write_json
from conformance.contract import optional, registry
from conformance.contract.adapter import AutoWrap, WrapSpec
from fixtures.seeding import generator, seeded_init_

IMPLS = ("reference", "torch-fsdp1", "torch-fsdp2")


class EncoderStack(nn.Module):
    """``layers`` transformer encoder layers of width ``d_model`` with a linear head."""

    def __init__(self, d_model: int, layers: int, seed: int = 0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(d_model, d_model)
        seeded_init_(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _rank_steps(ctx: Any, impl_name: str, d_model: int, layers: int, steps: int, warmup: int) -> float:
    torch.set_num_threads(1)
    impl = registry.load(impl_name)
    spec = WrapSpec(strategy="FULL_SHARD", auto_wrap=AutoWrap((nn.TransformerEncoderLayer,)), use_orig_params=True)
    model = impl.wrap(EncoderStack(d_model, layers), spec)
    optim = optional.optimizer(impl, model, torch.optim.Adam, lr=1e-3)
    x = torch.randn(8, 16, d_model, generator=generator(ctx.rank))
    times = []
    for step in range(warmup + steps):
        ctx.barrier()
        start = time.perf_counter()
        model(x).square().mean().backward()
        optional.step(impl, model, optim)
        optim.zero_grad()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return median(times)


def measure(sizes: list[int], layers: int, steps: int, warmup: int, rounds: int) -> dict[str, dict[int, float]]:
    samples: dict[str, dict[int, list[float]]] = {i: {d: [] for d in sizes} for i in IMPLS}
    for _ in range(rounds):
        for d_model in sizes:
            for impl_name in IMPLS:
                per_rank = harness.run(
                    _rank_steps,
                    world_size=2,
                    mode="process",
                    timeout_s=600,
                    args=(impl_name, d_model, layers, steps, warmup),
                )
                samples[impl_name][d_model].append(max(per_rank))
    return {i: {d: median(v) for d, v in by_size.items()} for i, by_size in samples.items()}


def main() -> None:
    parser = base_parser("step_time", __doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    try:
        result = measure(args.sizes, args.layers, args.steps, args.warmup, args.rounds)
    finally:
        harness.shutdown_pools()
    rows = []
    for d_model in args.sizes:
        ref, fsdp1, fsdp2 = (result[i][d_model] * 1e3 for i in IMPLS)
        rows.append([d_model, ref, fsdp1, fsdp2, ref / fsdp2, ref / fsdp1])
    print_table(["d_model", "reference ms", "fsdp1 ms", "fsdp2 ms", "ref/fsdp2", "ref/fsdp1"], rows)
    write_json(args.json, {"layers": args.layers, "steps": args.steps, "rounds": args.rounds,
                           "step_time_s": {i: {str(d): t for d, t in v.items()} for i, v in result.items()}})
    if args.plot:
        def draw(ax: Any) -> None:
            for impl_name in IMPLS:
                ax.plot(args.sizes, [result[impl_name][d] * 1e3 for d in args.sizes], marker="o", label=impl_name)
            ax.set_xlabel("d_model")
            ax.set_ylabel("median step time (ms), ws 2, CPU/gloo")
            ax.set_title("FULL_SHARD training step: reference vs torch FSDP")
            ax.legend()

        save_plot(args.plot, draw)


if __name__ == "__main__":
    main()
