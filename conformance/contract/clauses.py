"""The contract clauses a case asserts: this suite's stated semantics (``docs/CONTRACT.md``), or a
citation of the implementation's own documentation.

Every case names what it checks with ``@case(..., clause=...)``: a clause id of ``docs/CONTRACT.md``
(``"C2"``) or a :class:`DocCitation` (document, section, torch version) of a promise the implementation
documents itself. An unknown clause id fails the declaration. :data:`CLAUSES` holds each clause's
title and where torch documents the corresponding promise; ``conformance/tests/contract/test_clauses.py``
checks that it agrees with the headings of ``docs/CONTRACT.md``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["CLAUSES", "TORCH_VERSION", "Clause", "ClauseRef", "DocCitation", "clause_refs", "describe"]

#: The torch version whose documentation the citations quote.
TORCH_VERSION = "2.13"

_CLAUSE_ID = re.compile(r"^C[0-9]+$")


@dataclass(frozen=True)
class Clause:
    """One numbered clause of ``docs/CONTRACT.md``: its id, title and torch's corresponding promise."""

    id: str
    title: str
    #: Where torch documents the corresponding promise (API docstring names); ``""`` where it does not.
    torch_doc: str = ""

    def text(self) -> str:
        cited = (f"torch {TORCH_VERSION} documents it in: {self.torch_doc}" if self.torch_doc
                 else f"torch {TORCH_VERSION} documents no such promise: the suite's own semantics")
        return f"{self.id} {self.title} (docs/CONTRACT.md, {self.id})\n  {cited}"


@dataclass(frozen=True)
class DocCitation:
    """A behaviour the implementation's own documentation promises: document, section, torch version."""

    document: str
    section: str
    torch_version: str = TORCH_VERSION

    def __post_init__(self) -> None:
        if not (self.document.strip() and self.section.strip() and self.torch_version.strip()):
            raise ValueError(f"a documentation citation needs a document, a section and a torch version: {self!r}")

    def text(self) -> str:
        return (f"the implementation's documentation: {self.document}, {self.section}\n"
                f"  (torch {self.torch_version})")


ClauseRef = str | DocCitation

CLAUSES: dict[str, Clause] = {c.id: c for c in (
    Clause("C1", "Training equals DDP's", "torch.nn.parallel.DistributedDataParallel; "
           "torch.distributed.fsdp.FullyShardedDataParallel"),
    Clause("C2", "The gradient contract", "torch.nn.parallel.DistributedDataParallel"),
    Clause("C3", "Gradient accumulation", "FullyShardedDataParallel.no_sync; FSDPModule.set_requires_gradient_sync"),
    Clause("C4", "A state dict round trip preserves training",
           "FullyShardedDataParallel.state_dict_type; FullyShardedDataParallel.optim_state_dict"),
    Clause("C5", "A checkpoint loads across world sizes and implementations",
           "torch.distributed.checkpoint.state_dict.get_state_dict; set_state_dict"),
    Clause("C6", "Every rank starts from the same model", "FullyShardedDataParallel (sync_module_states)"),
    Clause("C7", "Misuse is refused or warned about when it happens",
           "FullyShardedDataParallel (use_orig_params); torch.distributed.fsdp.fully_shard"),
    Clause("C8", "Ranks issue collectives in the same order, or are told they do not"),
    Clause("C9", "Sharding bounds a rank's peak memory", "torch.distributed.fsdp.fully_shard"),
    Clause("C10", "A dropped model is freed"),
    Clause("C11", "Resharding and prefetching issue the documented all-gathers",
           "torch.distributed.fsdp.fully_shard (reshard_after_forward); FSDPModule.set_modules_to_forward_prefetch; "
           "FSDPModule.reshard; FSDPModule.unshard"),
    Clause("C12", "Communication overlaps computation",
           "FullyShardedDataParallel (forward_prefetch, limit_all_gathers)"),
    Clause("C13", "Mixed precision computes, communicates and keeps the documented dtypes",
           "torch.distributed.fsdp.MixedPrecision; torch.distributed.fsdp.MixedPrecisionPolicy"),
    Clause("C14", "Parameters live on the documented device",
           "FullyShardedDataParallel (device_id, cpu_offload, ignored_modules); torch.distributed.fsdp.CPUOffload"),
    Clause("C15", "Hybrid sharding shards within a group and replicates across groups",
           "FullyShardedDataParallel (process_group); torch.distributed.fsdp.ShardingStrategy"),
    Clause("C16", "A meta-device model materializes like one built on the device",
           "FullyShardedDataParallel (param_init_fn); torch.distributed.fsdp.fully_shard"),
    Clause("C17", "Activation checkpointing and offloading compose with units",
           "torch.utils.checkpoint.checkpoint"),
    Clause("C18", "Frozen, ignored and shared parameters keep their meaning",
           "FullyShardedDataParallel (ignored_states); torch.distributed.fsdp.fully_shard (ignored_params)"),
    Clause("C19", "Gradient clipping spans every rank's shards",
           "FullyShardedDataParallel.clip_grad_norm_; torch.nn.utils.clip_grad_norm_"),
    Clause("C20", "A unit's outputs may be used as the caller pleases"),
    Clause("C21", "A module's own attribute assignment runs unless the user opts out"),
    Clause("C22", "A performance option changes no value",
           "torch.distributed.fsdp.BackwardPrefetch; FullyShardedDataParallel (forward_prefetch, limit_all_gathers); "
           "FSDPModule.set_separate_reduce_scatter_group, set_force_sum_reduction_for_comms"),
)}


def clause_refs(case_id: str, refs: ClauseRef | Iterable[ClauseRef] | None) -> tuple[ClauseRef, ...]:
    """``refs`` as a tuple, each checked: a known clause id or a :class:`DocCitation`; ValueError otherwise."""
    if refs is None:
        return ()
    out = (refs,) if isinstance(refs, (str, DocCitation)) else tuple(refs)
    for ref in out:
        if isinstance(ref, DocCitation):
            continue
        if not isinstance(ref, str) or not _CLAUSE_ID.match(ref):
            raise ValueError(f"case {case_id}: clause {ref!r} is neither a clause id (C<n>) nor a DocCitation")
        if ref not in CLAUSES:
            raise ValueError(f"case {case_id}: clause {ref!r} is not in docs/CONTRACT.md "
                             f"(known: {', '.join(CLAUSES)})")
    return out


def describe(ref: ClauseRef) -> str:
    """The clause ``ref`` as ``list --explain`` shows it: id, title and where torch documents it (a second
    line), or the implementation's documentation it cites."""
    return ref.text() if isinstance(ref, DocCitation) else CLAUSES[ref].text()
