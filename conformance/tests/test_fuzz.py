"""The parity fuzzer's own contract: plain-data examples, determinism, shrinking to a reproducer."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings

import conformance.fuzz.example as example_mod
from conformance.adapters.base import FSDPAdapter
from conformance.fuzz.driver import FuzzResult, FuzzSettings, fuzz, render_case
from conformance.fuzz.example import Block, Example, ModelSpec, examples, source
from conformance.mutants import NoGradDivide
from harness import RankContext, run


@settings(max_examples=60, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(examples(world_size=2))
def test_source_rebuilds_the_example(example: Example) -> None:
    """A reproducer is Python: evaluating an example's source gives the same example back."""
    assert eval(source(example), vars(example_mod)) == example


def _drawn(seed: int, count: int) -> list[Example]:
    seen: list[Example] = []

    def record(example: Example) -> bool:
        seen.append(example)
        return False

    options = settings(max_examples=count, database=None, phases=(Phase.generate,))
    with pytest.raises(Exception, match="No examples found"):
        find(examples(world_size=4), record, settings=options, random=random.Random(seed))
    return seen


def test_drawing_is_deterministic_by_seed() -> None:
    first, again, other = _drawn(3, 15), _drawn(3, 15), _drawn(4, 15)
    assert first == again
    assert first != other
    assert len(set(first)) > 5, "a seed should give varied examples"


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Block(layers=("dense",)), "layers"),
        (lambda: Block(layers=("linear",), tie=True), "two linears"),
        (lambda: ModelSpec(tie_head=True), "embedding"),
        (lambda: Example(world_size=2, wrap=("blocks.3",)), "blocks.3"),
        (lambda: Example(world_size=2, strategy="HYBRID_SHARD"), "strategy='HYBRID_SHARD'"),
        (lambda: Example(world_size=2, micro_batches=0), "micro_batches"),
    ],
)
def test_bad_examples_name_the_bad_value(build: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FSDP_FUZZ_EXAMPLES", raising=False)
    monkeypatch.setenv("FSDP_FUZZ_SEED", "7")
    config = FuzzSettings.from_env()
    assert (config.budget(1), config.budget(2), config.budget(4), config.seed) == (12, 15, 3, 7)
    monkeypatch.setenv("FSDP_FUZZ_EXAMPLES", "200")
    assert FuzzSettings.from_env().budget(4) == 200
    monkeypatch.setenv("FSDP_FUZZ_EXAMPLES", "many")
    with pytest.raises(ValueError, match="FSDP_FUZZ_EXAMPLES='many'"):
        FuzzSettings.from_env()


def fuzz_on_ranks(ctx: RankContext, impl: FSDPAdapter, config: FuzzSettings) -> FuzzResult:
    """Module level, so process ranks can import it."""
    return fuzz(ctx, impl, config)


def test_fuzzer_catches_missing_grad_divide_and_shrinks_it() -> None:
    """Against a reference that sums gradients without averaging, the fuzzer fails and shrinks
    to the smallest example: every choice at its simplest, two ranks."""
    results = run(fuzz_on_ranks, world_size=2, mode="process", timeout_s=240,
                  args=(NoGradDivide(), FuzzSettings(examples=10, seed=1)))
    assert all(r == results[0] for r in results), "ranks disagree on the fuzz result"
    result = results[0]
    assert result.failing is not None, f"no failure in {result.runs} runs"
    assert source(result.failing) == "Example(world_size=2)", result.failing
    assert result.message is not None and "grads after backward" in result.message, result.message
    case_text = render_case(result.failing, result.message)
    assert "run_example(ctx, impl, Example(world_size=2))" in case_text, case_text
    compile(case_text, "<reproducer>", "exec")
