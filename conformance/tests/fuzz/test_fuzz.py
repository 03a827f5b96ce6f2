"""The parity fuzzer's own contract: plain-data examples, determinism, shrinking to a reproducer."""

from __future__ import annotations

import dataclasses
import importlib
import random
from collections.abc import Collection
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

import conformance.cases.test_fuzz as fuzz_cases
import conformance.fuzz.example as example_mod
from conformance.adapters.reference import ReferenceAdapter
from conformance.contract.adapter import Capability, FSDPAdapter
from conformance.contract.case import CaseSettings
from conformance.fuzz.drawn_precision import precision_note
from conformance.fuzz.driver import (
    FuzzResult,
    FuzzSettings,
    Search,
    _draws_from_the_seed_alone,
    fuzz,
    keep_hypothesis_out_of_cwd,
    render_case,
    search,
)
from conformance.fuzz.example import LAYERS, LOW_DTYPES, Block, Example, ModelSpec, Policy, examples, source
from conformance.fuzz.model import build_model, loss_of, make_batch
from conformance.fuzz.parity_run import check_example
from conformance.selftest.mutants.precision import ParamDtypeIgnored
from conformance.selftest.mutants.runtime import NoGradDivide
from harness import RankContext, run

keep_hypothesis_out_of_cwd()  # this module's @given tests too


