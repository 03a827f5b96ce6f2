"""The stateful fuzzer's own contract: plain-data programs, determinism, the shadow, shrinking to a reproducer."""

from __future__ import annotations

import random
import re
from typing import Any

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, Phase, find, given, settings

import conformance.cases.test_fuzz as stateful_cases
import conformance.fuzz.example as example_mod
import conformance.fuzz.full_value_ops as full_value_ops
import conformance.fuzz.ops as ops_mod
from conformance.adapters.reference import ReferenceAdapter
from conformance.adapters.torch_fsdp2 import TorchFSDP2Adapter
from conformance.contract.adapter import Capability, FSDPAdapter, UnitInfo
from conformance.contract.case import CaseSettings
from conformance.fuzz.drawing import programs
from conformance.fuzz.drawn_optimizers import STATEFUL_OPTIMIZERS, stateful_optimizer
from conformance.fuzz.driver import Search
from conformance.fuzz.example import Block, ModelSpec, Policy, source
from conformance.fuzz.ops import (
    CONTROL_OPS,
    FULLY_SHARD_FEATURES,
    Backward,
    Config,
    Forward,
    FullyShardConfig,
    GradientDivideFactor,
    GradSync,
    Load,
    NoSync,
    Prefetch,
    Program,
    Reshard,
    ReshardAfterBackward,
    Save,
    SetReshardAfterForward,
    Step,
    Train,
    Unshard,
    WrapConfig,
    ZeroGrad,
)
from conformance.fuzz.searching import budget, stateful_fuzz
from conformance.fuzz.stateful import check_program
from conformance.fuzz.twin_checks import assert_no_grads_outside_the_loss
from conformance.fuzz.wrapping import assert_ignored_kept, missing_operations, render_program
from conformance.selftest.fuzz_alone import reference_failures, verdicts
from conformance.selftest.mutants import (
    FirstGradPieceOnly,
    GradSyncKeepsGradInParamDtype,
    IgnoresGradientDivideFactor,
    MetaInitNotFollowed,
    NoGradDivide,
    NoNestedBackwardGuard,
    ReshardsAfterForwardAnyway,
    Silent,
    UnshardWithoutGather,
)
from harness import RankContext, run
from harness.ranks.rank_mode import RankMode

_NAMES = {**vars(example_mod), **vars(ops_mod)}


