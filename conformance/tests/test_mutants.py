"""Every case fails against a reference with the behaviour it checks broken.

Each mutant (``conformance/mutants/``) runs in its own pytest session, since
it patches the reference in-process. The expectation table says which cases a
mutant must turn into FAIL; a case that still passes is not testing what it
claims.

Placement mutants are only visible on GPU rows: on a CPU-only machine the CPU is
both where ``device_id`` points and where a module falls back to, so the CPU
variants of the device rows (``device_id_auto_wrap``, ``device_id_cpu_offload``,
``ignored_params_not_moved``) cannot tell a correct placement from a broken one.
Those expectations declare the GPUs they need and skip here with the reason;
the nightly GPU job runs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conformance.case import accelerator_skip_reason
from conformance.cli import CASES_DIR
from conformance.mutants import MUTANTS
from conformance.rows import parse_row_id, row_matches


@dataclass(frozen=True)
class Expect:
    """Run the cases selected by ``keyword`` against one mutant.

    Every row a ``must_fail`` pattern matches (:func:`conformance.rows.row_matches`) must FAIL.
    """

    keyword: str
    rank_mode: str
    must_fail: tuple[str, ...]
    accelerators: int = 0

    def __post_init__(self) -> None:
        if self.rank_mode not in ("thread", "process"):
            raise ValueError(f"rank_mode must be thread or process, got {self.rank_mode!r}")
        if not self.must_fail:
            raise ValueError(f"{self.keyword!r}: must_fail names no case")


EXPECTED: dict[str, Expect] = {
    "mutant-no-exec-order-check": Expect(
        "invalid_first_iter_order or invalid_later_iter_order", "thread",
        ("exec_order/invalid_first_iter_order", "exec_order/invalid_later_iter_order"),
    ),
    # Adam is invariant to a uniform gradient scale, so the DDP-parity case cannot see
    # a missing divide; the SGD-based unused-outputs case does.
    "mutant-no-grad-divide": Expect(
        "not_all_outputs_used_in_loss", "thread", ("misc/not_all_outputs_used_in_loss",),
    ),
    "mutant-wrong-replicate-group": Expect(
        "HYBRID and (cpu_training_parity_vs_ddp or basic_setup or parity_with_fsdp)", "thread",
        ("misc/cpu_training_parity_vs_ddp[strategy=HYBRID_SHARD]",
         "misc/cpu_training_parity_vs_ddp[strategy=_HYBRID_SHARD_ZERO2]",
         "hybrid_shard/basic_setup", "hybrid_shard/parity_with_fsdp"),
    ),
    "mutant-checks-eval-forwards": Expect("train_eval", "thread", ("exec_order/train_eval",)),
    "mutant-silent": Expect(
        "unsupported_container_warning or world_size_1_no_shard_warning", "thread",
        ("misc/unsupported_container_warning", "misc/world_size_1_no_shard_warning[strategy=FULL_SHARD]",
         "misc/world_size_1_no_shard_warning[strategy=SHARD_GRAD_OP]",
         "misc/world_size_1_no_shard_warning[strategy=None]"),
    ),
    "mutant-lenient-hybrid-groups": Expect(
        "manual_wrap_requires_pg or invalid_pg_specification", "thread",
        ("hybrid_shard/manual_wrap_requires_pg", "hybrid_shard/invalid_pg_specification"),
    ),
    "mutant-no-homogeneity-check": Expect("homogeneous_attributes", "thread", ("misc/homogeneous_attributes",)),
    "mutant-unsafe-setattr-ignored": Expect(
        "unsafe_setattr", "thread", ("misc/unsafe_setattr[env_value=1]",),
    ),
    "mutant-hooks-on-plain-outputs-only": Expect("namedtuple_outputs", "thread", ("misc/namedtuple_outputs",)),
    "mutant-sharded-load-ignored": Expect(
        "sharded_state_dict_roundtrip", "thread", ("hybrid_shard/sharded_state_dict_roundtrip",),
    ),
    "mutant-no-optim-in-backward-check": Expect(
        "optim_in_backward_requires_orig_params", "thread", ("misc/optim_in_backward_requires_orig_params",),
    ),
    "mutant-zero-grad-for-unused": Expect("module_no_compute_grad", "thread", ("misc/module_no_compute_grad",)),
    # The timing case's negative control: the same model without prefetch exceeds the bound.
    "mutant-no-prefetch": Expect("training_overlap", "process", ("overlap/training_overlap",)),
    # ... and the control itself fails for an implementation that prefetches when told not to.
    "mutant-always-prefetch": Expect("no_overlap_detected", "process", ("overlap/no_overlap_detected",)),
    # Recomputation runs a unit's forward inside backward: caught where units were freed
    # after forward (nested under a root) and the wrapper recomputes (checkpoint, not
    # offload: offload_activations=False).
    "mutant-no-regather-for-recompute": Expect(
        "basic_checkpoint_end_to_end or checkpoint_fsdp_wrapping", "thread",
        ("checkpoint/basic_checkpoint_end_to_end",
         "checkpoint/checkpoint_fsdp_wrapping[nesting=under_root,offload_activations=False]"),
    ),
    "mutant-no-reshard-after-backward": Expect(
        "not_all_outputs_used_in_loss", "thread", ("misc/not_all_outputs_used_in_loss",),
    ),
    "mutant-no-sync-module-states": Expect(
        "same_model_across_ranks or sync_module_states", "thread",
        ("misc/same_model_across_ranks", "misc/cpu_init_with_sync_module_states_cpu",
         "hybrid_shard/sync_module_states"),
    ),
    # A reentrant checkpoint's nested backward hands a unit its gradient in pieces.
    "mutant-first-grad-piece-only": Expect(
        "checkpoint_submodule", "thread", ("checkpoint/checkpoint_submodule[use_reentrant=True]",),
    ),
    "mutant-no-nested-backward-guard": Expect(
        "checkpoint_submodule", "thread", ("checkpoint/checkpoint_submodule[use_reentrant=True]",),
    ),
    "mutant-ignored-modules-managed": Expect(
        "ignored_module_meta or ignored_params_not_moved", "thread",
        ("misc/ignored_module_meta", "misc/ignored_params_not_moved"),
    ),
    "mutant-assumes-parameters": Expect("no_params", "thread", ("misc/no_params",)),
    # device_id_auto_wrap's CPU rows cannot see placement, but they do check that every
    # nested layer became a unit (the GPU rows check that device_id reached each one).
    "mutant-auto-wrap-children-only": Expect(
        "device_id_auto_wrap", "thread", ("misc/device_id_auto_wrap",),
    ),
    "mutant-offloaded-grads-dropped": Expect(
        "device_id_cpu_offload", "thread", ("misc/device_id_cpu_offload",),
    ),
    # -- placement: GPU rows only (see the module docstring) --
    "mutant-device-id-ignored": Expect(
        "device_id or cpu_gpu_module or cpu_init_with_sync_module_states", "process",
        ("misc/device_id", "misc/device_id_auto_wrap_gpu", "misc/cpu_gpu_module",
         "misc/cpu_init_with_sync_module_states", "misc/module_device_mismatches_device_id[has_params=True]",
         "misc/module_device_mismatches_device_id[has_params=False]"),
        accelerators=2,
    ),
    "mutant-device-id-not-propagated": Expect(
        "device_id_auto_wrap_gpu", "process", ("misc/device_id_auto_wrap_gpu",), accelerators=2,
    ),
    "mutant-offload-dropped-with-device-id": Expect(
        "device_id_cpu_offload_gpu", "process", ("misc/device_id_cpu_offload_gpu",), accelerators=2,
    ),
    "mutant-moves-cpu-module-silently": Expect(
        "cpu_init_stays_on_cpu or training_device_mismatch", "process",
        ("misc/cpu_init_stays_on_cpu", "misc/training_device_mismatch"), accelerators=2,
    ),
    "mutant-ignored-modules-moved": Expect(
        "ignored_params_not_moved_gpu", "process", ("misc/ignored_params_not_moved_gpu",), accelerators=2,
    ),
    # Only torch-fsdp2 has a post-optimizer event; this mutant derives from its adapter.
    "mutant-fsdp2-post-optim-event-ignored": Expect(
        "post_optim_event_overlap", "process", ("overlap/post_optim_event_overlap",), accelerators=2,
    ),
    "mutant-consolidates-devices": Expect(
        "multigpu_module or cpu_gpu_module", "process", ("misc/multigpu_module", "misc/cpu_gpu_module"),
        accelerators=2,
    ),
}


def _run(mutant: str, expect: Expect, tmp_path: Path) -> list[dict]:
    report = tmp_path / f"{mutant}.json"
    env = {**os.environ, "FSDP_CONFORMANCE_ADAPTERS": ",".join(
        f"{name}=conformance.mutants:{cls.__name__}" for name, cls in MUTANTS.items())}
    cmd = [sys.executable, "-m", "pytest", str(CASES_DIR), "-q", "-p", "no:cacheprovider",
           "--fsdp-impl", mutant, "--rank-mode", expect.rank_mode, "-k", expect.keyword,
           "--conformance-json", str(report)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(report.read_text())


@pytest.mark.parametrize(
    "mutant",
    [pytest.param(name, marks=[pytest.mark.gpu] if EXPECTED[name].accelerators else []) for name in sorted(EXPECTED)],
)
def test_mutant_is_caught(mutant: str, tmp_path: Path) -> None:
    expect = EXPECTED[mutant]
    hardware = accelerator_skip_reason(expect.accelerators)
    if hardware is not None:
        pytest.skip(hardware)
    rows = _run(mutant, expect, tmp_path)
    unmatched = [p for p in expect.must_fail if not any(row_matches(r["case"], p) for r in rows)]
    assert not unmatched, f"no case matched {unmatched}; the expectation table is stale"
    selected = [r for r in rows if any(row_matches(r["case"], p) for p in expect.must_fail)]
    missed = [f"{r['case']} ({r['outcome']})" for r in selected if r["outcome"] != "FAIL"]
    assert not missed, f"{mutant} ({MUTANTS[mutant].breaks}) was not caught by: {missed}"


def test_every_mutant_has_an_expectation() -> None:
    assert set(EXPECTED) == set(MUTANTS)


def _declared_cases() -> dict[str, int]:
    """Every declared case id -> the accelerators it needs."""
    import importlib

    cases = {}
    for path in sorted(CASES_DIR.glob("test_*.py")):
        module = importlib.import_module(f"conformance.cases.{path.stem}")
        for fn in vars(module).values():
            for mark in getattr(fn, "pytestmark", ()):
                if mark.name == "conformance":
                    cases[mark.args[0].id] = mark.args[0].accelerators
    return cases


def test_expectations_name_declared_cases() -> None:
    """Expectations that skip here (GPU) still have to name real cases, checked without running them."""
    ids = set(_declared_cases())
    assert "misc/device_id_auto_wrap_gpu" in ids, sorted(ids)
    stale = [(mutant, prefix) for mutant, expect in EXPECTED.items() for prefix in expect.must_fail
             if parse_row_id(prefix)[0] not in ids]
    assert not stale, f"expectations naming no declared case: {stale}"


def test_every_case_has_a_mutant() -> None:
    """Each case is caught by some mutant; a case that runs on CPU by one that runs on CPU."""
    covered: dict[str, set[int]] = {}
    for expect in EXPECTED.values():
        for pattern in expect.must_fail:
            covered.setdefault(parse_row_id(pattern)[0], set()).add(expect.accelerators)
    cases = _declared_cases()
    uncaught = sorted(case for case in cases if case not in covered)
    assert not uncaught, f"cases no mutant is expected to fail: {uncaught}"
    cpu_only_by_gpu = sorted(case for case, gpus in cases.items() if gpus == 0 and 0 not in covered[case])
    assert not cpu_only_by_gpu, f"CPU cases whose only mutants need a GPU: {cpu_only_by_gpu}"
