"""The reference's per-rank collective trace for one hybrid configuration, as a golden.

A change in how the reference communicates under HYBRID_SHARD (which group a
collective runs on, how many there are, their order or sizes) shows up here as
a readable diff. Regenerate on purpose with ``EXPECTTEST_ACCEPT=1``.
"""

from __future__ import annotations

from expecttest import TestCase

import harness
from conformance.cases.test_hybrid_shard import (
    NODE,
    WORLD,
    Setup,
    build_hybrid_transformer,
    fwd_bwd,
)
from conformance.contract import registry

SETUP = Setup(
    strategy="HYBRID_SHARD", mode="ALL_HYBRID", use_orig_params=False, use_device_mesh=True
)


def _trace(ctx: harness.RankContext) -> str:
    model = build_hybrid_transformer(ctx, registry.load("reference"), SETUP)
    with ctx.record_collectives() as trace:
        fwd_bwd(ctx, model)
    return trace.render()


class TestHybridTrace(TestCase):
    def test_reference_hybrid_shard_trace(self) -> None:
        traces = harness.run(
            _trace, world_size=WORLD, mode="thread", env={"LOCAL_WORLD_SIZE": str(NODE)}
        )
        rendered = "\n".join(f"-- rank {rank}\n{text}" for rank, text in enumerate(traces))
        self.assertExpectedInline(
            rendered,
            """\
-- rank 0
all_gather_into_tensor group=[0, 1] float32 912B async
all_gather_into_tensor group=[0, 1] float32 2864B async
all_gather_into_tensor group=[0, 1] float32 2864B async
all_gather_into_tensor group=[0, 1] float32 5104B async
all_gather_into_tensor group=[0, 1] float32 5104B async
all_gather_into_tensor group=[0, 1] float32 5104B async
all_gather_into_tensor group=[0, 1] float32 5104B async
reduce_scatter_tensor SUM group=[0, 1] float32 10208B async
all_gather_into_tensor group=[0, 1] float32 2864B async
all_reduce SUM group=[0, 2] float32 5104B async
reduce_scatter_tensor SUM group=[0, 1] float32 10208B async
all_gather_into_tensor group=[0, 1] float32 2864B async
all_reduce SUM group=[0, 2] float32 5104B async
reduce_scatter_tensor SUM group=[0, 1] float32 5728B async
all_reduce SUM group=[0, 2] float32 2864B async
reduce_scatter_tensor SUM group=[0, 1] float32 5728B async
all_reduce SUM group=[0, 2] float32 2864B async
reduce_scatter_tensor SUM group=[0, 1] float32 1824B async
all_reduce SUM group=[0, 2] float32 912B async
-- rank 1
all_gather_into_tensor group=[0, 1] float32 912B async
all_gather_into_tensor group=[0, 1] float32 2864B async
all_gather_into_tensor group=[0, 1] float32 2864B async
all_gather_into_tensor group=[0, 1] float32 5104B async
all_gather_into_tensor group=[0, 1] float32 5104B async
all_gather_into_tensor group=[0, 1] float32 5104B async
all_gather_into_tensor group=[0, 1] float32 5104B async
reduce_scatter_tensor SUM group=[0, 1] float32 10208B async
all_gather_into_tensor group=[0, 1] float32 2864B async
all_reduce SUM group=[1, 3] float32 5104B async
reduce_scatter_tensor SUM group=[0, 1] float32 10208B async
all_gather_into_tensor group=[0, 1] float32 2864B async
all_reduce SUM group=[1, 3] float32 5104B async
reduce_scatter_tensor SUM group=[0, 1] float32 5728B async
all_reduce SUM group=[1, 3] float32 2864B async
reduce_scatter_tensor SUM group=[0, 1] float32 5728B async
all_reduce SUM group=[1, 3] float32 2864B async
reduce_scatter_tensor SUM group=[0, 1] float32 1824B async
all_reduce SUM group=[1, 3] float32 912B async
-- rank 2
all_gather_into_tensor group=[2, 3] float32 912B async
all_gather_into_tensor group=[2, 3] float32 2864B async
all_gather_into_tensor group=[2, 3] float32 2864B async
all_gather_into_tensor group=[2, 3] float32 5104B async
all_gather_into_tensor group=[2, 3] float32 5104B async
all_gather_into_tensor group=[2, 3] float32 5104B async
all_gather_into_tensor group=[2, 3] float32 5104B async
reduce_scatter_tensor SUM group=[2, 3] float32 10208B async
all_gather_into_tensor group=[2, 3] float32 2864B async
all_reduce SUM group=[0, 2] float32 5104B async
reduce_scatter_tensor SUM group=[2, 3] float32 10208B async
all_gather_into_tensor group=[2, 3] float32 2864B async
all_reduce SUM group=[0, 2] float32 5104B async
reduce_scatter_tensor SUM group=[2, 3] float32 5728B async
all_reduce SUM group=[0, 2] float32 2864B async
reduce_scatter_tensor SUM group=[2, 3] float32 5728B async
all_reduce SUM group=[0, 2] float32 2864B async
reduce_scatter_tensor SUM group=[2, 3] float32 1824B async
all_reduce SUM group=[0, 2] float32 912B async
-- rank 3
all_gather_into_tensor group=[2, 3] float32 912B async
all_gather_into_tensor group=[2, 3] float32 2864B async
all_gather_into_tensor group=[2, 3] float32 2864B async
all_gather_into_tensor group=[2, 3] float32 5104B async
all_gather_into_tensor group=[2, 3] float32 5104B async
all_gather_into_tensor group=[2, 3] float32 5104B async
all_gather_into_tensor group=[2, 3] float32 5104B async
reduce_scatter_tensor SUM group=[2, 3] float32 10208B async
all_gather_into_tensor group=[2, 3] float32 2864B async
all_reduce SUM group=[1, 3] float32 5104B async
reduce_scatter_tensor SUM group=[2, 3] float32 10208B async
all_gather_into_tensor group=[2, 3] float32 2864B async
all_reduce SUM group=[1, 3] float32 5104B async
reduce_scatter_tensor SUM group=[2, 3] float32 5728B async
all_reduce SUM group=[1, 3] float32 2864B async
reduce_scatter_tensor SUM group=[2, 3] float32 5728B async
all_reduce SUM group=[1, 3] float32 2864B async
reduce_scatter_tensor SUM group=[2, 3] float32 1824B async
all_reduce SUM group=[1, 3] float32 912B async""",
        )