@settings(max_examples=60, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(programs(world_size=2))
def test_source_rebuilds_the_program(program: Program) -> None:
    """A reproducer is Python: evaluating a program's source gives the same program back."""
    assert eval(source(program), _NAMES) == program


def _drawn(seed: int, count: int, features: Any = ops_mod.FEATURES, world_size: int = 2) -> list[Program]:
    seen: list[Program] = []

    def record(program: Program) -> bool:
        seen.append(program)
        return False

    options = settings(max_examples=count, database=None, phases=(Phase.generate,))
    with pytest.raises(Exception, match="No examples found"):
        find(programs(world_size, features=features), record, settings=options, random=random.Random(seed))
    return seen


def test_drawing_is_deterministic_and_varied() -> None:
    # One seed's programs are correlated (hypothesis's generation reuses earlier choices): programs with a
    # policy among 40 range from 0 (seeds 3 and 6) to 10 over seeds 3-9 since NoSync, Save and Load follow
    # Train in the op list (2 to 11 before); seed 4 draws every configuration feature checked here.
    first, again = _drawn(4, 40), _drawn(4, 40)
    assert first == again and first != _drawn(5, 40)
    kinds = {type(op).__name__ for program in first for op in program.ops}
    controls = {kind.__name__ for kind in CONTROL_OPS}
    plain = {"Forward", "Backward", "Step", "Train", "ZeroGrad", "Mode", "Save", "Load", "NoSync", "ClipGradNorm",
             "ScaleParams", "SummonFull"}
    assert kinds - controls == plain, kinds
    assert kinds & controls, kinds  # every one of them: test_controls_are_drawn_only_where_declared
    configs = [p.config for p in first]
    assert any(c.policy for c in configs) and any(isinstance(c, WrapConfig) and c.cpu_offload for c in configs)
    assert any(c.checkpoint for c in configs) and any(c.frozen for c in configs), configs
    assert {type(c) for c in configs} == {WrapConfig, FullyShardConfig}, configs


def test_unsupported_features_are_dropped_after_drawing() -> None:
    """Without a configuration feature the same seed draws the same operations on the config minus that
    feature (``fully_shard``'s features alone: no ``wrap`` policy, no offload); without ``fully_shard`` no program
    uses it or its controls."""
    full, plain, bare = _drawn(3, 40), _drawn(3, 40, FULLY_SHARD_FEATURES), _drawn(3, 40, ())
    assert [p.ops for p in plain] == [p.ops for p in full]
    assert not any(isinstance(p.config, WrapConfig) and (p.config.policy or p.config.cpu_offload) for p in plain)
    assert all(isinstance(p.config, WrapConfig) and not (p.config.policy or p.config.cpu_offload) for p in bare)
    assert not any(isinstance(op, CONTROL_OPS) for p in bare for op in p.ops)


def _all_but(*kinds: type) -> tuple[type, ...]:
    return tuple(kind for kind in CONTROL_OPS if kind not in kinds)


@pytest.mark.parametrize(
    ("features", "absent"),
    [
        ({"fully_shard"}, CONTROL_OPS),
        ({"fully_shard", "explicit_prefetch"}, _all_but(Prefetch)),
        ({"fully_shard", "fully_shard_controls"}, (Prefetch, SetReshardAfterForward, GradientDivideFactor)),
        ({"fully_shard", "set_reshard_after_forward"}, _all_but(SetReshardAfterForward)),
        ({"fully_shard", "gradient_divide_factor"}, _all_but(GradientDivideFactor)),
    ],
)
def test_controls_are_drawn_only_where_declared(features: set[str], absent: tuple[type, ...]) -> None:
    """A ``fully_shard`` program draws the controls the adapter has and no others."""
    drawn = _drawn(5, 150, features)
    ops = [op for p in drawn if p.config.api == "fully_shard" for op in p.ops]
    assert ops and not any(isinstance(op, absent) for op in ops), sorted({type(op).__name__ for op in ops})
    kinds = {type(op) for op in ops}
    assert set(CONTROL_OPS) - set(absent) <= kinds, kinds


def test_an_int_reshard_after_forward_is_drawn_only_where_declared() -> None:
    """``reshard_after_forward=2`` at four ranks needs ``reshard_after_forward_int``; else it is ``True``."""
    with_int = {p.config.reshard_after_forward for p in _drawn(3, 100, FULLY_SHARD_FEATURES, world_size=4)
                if isinstance(p.config, FullyShardConfig)}
    without = {p.config.reshard_after_forward for p in _drawn(3, 100, {"fully_shard"}, world_size=4)
               if isinstance(p.config, FullyShardConfig)}
    assert 2 in with_int and 2 not in without and False in without, (with_int, without)


def test_state_dicts_inside_iterations_are_drawn_for_wrap_programs_only() -> None:
    """``saves_in_iteration`` is read off a ``wrap`` program's unused ``reshard_after_forward`` draw
    ([Note: options from an unused draw]): some ``wrap`` programs take it, no ``fully_shard`` one."""
    drawn = _drawn(3, 100, FULLY_SHARD_FEATURES)
    assert {p.config.saves_in_iteration for p in drawn if isinstance(p.config, WrapConfig)} == {True, False}
    assert any(isinstance(p.config, FullyShardConfig) for p in drawn)  # which have no such field


def test_meta_init_is_drawn_for_fully_shard_programs_only() -> None:
    """``meta_init`` is read off a ``fully_shard`` program's unused ``use_orig_params`` draw ([Note: options from
    an unused draw]), and only where the adapter declares it."""
    drawn = _drawn(3, 100, FULLY_SHARD_FEATURES)
    assert {p.config.meta_init for p in drawn if isinstance(p.config, FullyShardConfig)} == {True, False}
    assert any(isinstance(p.config, WrapConfig) for p in drawn)  # which have no such field
    assert not any(isinstance(p.config, FullyShardConfig) and p.config.meta_init
                   for p in _drawn(3, 100, FULLY_SHARD_FEATURES - {"meta_init"}))


def test_fsdp2s_policy_alone_is_drawn_for_fully_shard_programs_only() -> None:
    """An adapter with ``fully_shard``'s mixed precision and no ``wrap`` one gets the same ``fully_shard`` policies
    as one with both (inputs cast: the capability covers ``cast_forward_inputs``), no ``wrap`` policy, the same
    programs otherwise, and reproducers asking for the capability it has alone."""
    both, alone = _drawn(3, 100, ops_mod.FEATURES), _drawn(3, 100, FULLY_SHARD_FEATURES | {"float64"})
    sharded = [(a.config.policy, b.config.policy)
               for a, b in zip(both, alone, strict=True) if a.config.api == "fully_shard"]
    assert any(policy for policy, _ in sharded) and all(a == b for a, b in sharded), sharded
    assert all(policy.cast_inputs for policy, _ in sharded if policy), sharded
    assert not any(p.config.policy for p in alone if p.config.api == "wrap")
    assert [p.ops for p in both] == [p.ops for p in alone]
    text = render_program(next(p for p in alone if p.config.policy), "found")
    assert "Capability.FULLY_SHARD_MIXED_PRECISION" in text and "Capability.MIXED_PRECISION," not in text, text


def test_reentrant_blocks_are_drawn_for_wrap_programs_with_an_odd_seed() -> None:
    """[Note: reentrant blocks]: a ``wrap`` program with an odd model seed has every block outside the checkpoint
    wrapper reentrant, one with an even seed none, and a ``fully_shard`` program none."""
    drawn = _drawn(3, 100, FULLY_SHARD_FEATURES)
    for program in drawn:
        config = program.config
        got = tuple(f"blocks.{i}" for i, block in enumerate(config.model.blocks) if block.reentrant)
        odd_wrap = config.api == "wrap" and config.seed % 2
        want = tuple(f"blocks.{i}" for i in range(len(config.model.blocks))
                     if odd_wrap and f"blocks.{i}" not in config.checkpoint)
        assert got == want, (config, got, want)
    assert any(block.reentrant for p in drawn for block in p.config.model.blocks)


def test_an_adam_draw_trains_with_the_normalising_optimizer_its_seed_names() -> None:
    """[Note: drawn optimizers]: SGD stays SGD; an ``"adam"`` draw is Adam, Adam with amsgrad, RMSprop or
    Adagrad by bits 1 and 2 of the seed, each of them drawn, and the programs are otherwise those a draw of
    plain Adam gives (the same models and operations as before the variants)."""
    drawn = _drawn(3, 100, FULLY_SHARD_FEATURES)
    normalising = ("adam", "amsgrad", "rmsprop", "adagrad")
    for program in drawn:
        config = program.config
        want = "sgd" if config.optimizer == "sgd" else normalising[(config.seed >> 1) % 4]
        assert config.optimizer == want, config
    assert {p.config.optimizer for p in drawn} == set(STATEFUL_OPTIMIZERS)
    assert stateful_optimizer("adam", 0b110) == "adagrad" and stateful_optimizer("sgd", 0b110) == "sgd"
    with pytest.raises(ValueError, match="'lamb'"):
        stateful_optimizer("lamb", 0)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: FullyShardConfig(world_size=2, model=ModelSpec(blocks=(Block(reentrant=True),))),
         r"reentrant blocks \['blocks.0'\] are for wrap programs"),
        (lambda: WrapConfig(world_size=2, model=ModelSpec(blocks=(Block(reentrant=True),)), checkpoint=("blocks.0",)),
         "outside the checkpoint wrapper"),
        (lambda: WrapConfig(world_size=2, wrap=("blocks.3",)), r"WrapConfig.wrap names \['blocks.3'\]"),
        (lambda: FullyShardConfig(world_size=2, checkpoint=("blocks.0.inner",)), "FullyShardConfig.checkpoint names"),
        (lambda: WrapConfig(world_size=2, strategy="HYBRID_SHARD"), "strategy='HYBRID_SHARD'"),
        (lambda: WrapConfig(world_size=2, strategy="ZERO3"), r"WrapConfig.strategy='ZERO3'; expected one of"),
        (lambda: WrapConfig(world_size=0), "world_size must be >= 1, got 0"),
        (lambda: FullyShardConfig(world_size=2, optimizer="lamb"), r"FullyShardConfig.optimizer='lamb'; expected one"),
        (lambda: WrapConfig(world_size=2, dtype="float64", policy=Policy()), "dtype='float64'"),
        (lambda: WrapConfig(world_size=4, policy=Policy()), "give reduce_dtype='float32'"),
        (lambda: WrapConfig(world_size=2, model=ModelSpec(unused=True), frozen=("unused",)), "frozen path must be"),
        (lambda: Forward(batch=3), r"Forward\(batch=3"),
        (lambda: Forward(loss="aux"), "loss='aux'"),
        (lambda: NoSync(batch=-1), r"NoSync\(batch=-1\)"),
        (lambda: Config(world_size=2, api="fsdp3"), "Config.api='fsdp3'"),
        (lambda: FullyShardConfig(world_size=4, reshard_after_forward=4), "proper factor"),
        (lambda: FullyShardConfig(world_size=2, policy=Policy(reduce_dtype="float32", buffer_dtype="bfloat16")),
         "buffer_dtype and keep_low_precision_grads are FSDP1's"),
        (lambda: Program(WrapConfig(world_size=2), (GradSync(),)), r"needs a FullyShardConfig"),
        (lambda: Program(FullyShardConfig(world_size=2), (Reshard(unit="blocks.0"),)), "no sharded module"),
        (lambda: Unshard(batch=3), r"Unshard\(batch=3\)"),
        (lambda: Prefetch(forward=3), r"Prefetch\(forward=3"),
    ],
)
def test_bad_programs_name_the_bad_value(build: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize(("build", "field"), [
    (lambda: FullyShardConfig(world_size=2, strategy="NO_SHARD"), "strategy"),
    (lambda: FullyShardConfig(world_size=2, saves_in_iteration=True), "saves_in_iteration"),
    (lambda: WrapConfig(world_size=2, reshard_after_forward=False), "reshard_after_forward"),
    (lambda: WrapConfig(world_size=2, meta_init=True), "meta_init"),
])
def test_a_field_of_the_other_kind_is_no_field(build: Any, field: str) -> None:
    """Each kind of program has only its own fields: what only the other API has is refused by the type."""
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{field}'"):
        build()


@pytest.mark.parametrize(("api", "kind"), [("wrap", WrapConfig), ("fully_shard", FullyShardConfig)])
def test_the_old_spelling_builds_the_kind_it_names_and_warns(api: str, kind: type) -> None:
    """``Config(..., api=...)``, as reproducers pasted before the two kinds wrote it, builds that kind, warning."""
    with pytest.warns(DeprecationWarning, match=f"Config\\(api='{api}', ...\\) is deprecated: .* {kind.__name__}"):
        built = Config(world_size=2, wrap=("blocks.0",), api=api)
    assert built == kind(world_size=2, wrap=("blocks.0",)) and type(built) is kind
    with pytest.warns(DeprecationWarning):
        assert type(Config(world_size=2)) is WrapConfig


def test_budget_and_skipped_operations() -> None:
    assert [budget(CaseSettings(), ws) for ws in (1, 2, 4)] == [5, 5, 2]
    assert budget(CaseSettings(fuzz_stateful_examples=40), 4) == 40

    class NoStateDicts(ReferenceAdapter):
        capabilities = ReferenceAdapter.capabilities - {Capability.NO_SYNC}
        thread_rank_limits = {Capability.OPTIM_STATE_DICT: "a shared profiler"}

    assert missing_operations(ReferenceAdapter(), RankMode.THREAD) == {}
    assert missing_operations(NoStateDicts(), RankMode.PROCESS) == {"no_sync": "reference lacks capability no_sync"}
    assert missing_operations(NoStateDicts(), RankMode.THREAD)["optimizer save"] == (
        "reference has optim_state_dict on process ranks only: a shared profiler")


def test_a_load_limited_to_process_ranks_is_skipped_on_thread_ranks_only() -> None:
    """``thread_rank_load_limits`` takes the sharded Load off thread ranks; the sharded save stays."""

    class NoShardedLoadOnThreads(ReferenceAdapter):
        thread_rank_load_limits = {Capability.SHARDED_STATE_DICT: "a shared profiler"}

    adapter = NoShardedLoadOnThreads()
    assert missing_operations(adapter, RankMode.PROCESS) == {}
    assert missing_operations(adapter, RankMode.THREAD) == {
        "sharded load": "reference loads sharded_state_dict state dicts on process ranks only: a shared profiler"}


def test_fuzz_alone_verdicts() -> None:
    rows = [{"impl": "m1", "case": "fuzz/stateful_ws1", "outcome": "pass"},
            {"impl": "m1", "case": "fuzz/stateful_ws2", "outcome": "FAIL"},
            {"impl": "m2", "case": "fuzz/stateful_ws1", "outcome": "pass"}]
    assert verdicts(rows, ["m1", "m2", "m3"]) == {
        "m1": "caught by fuzz/stateful_ws2", "m2": "missed: fuzz/stateful_ws1 pass", "m3": "not run (no row)"}


def test_fuzz_alone_counts_nothing_on_a_row_the_reference_fails() -> None:
    """A row the unmutated reference FAILs cannot tell a mutant from it: its FAILs catch nothing."""
    rows = [{"impl": "m1", "case": "fuzz/stateful_ws1", "outcome": "FAIL"},
            {"impl": "m1", "case": "fuzz/stateful_ws2", "outcome": "pass"},
            {"impl": "m2", "case": "fuzz/stateful_ws1", "outcome": "FAIL"},
            {"impl": "m2", "case": "fuzz/stateful_ws2", "outcome": "FAIL"},
            {"impl": "m3", "case": "fuzz/stateful_ws1", "outcome": "FAIL"}]
    assert verdicts(rows, ["m1", "m2", "m3"], frozenset({"fuzz/stateful_ws1"})) == {
        "m1": "missed: fuzz/stateful_ws2 pass", "m2": "caught by fuzz/stateful_ws2",
        "m3": "not measurable: every row fails on the unmutated reference"}
    session = [*rows, {"impl": "reference", "case": "fuzz/stateful_ws1", "outcome": "FAIL", "reason": "r"},
               {"impl": "reference", "case": "fuzz/stateful_ws2", "outcome": "pass", "reason": ""}]
    assert reference_failures(session) == {"fuzz/stateful_ws1": "r"}


def shrink_and_replay(ctx: RankContext, mutant: FSDPAdapter, settings: CaseSettings) -> tuple[Search, list[Any]]:
    """Fuzz ``mutant``, then run the shrunk program again on it and on the reference (module level)."""
    result = stateful_fuzz(ctx, mutant, settings)
    assert result.failing is not None, f"no failure in {result.runs} runs"
    return result, [check_program(ctx, impl, result.failing) for impl in (mutant, ReferenceAdapter())]


def test_a_mismatch_shrinks_to_a_minimal_program() -> None:
    """Against a reference that sums gradients without averaging, the shrunk program is a minimal
    synchronizing backward (a training iteration, ``NoSync``, or a forward and its backward) on the
    simplest config; it fails on the mutant again (in the gradients, or in the parameters a step
    updated with them), passes on the reference, and the pasted case runs in the case module's namespace."""
    results = run(shrink_and_replay, world_size=2, mode="process", timeout_s=240,
                  args=(NoGradDivide(), CaseSettings(fuzz_stateful_examples=20)))
    assert all(r[0] == results[0][0] for r in results), "ranks disagree on the fuzz result"
    result, (again, reference) = results[0]
    # A minimal shape of "one synchronizing backward" on the simplest config, as hypothesis's shrink
    # order reaches it for the current draw: a training iteration, a NoSync, or a forward and its backward.
    minimal = {"(Train(),)", "(NoSync(),)", "(Forward(), Backward())"}
    shrunk = source(result.failing)
    assert shrunk in {f"Program(config=WrapConfig(world_size=2), ops={ops})" for ops in minimal}, shrunk
    assert result.message is not None and ("grads" in result.message or "params" in result.message), result.message
    assert again is not None and reference is None, (again, reference)
    case_text = render_program(result.failing, result.message)
    assert f"run_program(ctx, impl, {shrunk})" in case_text
    exec(compile(case_text, "<reproducer>", "exec"), dict(vars(stateful_cases)))  # its names resolve there


def _fully_shard(**fields: Any) -> Config:
    return FullyShardConfig(world_size=2, wrap=("blocks.0",), **fields)


#: Resharding after forward off for one unit below the root alone; a factor set with a loss pending, another
#: unit's after it.
ONE_UNIT_KEPT = Program(_fully_shard(model=ModelSpec(blocks=(Block(), Block()))),
                        (SetReshardAfterForward(unit="blocks.0"), Forward(grad=False), Train(),
                         GradientDivideFactor(factor=4.0), Forward(), GradientDivideFactor(factor=1.0, unit="blocks.0"),
                         Backward(), Step(), Train()))
#: One program per control of a ``fully_shard``-ed model, and the case row's program of all of them.
CONTROL_PROGRAMS = (
    Program(_fully_shard(), (Unshard(unit="blocks.0", async_op=True), Backward(), Step(), Unshard(batch=1),
                             Backward())),
    Program(_fully_shard(reshard_after_forward=False), (Forward(), Reshard(), Reshard(unit="blocks.0"), Backward(),
                                                        Step(), Reshard(), Forward(), Backward())),
    Program(_fully_shard(), (GradSync(), Forward(), Backward(), Step(), ZeroGrad(), GradSync(on=True),
                             Forward(batch=1), Backward(), Step())),
    Program(_fully_shard(), (ReshardAfterBackward(), Forward(), Backward(), Forward(batch=1), Backward(), Step(),
                             Forward(), Backward(), Save(), Load())),
    Program(_fully_shard(model=ModelSpec(blocks=(example_mod.Block(), example_mod.Block()))),
            (Prefetch(forward=2, backward=2), Forward(), Backward(), Step(), Prefetch(forward=0), Forward(),
             Backward())),
    stateful_cases.CONTROLS_PROGRAM,
    stateful_cases.RESHARD_AFTER_FORWARD_PROGRAM,
    stateful_cases.DIVIDE_FACTOR_PROGRAM,
    ONE_UNIT_KEPT,
)


def check_programs(ctx: RankContext, impl: FSDPAdapter, drawn: tuple[Program, ...]) -> list[str | None]:
    """Each program's verdict on ``impl`` (module level: rank processes import it)."""
    return [check_program(ctx, impl, program) for program in drawn]


@pytest.mark.parametrize(("impl", "mode"), [(ReferenceAdapter(), "process"), (ReferenceAdapter(), "thread"),
                                            (TorchFSDP2Adapter(), "process")], ids=["reference-process",
                                                                                   "reference-thread", "torch-fsdp2"])
def test_every_control_keeps_the_shadows_values(impl: FSDPAdapter, mode: str) -> None:
    """Each control alone, and all of them in one program, pass on the reference and on torch's FSDP2."""
    results = run(check_programs, world_size=2, mode=mode, timeout_s=240, args=(impl, CONTROL_PROGRAMS))
    assert results[0] == [None] * len(CONTROL_PROGRAMS), results[0]


def _trained_with(kind: str, api: type[Config]) -> Program:
    """Saves before the first step, a sharded and a full save each loaded back, with ``kind``: a unit outside
    the loss and (``wrap``, original parameters) a frozen block."""
    model = ModelSpec(unused=True, blocks=(example_mod.Block(), example_mod.Block(("linear", "scale"))))
    config: Config = (WrapConfig(world_size=2, model=model, wrap=("blocks.0", "unused"), optimizer=kind,
                                 use_orig_params=True, frozen=("blocks.1",)) if api is WrapConfig
                      else FullyShardConfig(world_size=2, model=model, wrap=("blocks.0", "unused"), optimizer=kind))
    return Program(config, (Save(), Train(), Save(sharded=True), Train(), Load(), Train(), Save(), ZeroGrad(),
                            Train(), Load(), Train()))


@pytest.mark.parametrize(("impl", "mode", "api"), [(ReferenceAdapter(), "process", WrapConfig),
                                                   (ReferenceAdapter(), "thread", FullyShardConfig),
                                                   (TorchFSDP2Adapter(), "process", FullyShardConfig)],
                         ids=["reference-process", "reference-thread", "torch-fsdp2"])
def test_every_optimizer_keeps_the_shadows_values(impl: FSDPAdapter, mode: str, api: type[Config]) -> None:
    """[Note: drawn optimizers]: each optimizer a program may train with, its state saved before its first step
    and loaded back from sharded and full saves, passes on the reference and on torch's FSDP2."""
    drawn = tuple(_trained_with(kind, api) for kind in STATEFUL_OPTIMIZERS)
    results = run(check_programs, world_size=2, mode=mode, timeout_s=240, args=(impl, drawn))
    assert results[0] == [None] * len(drawn), results[0]


@pytest.mark.parametrize(("mutant", "program", "message"), [
    (IgnoresGradientDivideFactor(), stateful_cases.DIVIDE_FACTOR_PROGRAM,
     r"op 1 \(Train\(batch=0\)\), rank 0: params: params\[head.weight\]"),  # the root's, stepped with them
    (ReshardsAfterForwardAnyway(), stateful_cases.RESHARD_AFTER_FORWARD_PROGRAM,
     r"op 1 \(Train\(batch=0\)\), rank 0: all-gathers in backward: backward issued all-gathers over groups of "
     r"\[2, 2, 2\] ranks, though reshard_after_forward=False keeps"),
    (ReshardsAfterForwardAnyway(), ONE_UNIT_KEPT,
     r"op 2 \(Train\(batch=0\)\), rank 0: all-gathers in backward: backward all-gathered \['blocks.0'\] again"),
], ids=["ignores-gradient-divide-factor", "reshards-after-forward-anyway", "reshards-one-unit-anyway"])
def test_each_setting_is_checked(mutant: FSDPAdapter, program: Program, message: str) -> None:
    """A reference ignoring ``set_gradient_divide_factor`` (dividing by the world size) fails the fixed program
    of ``GradientDivideFactor`` in the root's parameters, stepped with its gradients; one ignoring
    ``set_reshard_after_forward(False)`` (resharding anyway) fails that of ``SetReshardAfterForward``, and a
    program turning it off for one unit alone, at the all-gathers its backward issues (fresh rank processes: a
    mutant's patches stay where it ran)."""
    got = run(check_program, world_size=2, mode="process", timeout_s=120, isolated=True, args=(mutant, program))
    assert got[0] is not None and re.match(message, got[0]), got[0]


def test_divide_factors_drawn_show() -> None:
    """``GradientDivideFactor`` draws twice the world size and 1.0, each other than the mean's divisor there."""
    factors = {op.factor for p in _drawn(5, 150, {"fully_shard", "gradient_divide_factor"}) for op in p.ops
               if isinstance(op, GradientDivideFactor)}
    assert factors == {4.0, 1.0}, factors


class RaisesOnRankOneAfterForward(ReferenceAdapter):
    """The reference, whose root raises on rank 1 alone at the end of each forward, after its collectives."""

    def fully_shard(self, module: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        sharded = super().fully_shard(module, **kwargs)
        if hasattr(module, "blocks"):  # the root
            module.register_forward_hook(_raise_on_rank_one)
        return sharded


def _raise_on_rank_one(_module: torch.nn.Module, _args: Any, _output: Any) -> None:
    if torch.distributed.get_rank() == 1:
        raise RuntimeError("raised on rank 1 alone")


def test_a_rank_that_raises_alone_is_the_verdict_of_every_rank() -> None:
    """An operation that raises on one rank after its collectives: every rank reports it, and no rank runs the
    state check's gathers against its peer's verdict all-gather (which crashed or hung ranks)."""
    program = Program(_fully_shard(), (Forward(grad=False), Train()))
    results = run(check_programs, world_size=2, mode="process", timeout_s=120,
                  args=(RaisesOnRankOneAfterForward(), (program,)))
    want = "op 0 (Forward(batch=0, grad=False, loss='all')), rank 1: raised: RuntimeError: raised on rank 1 alone"
    assert results == [[want], [want]], results


class UnshardWithoutGatherFullPrecision(UnshardWithoutGather):
    """The mutant without mixed precision, so the search is about the controls alone."""

    capabilities = UnshardWithoutGather.capabilities - {Capability.MIXED_PRECISION, Capability.MP_BUFFER_DTYPE}


def fuzz_and_replay(ctx: RankContext, mutant: FSDPAdapter, settings: CaseSettings) -> tuple[Search, str | None]:
    """Fuzz ``mutant``, then run the shrunk program on it again (module level)."""
    result = stateful_fuzz(ctx, mutant, settings)
    assert result.failing is not None, f"no failure in {result.runs} runs"
    return result, check_program(ctx, mutant, result.failing)


@pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]
def test_a_broken_control_is_found_and_shrunk() -> None:
    """Against a reference whose ``unshard()`` gathers nothing, the fuzzer finds a ``fully_shard`` program
    whose ``Unshard`` gives the wrong outputs; it fails on the mutant again and passes on the reference
    (in fresh rank processes: the mutant's patches stay where it ran). Seed 10 finds it within 20 programs and
    shrinks it in 98 runs in all (seeds 0, 2, 3 and 5 take 205, 146, 150 and 159 runs; 4, 6, 7, 8 and 9 find
    nothing in 20)."""
    results = run(fuzz_and_replay, world_size=2, mode="process", timeout_s=300, isolated=True,
                  args=(UnshardWithoutGatherFullPrecision(), CaseSettings(fuzz_stateful_examples=20, fuzz_seed=10)))
    result, again = results[0]
    shrunk = result.failing
    assert shrunk.config.api == "fully_shard" and any(isinstance(op, Unshard) for op in shrunk.ops), source(shrunk)
    assert result.message is not None and "outputs" in result.message, result.message
    assert again is not None
    assert run(check_programs, world_size=2, timeout_s=120, args=(ReferenceAdapter(), (shrunk,)))[0] == [None]
    case_text = render_program(shrunk, result.message)
    assert "Capability.FULLY_SHARD, Capability.FULLY_SHARD_CONTROLS" in case_text, case_text
    exec(compile(case_text, "<reproducer>", "exec"), dict(vars(stateful_cases)))  # its names resolve there


@pytest.mark.parametrize(("mutant", "message"), [
    (FirstGradPieceOnly(), r"op 0 \(Train\(batch=0\)\), rank 0: params: params\[embed.weight\]"),
    (NoNestedBackwardGuard(), r"op 0 \(Train\(batch=0\)\), rank 0: raised: RuntimeError: setStorage"),
], ids=["first-grad-piece-only", "no-nested-backward-guard"])
def test_a_reentrant_block_needs_every_gradient_piece_and_the_parameters_after_it(mutant: Any, message: str) -> None:
    """The smallest program with a reentrant block ([Note: reentrant blocks]) fails on a reference that reduces
    only a unit's first gradient piece, and on one that reshards after a nested backward's piece (fresh rank
    processes: a mutant's patches stay where it ran); the reference passes it in both rank modes."""
    program = Program(WrapConfig(world_size=2, model=ModelSpec(vocab=7, blocks=(Block(), Block(reentrant=True)))),
                      (Train(),))
    got = run(check_program, world_size=2, mode="process", timeout_s=120, isolated=True, args=(mutant, program))
    assert got[0] is not None and re.match(message, got[0]), got
    for mode in ("thread", "process"):
        assert run(check_program, world_size=2, mode=mode, timeout_s=120,
                   args=(ReferenceAdapter(), program)) == [None, None]


def _unit(fqn: str, grads: list[Any]) -> UnitInfo:
    return UnitInfo(fqn=fqn, module=torch.nn.Module(), shard_group=None, replicate_group=None, compute_device=None,
                    local_shards=[torch.zeros(1) for _ in grads], local_grads=grads, resharded=None)


def test_a_whole_unit_outside_the_loss_must_show_no_gradient() -> None:
    """Only whole units are judged: zeros within a used unit are a flat parameter's right, a wholly unused one's not.
    The full gradients are what the user sees where exposed, else the unit's local ones."""
    local = torch.nn.ModuleDict({"used": torch.nn.Linear(2, 2), "unused": torch.nn.Linear(2, 2)})
    local["used"].weight.grad = torch.ones(2, 2)  # its bias has none: zeros there are fine
    zero = torch.zeros(3)
    units = [_unit("", [None]), _unit("used", [zero]), _unit("unused", [None])]
    assert_no_grads_outside_the_loss(units, None, local)
    with pytest.raises(AssertionError, match=r"unit 'unused' took no part in a loss .* \[True\]: a zero gradient"):
        assert_no_grads_outside_the_loss([_unit("used", [zero]), _unit("unused", [zero])], None, local)
    wrapped = "unused._checkpoint_wrapped_module"  # the activation-checkpoint wrapper's name is left out
    with pytest.raises(AssertionError, match=r"unit 'unused' took no part"):
        assert_no_grads_outside_the_loss([_unit(wrapped, [zero])], None, local)
    full: dict[str, torch.Tensor | None] = {"used.weight": zero, "used.bias": zero, "unused.weight": None,
                                            "unused.bias": None}
    assert_no_grads_outside_the_loss([_unit("unused", [zero])], full, local)  # the user's view decides
    with pytest.raises(AssertionError, match=r"unit 'unused' .* shows gradients \[False, True\]"):
        assert_no_grads_outside_the_loss([_unit("unused", [None])], {**full, "unused.bias": zero}, local)


def test_only_modules_without_gradients_outside_units_are_ignorable() -> None:
    """Frozen modules and the unused block, outermost, with no unit or checkpoint wrapper in or above them."""
    model = ModelSpec(blocks=(Block(inner=("linear",)), Block()), unused=True)
    frozen = ("blocks.0", "blocks.0.inner", "blocks.1")
    assert WrapConfig(2, model, use_orig_params=True, frozen=frozen).ignorable() == ("blocks.0", "blocks.1", "unused")
    assert WrapConfig(2, model, wrap=("blocks.0.inner",), use_orig_params=True, frozen=frozen,
                  checkpoint=("blocks.1",)).ignorable() == ("unused",)
    with pytest.raises(ValueError, match=r"Config\(ignored=\('blocks.1',\)\) needs no policy and paths among "
                                         r"\('unused',\)"):
        WrapConfig(2, model, wrap=("blocks.1",), ignored=("blocks.1",))


def test_an_ignored_module_that_lost_its_parameters_is_reported() -> None:
    local = torch.nn.Sequential(torch.nn.Linear(2, 2))
    kept = torch.nn.Linear(2, 2)
    kept.load_state_dict(local[0].state_dict())
    assert_ignored_kept({"0": kept}, local)
    flat = torch.nn.Linear(2, 2)
    del flat.weight  # as flattening into a unit leaves it
    with pytest.raises(AssertionError, match=r"ignored module '0' holds parameters \{'bias': \(2,\)\}, the shadow's "
                                             r"\{'weight': \(2, 2\), 'bias': \(2,\)\}"):
        assert_ignored_kept({"0": flat}, local)


_TIED = ModelSpec(vocab=5, tie_head=True, blocks=(Block(("linear", "scale")), Block(("linear", "linear"), tie=True)))
_META = Program(FullyShardConfig(world_size=2, model=_TIED, wrap=("blocks.0", "blocks.1"), meta_init=True,
                       checkpoint=("blocks.1",)), (Train(), Save(), Train(), Load(), Train()))


@pytest.mark.parametrize("impl", [ReferenceAdapter(), TorchFSDP2Adapter(), MetaInitNotFollowed()],
                         ids=["reference", "torch-fsdp2", "mutant-meta-init-not-followed"])
def test_a_model_built_on_meta_trains_as_the_shadow(impl: FSDPAdapter) -> None:
    """Tied weights, buffers and a checkpointed unit, built on meta, sharded, materialized and filled: torch's
    FSDP2 and the reference train it as the shadow; a reference that does not follow ``to_empty`` fails."""
    got = run(check_programs, world_size=2, mode="process", timeout_s=240, isolated=True, args=(impl, (_META,)))[0][0]
    if isinstance(impl, MetaInitNotFollowed):
        assert got is not None and got.startswith("op 0 (Train(batch=0))"), got
    else:
        assert got is None, got


_SHARDED_LOW = Program(FullyShardConfig(world_size=2, model=ModelSpec(blocks=(Block(), Block(("linear", "scale")))),
                              wrap=("blocks.0",), policy=Policy(reduce_dtype="float32")),
                       (Train(), GradSync(on=False), Train(), GradSync(on=True), Train(), Save(), Train(), Load(),
                        Train()))


@pytest.mark.parametrize("impl", [ReferenceAdapter(), TorchFSDP2Adapter(), GradSyncKeepsGradInParamDtype()],
                         ids=["reference", "torch-fsdp2", "mutant-grad-sync-keeps-grad-in-param-dtype"])
def test_a_sharded_model_under_fsdp2s_policy_trains_as_the_shadow(impl: FSDPAdapter) -> None:
    """A ``fully_shard`` program with a policy (bfloat16 compute, float32 reduction), gradient sync off and on
    between iterations: torch's FSDP2 and the reference train it as the shadow; a reference keeping the unsynced
    sums in the param dtype passes the program (the dtype moves them under the tolerance) and fails its
    neighbour, which makes the sums show."""
    got = run(check_program, world_size=2, mode="process", timeout_s=240, isolated=True, args=(impl, _SHARDED_LOW))
    assert all(text == got[0] for text in got), got
    if isinstance(impl, GradSyncKeepsGradInParamDtype):
        assert got[0] is not None and got[0].startswith("after its operations, rank 0: neighbour (unsynced sums)"), \
            got[0]
        assert "each rank's sum kept in float32 (FSDP2's MixedPrecisionPolicy" in got[0], got[0]
    else:
        assert got[0] is None, got[0]


_ONE_RANK = Program(WrapConfig(world_size=1, model=ModelSpec(blocks=(Block(), Block())), wrap=("blocks.0",)),
                    (Train(),))


@pytest.mark.parametrize("impl", [ReferenceAdapter(), Silent()], ids=["reference", "mutant-silent"])
def test_wrapping_on_one_rank_warns_of_the_switch_where_declared(impl: FSDPAdapter) -> None:
    """``Capability.WORLD_SIZE_1_SWITCH``: a ``wrap`` program at world size 1 must see the NO_SHARD warning."""
    got = run(check_programs, world_size=1, mode="process", timeout_s=120, isolated=True, args=(impl, (_ONE_RANK,)))
    if isinstance(impl, Silent):
        assert got[0][0] is not None and "did not warn 'FSDP is switching to use `NO_SHARD`" in got[0][0], got[0]
    else:
        assert got[0] == [None]


def test_float64_is_drawn_only_where_the_adapter_takes_it() -> None:
    """An adapter whose ``param_dtypes`` leaves out float64 gets a float32 program where another would get a
    float64 one, of the same model."""
    both, without = _drawn(3, 100, ops_mod.FEATURES), _drawn(3, 100, ops_mod.FEATURES - {"float64"})
    assert any(p.config.dtype == "float64" for p in both)
    assert all(p.config.dtype == "float32" for p in without)
    assert [p.config.model for p in both] == [p.config.model for p in without]


def test_scaling_each_parameter_once_survives_freed_parameters() -> None:
    """``ScaleParams`` on a wrapped model scales what each unit summons, parameters that are new objects each
    summon and freed at its end; a freed parameter's ``id`` given to the next must not make that one look scaled
    (torch-fsdp1's ``NO_SHARD`` programs failed at random on it)."""
    scale_own = full_value_ops._scaling_own_params(2.0)
    for _ in range(20):
        module = nn.Linear(2, 2)  # the last one's parameters are freed here
        before = module.weight.detach().clone()
        scale_own(module)
        assert torch.equal(module.weight.detach(), before * 2)
    tied = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    tied[1].weight = tied[0].weight
    before = tied[0].weight.detach().clone()
    tied.apply(full_value_ops._scaling_own_params(2.0))
    assert torch.equal(tied[1].weight.detach(), before * 2)  # once, not squared