@settings(max_examples=60, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(examples(world_size=2))
def test_source_rebuilds_the_example(example: Example) -> None:
    """A reproducer is Python: evaluating an example's source gives the same example back."""
    assert eval(source(example), vars(example_mod)) == example


def _drawn(
    seed: int, count: int, precision: Collection[str] = example_mod.PRECISION_FEATURES, world_size: int = 4
) -> list[Example]:
    seen: list[Example] = []

    def record(example: Example) -> bool:
        seen.append(example)
        return False

    options = settings(max_examples=count, database=None, phases=(Phase.generate,))
    with pytest.raises(Exception, match="No examples found"):
        find(examples(world_size, precision=precision), record, settings=options, random=random.Random(seed))
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
        (lambda: Policy(param_dtype="float32"), "param_dtype='float32'"),
        (lambda: Policy(reduce_dtype="bfloat16"), "reduce_dtype='bfloat16'"),
        (lambda: Example(world_size=2, dtype="float64", policy=Policy()), "dtype='float64'"),
        (lambda: Example(world_size=2, policy=Policy(buffer_dtype="float16")), "buffer_dtype='float16'"),
        (lambda: Example(world_size=4, policy=Policy()), "world_size=4, policy=Policy"),
        (lambda: Example(world_size=2, policy=Policy(param_dtype="float16")), "a float16 reduction"),
    ],
)
def test_bad_examples_name_the_bad_value(build: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_policies_are_drawn_and_dropped_where_unsupported() -> None:
    """A seed draws policies of every kind; for an implementation without a feature it draws the
    same examples with that part of the policy dropped (they still run, in full precision)."""
    full = _drawn(3, 100, world_size=2)
    policies = [e.policy for e in full if e.policy is not None]
    assert {p.param_dtype for p in policies} == set(LOW_DTYPES), policies
    assert {p.reduce_dtype for p in policies} == {None, "float32"}, policies
    assert {p.buffer_dtype for p in policies} == {None, *LOW_DTYPES}, policies
    no_buffers = [dataclasses.replace(e.policy, buffer_dtype=None) if e.policy else None for e in full]
    assert [e.policy for e in _drawn(3, 100, {"mixed_precision"}, world_size=2)] == no_buffers
    assert _drawn(3, 100, (), world_size=2) == [dataclasses.replace(e, policy=None) for e in full]
    assert {p.reduce_dtype for p in policies if p.param_dtype == "float16"} == {"float32"}, policies
    at_four = [e.policy for e in _drawn(3, 100) if e.policy is not None]
    assert at_four and {p.reduce_dtype for p in at_four} == {"float32"}, "a low-precision reduction at 4 ranks"
    with pytest.raises(ValueError, match="unknown precision features"):
        find(examples(world_size=2, precision={"fp8"}), lambda _: True, settings=settings(database=None))


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("kind", LAYERS)
def test_every_layer_kind_computes_in_low_precision_here(kind: str, dtype: str) -> None:
    """float16 is drawn on every device (as the mixed_precision area runs it): this fails on a torch
    whose CPU kernels cannot compute a layer kind in it, naming the layer."""
    spec = ModelSpec(width=3, blocks=(Block(layers=(kind,)),))
    low = getattr(torch, dtype)
    model = build_model(spec, 0, low, torch.device("cpu"))
    loss_of(model(make_batch(spec, 0, low, torch.device("cpu")))).backward()
    assert {p.grad.dtype for p in model.parameters() if p.grad is not None} == {low}, kind


class _NoMixedPrecision(ReferenceAdapter):
    name = "no-mixed-precision"
    capabilities = ReferenceAdapter.capabilities - {Capability.MIXED_PRECISION, Capability.MP_BUFFER_DTYPE}


def test_report_says_what_of_a_policy_is_left_out() -> None:
    assert precision_note(ReferenceAdapter()) == ""
    assert "lacks mixed_precision" in precision_note(_NoMixedPrecision())


def test_budget_from_the_run_s_settings() -> None:
    config = FuzzSettings.of(CaseSettings(fuzz_seed=7, fuzz_verbose=True))
    assert (config.budget(1), config.budget(2), config.budget(4), config.seed, config.verbose) == (12, 15, 3, 7, True)
    assert FuzzSettings.of(CaseSettings(fuzz_examples=200)).budget(4) == 200
    assert FuzzSettings.of(CaseSettings()).shrink and not FuzzSettings.of(CaseSettings(fuzz_shrink=False)).shrink
    with pytest.raises(ValueError, match="fuzz examples must be >= 1, got 0"):
        FuzzSettings(examples=0)


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


def _at_least_1000(_ctx: RankContext, _impl: Any, value: int) -> str | None:
    return f"{value} >= 1000" if value >= 1000 else None


def search_integers(ctx: RankContext, shrink: bool) -> Search:
    """Search integers for one of at least 1000 (module level, so ranks can import it)."""
    return search(ctx, None, st.integers(0, 10**6), _at_least_1000, budget=50,  # type: ignore[arg-type]
                  config=FuzzSettings(seed=3, shrink=shrink))


def test_without_shrinking_the_first_failure_drawn_is_reported() -> None:
    """[Note: unshrunk failures]: shrinking turns the first failure drawn into the smallest one, with more runs;
    without it the search stops at the first failure, which still fails."""
    shrunk, drawn = (run(search_integers, world_size=1, mode="thread", args=(shrink,))[0] for shrink in (True, False))
    assert shrunk.failing == 1000 and shrunk.message == "1000 >= 1000", shrunk
    assert drawn.failing is not None and drawn.failing > 1000 and drawn.message == f"{drawn.failing} >= 1000", drawn
    assert drawn.runs < shrunk.runs, (drawn, shrunk)


def shrink_and_replay(
    ctx: RankContext, mutant: FSDPAdapter, config: FuzzSettings
) -> tuple[FuzzResult, list[str | None]]:
    """Fuzz ``mutant``, then run the shrunk example again on it and on the reference (module level)."""
    result = fuzz(ctx, mutant, config)
    assert result.failing is not None, f"no failure in {result.runs} runs"
    return result, [check_example(ctx, impl, result.failing) for impl in (mutant, ReferenceAdapter())]


def test_a_policy_mismatch_shrinks_to_a_reproducer_with_the_policy() -> None:
    """Against a reference that ignores param_dtype (a policy override, no patch, so the shared rank
    pool stays clean) the fuzzer shrinks to the bare policy; the pasted case names the policy and the
    capability it needs, and its example fails on the mutant again and passes on the reference."""
    results = run(shrink_and_replay, world_size=1, mode="process", timeout_s=240,
                  args=(ParamDtypeIgnored(), FuzzSettings(examples=12, seed=0)))
    result, (again, reference) = results[0]
    assert source(result.failing) == "Example(world_size=1, policy=Policy())", result.failing
    # The fuzzer feeds bfloat16 batches (fuzz.precision.model_input): float32 parameters cannot take them.
    assert result.message is not None and "BFloat16 and Float" in result.message, result.message
    assert again is not None and "BFloat16 and Float" in again, again
    assert reference is None, reference
    case_text = render_case(result.failing, result.message)
    assert "requires=[Capability.MIXED_PRECISION])" in case_text, case_text
    assert "run_example(ctx, impl, Example(world_size=1, policy=Policy()))" in case_text, case_text
    exec(compile(case_text, "<reproducer>", "exec"), dict(vars(fuzz_cases)))  # its names resolve there


def _integers_drawn(seed: int) -> list[int]:
    seen: list[int] = []

    def record(value: int) -> bool:
        seen.append(value)
        return False

    options = settings(max_examples=300, database=None, phases=(Phase.generate,))
    with _draws_from_the_seed_alone(), pytest.raises(Exception, match="No examples found"):
        find(st.integers(0, 2**16), record, settings=options, random=random.Random(seed))
    return seen


def test_a_seed_draws_the_same_whatever_the_process_imported(tmp_path: Any, monkeypatch: Any) -> None:
    """[Note: draws from the seed alone]: a local module full of constants, which hypothesis would mix into its
    draws, imported between two draws of one seed (each with hypothesis's cache of constants as a fresh process
    has it), changes nothing while the fuzzers draw."""
    from hypothesis.internal.conjecture import providers

    def fresh_cache() -> None:
        monkeypatch.setattr(providers, "CONSTANTS_CACHE", type(providers.CONSTANTS_CACHE)(1024))

    fresh_cache()
    before = _integers_drawn(7)
    constants = ", ".join(str(value) for value in range(20_001, 20_401, 3))
    (tmp_path / "fuzz_constants_probe.py").write_text(f"VALUES = [{constants}]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("fuzz_constants_probe")
    assert 20_001 in providers._get_local_constants().set_for_type("integer"), "hypothesis ignores the probe"
    fresh_cache()
    assert _integers_drawn(7) == before
