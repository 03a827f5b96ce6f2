"""Known, investigated disagreements between an implementation and a case.

A known finding never changes an outcome: the case still reports FAIL. The
matrix reason points at the write-up (minimal repro, exact output, why the
case is right) so a reader does not have to rediscover it.
"""

from __future__ import annotations

from conformance.rows import row_matches

__all__ = ["KNOWN", "annotate"]

#: (implementation, row pattern as :func:`conformance.rows.row_matches` reads it) -> write-up,
#: relative to the repository root.
KNOWN: dict[tuple[str, str], str] = {
    ("torch-fsdp1", "misc/same_model_across_ranks"): "docs/findings/fsdp1-sync-module-states-cpu.md",
    ("torch-fsdp1", "misc/cpu_init_with_sync_module_states_cpu"): "docs/findings/fsdp1-sync-module-states-cpu.md",
    ("torch-fsdp1", "overlap/training_overlap"): "docs/findings/overlap-cpu-torch.md",
    ("torch-fsdp2", "overlap/training_overlap"): "docs/findings/overlap-cpu-torch.md",
    ("torch-fsdp1", "hybrid_shard/basic_setup"): "docs/findings/fsdp1-hybrid-cpu.md",
    ("torch-fsdp1", "hybrid_shard/sync_module_states"): "docs/findings/fsdp1-sync-module-states-cpu.md",
    ("torch-fsdp1", "checkpoint/*"): "docs/findings/fsdp1-cpu-offload-pinning.md",
    ("torch-fsdp1", "misc/device_id_cpu_offload"): "docs/findings/fsdp1-cpu-offload-pinning.md",
    ("torch-fsdp1", "grad_accumulation/accumulate[cpu_offload=True]"): "docs/findings/fsdp1-cpu-offload-pinning.md",
    ("torch-fsdp1", "uneven_shared/train[tie=across_units]"): "docs/findings/tied-weights-across-units.md",
    ("torch-fsdp2", "uneven_shared/train[tie=across_units]"): "docs/findings/tied-weights-across-units.md",
    ("torch-fsdp1", "state_dict/roundtrip[kind=FULL]"): "docs/findings/fsdp1-full-optim-state-orig-params.md",
    ("torch-fsdp1", "state_dict/cross_impl"): "docs/findings/fsdp1-full-optim-state-orig-params.md",
    ("torch-fsdp1", "mixed_precision/keep_low_precision_grads[strategy=FULL_SHARD]"):
        "docs/findings/fsdp1-keep-low-precision-grads.md",
    ("torch-fsdp1", "fuzz/repro_8fc450e8"): "docs/findings/fsdp1-no-shard-unused-unit-params.md",
}


def annotate(impl: str, case: str, reason: str) -> str:
    """``reason``, prefixed with the finding's write-up when this failure is a known one."""
    for (name, pattern), doc in KNOWN.items():
        if name == impl and row_matches(case, pattern):
            return f"known finding, see {doc}: {reason}"
    return reason
