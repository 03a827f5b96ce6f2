"""Every case fails against a reference with the behaviour it checks broken.

Each mutant (``conformance/mutants.py``) runs in its own pytest session, since
it patches the reference in-process. The expectation table says which cases a
mutant must turn into FAIL; a case that still passes is not testing what it
claims.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.cli import CASES_DIR
from conformance.mutants import MUTANTS

#: mutant -> (pytest -k selection, rank mode, case-id prefixes that must all FAIL)
EXPECTED: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "mutant-no-exec-order-check": (
        "invalid_first_iter_order or invalid_later_iter_order", "thread",
        ("exec_order/invalid_first_iter_order", "exec_order/invalid_later_iter_order"),
    ),
    # Adam is invariant to a uniform gradient scale, so the DDP-parity case cannot see
    # a missing divide; the SGD-based unused-outputs case does.
    "mutant-no-grad-divide": (
        "not_all_outputs_used_in_loss", "thread", ("misc/not_all_outputs_used_in_loss",),
    ),
    "mutant-wrong-replicate-group": (
        "HYBRID and (cpu_training_parity_vs_ddp or basic_setup or parity_with_fsdp)", "thread",
        ("misc/cpu_training_parity_vs_ddp[HYBRID_SHARD]", "misc/cpu_training_parity_vs_ddp[_HYBRID_SHARD_ZERO2]",
         "hybrid_shard/basic_setup", "hybrid_shard/parity_with_fsdp"),
    ),
    "mutant-checks-eval-forwards": ("train_eval", "thread", ("exec_order/train_eval",)),
    "mutant-silent": (
        "unsupported_container_warning or world_size_1_no_shard_warning", "thread",
        ("misc/unsupported_container_warning", "misc/world_size_1_no_shard_warning[FULL_SHARD",
         "misc/world_size_1_no_shard_warning[SHARD_GRAD_OP", "misc/world_size_1_no_shard_warning[None"),
    ),
    "mutant-lenient-hybrid-groups": (
        "manual_wrap_requires_pg or invalid_pg_specification", "thread",
        ("hybrid_shard/manual_wrap_requires_pg", "hybrid_shard/invalid_pg_specification"),
    ),
    "mutant-no-homogeneity-check": ("homogeneous_attributes", "thread", ("misc/homogeneous_attributes",)),
    "mutant-unsafe-setattr-ignored": (
        "unsafe_setattr", "thread", ("misc/unsafe_setattr[False-1]", "misc/unsafe_setattr[True-1]"),
    ),
    "mutant-hooks-on-plain-outputs-only": ("namedtuple_outputs", "thread", ("misc/namedtuple_outputs",)),
    "mutant-sharded-load-ignored": (
        "sharded_state_dict_roundtrip", "process", ("hybrid_shard/sharded_state_dict_roundtrip",),
    ),
    "mutant-no-optim-in-backward-check": (
        "optim_in_backward_requires_orig_params", "thread", ("misc/optim_in_backward_requires_orig_params",),
    ),
    "mutant-zero-grad-for-unused": ("module_no_compute_grad", "thread", ("misc/module_no_compute_grad",)),
    # The timing case's negative control: the same model without prefetch exceeds the bound.
    "mutant-no-prefetch": ("training_overlap", "process", ("overlap/training_overlap",)),
    "mutant-no-regather-for-recompute": (
        "basic_checkpoint_end_to_end", "thread", ("checkpoint/basic_checkpoint_end_to_end",),
    ),
    "mutant-no-reshard-after-backward": (
        "not_all_outputs_used_in_loss", "thread", ("misc/not_all_outputs_used_in_loss",),
    ),
    "mutant-no-sync-module-states": (
        "same_model_across_ranks or sync_module_states", "thread",
        ("misc/same_model_across_ranks", "misc/cpu_init_with_sync_module_states_cpu",
         "hybrid_shard/sync_module_states"),
    ),
}


def _run(mutant: str, keyword: str, rank_mode: str, tmp_path: Path) -> list[dict]:
    report = tmp_path / f"{mutant}.json"
    env = {**os.environ, "FSDP_CONFORMANCE_ADAPTERS": ",".join(
        f"{name}=conformance.mutants:{cls.__name__}" for name, cls in MUTANTS.items())}
    cmd = [sys.executable, "-m", "pytest", str(CASES_DIR), "-q", "-p", "no:cacheprovider",
           "--fsdp-impl", mutant, "--rank-mode", rank_mode, "-k", keyword, "--conformance-json", str(report)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(report.read_text())


@pytest.mark.parametrize("mutant", sorted(EXPECTED))
def test_mutant_is_caught(mutant: str, tmp_path: Path) -> None:
    keyword, rank_mode, must_fail = EXPECTED[mutant]
    rows = _run(mutant, keyword, rank_mode, tmp_path)
    selected = [r for r in rows if r["case"].startswith(must_fail)]
    assert selected, f"no case matched {must_fail}; the expectation table is stale"
    missed = [f"{r['case']} ({r['outcome']})" for r in selected if r["outcome"] != "FAIL"]
    assert not missed, f"{mutant} ({MUTANTS[mutant].breaks}) was not caught by: {missed}"


def test_every_mutant_has_an_expectation() -> None:
    assert set(EXPECTED) == set(MUTANTS)
