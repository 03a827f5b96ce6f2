"""Verdicts of the stateful fuzzer when a rank raises in the implementation ([Note: fuzz verdicts agree across
ranks]): every rank raising agrees as before; a rank raising while its peer goes on into the implementation's
next collective ends the run naming where it raised, instead of meeting that collective with its verdict."""

from __future__ import annotations

import pytest

from conformance.fuzz.agreement import Verdicts
from harness import RankContext, RankRaised, run


def _all_raise(ctx: RankContext) -> str | None:
    return Verdicts(ctx, wait_s=5.0).agree(None, raised=f"raised: RuntimeError: boom on {ctx.rank}", where="op 0")


def _one_raises(ctx: RankContext) -> None:
    verdicts = Verdicts(ctx, wait_s=1.0)
    if ctx.rank == 1:
        verdicts.agree(None, raised="raised: RuntimeError: boom", where="op 0 (Train(batch=0))")
    ctx.barrier()  # the implementation's next collective, which rank 1 never reaches


def test_every_rank_raising_agrees() -> None:
    assert run(_all_raise, world_size=2, mode="thread", timeout_s=30) == ["rank 0: raised: RuntimeError: boom on 0"] * 2


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_rank_raising_alone_names_where(mode: str) -> None:
    with pytest.raises(RankRaised, match=r"rank 1 raised RanksParted: op 0 \(Train\(batch=0\)\), rank 1: raised: "
                                         r"RuntimeError: boom; its peers did not reach the verdict within 1 s"):
        run(_one_raises, world_size=2, mode=mode, timeout_s=30)
