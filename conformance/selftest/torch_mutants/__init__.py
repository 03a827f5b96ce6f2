"""Mutants of torch's own FSDP sources: how many generated bugs the suite's rows notice.

[Note: torch mutants]
The mutants of ``conformance/selftest/mutants/`` are hand-written breakages of
the behaviours the cases claim to check. These are generated: small AST edits
(a flipped comparison, a deleted ``x.wait()``, ``return None``, ...) of torch's
installed FSDP sources (``torch.distributed.fsdp._fully_shard`` for
``torch-fsdp2``; the flat parameter, runtime, state dict and optimizer state
code for ``torch-fsdp1``), a seeded sample of them run against the rows one by
one. A campaign, nightly and by hand (never in CI: each mutant is a run of the
rows), reports each mutant killed, survived, timed out, not reached or
import-broken (docs/TESTING.md: Mutants of torch's FSDP).

One concept per module: :mod:`sites` (which nodes may be mutated),
:mod:`operators` (the edits), :mod:`catalog` (mutant ids, enumeration, the
mutated source, the sample), :mod:`targets` (torch's modules and files),
:mod:`injection` and :mod:`overlay_site` (serving a mutated module to every
process of a run through ``sitecustomize``, with markers proving who loaded
it), :mod:`suite_run` (one run of the rows with a time limit), :mod:`verdicts`,
:mod:`campaign`, :mod:`campaign_report` and :mod:`campaign_cli`.

A mutation is probed: the replacement first calls a function the injecting
loader defines, which records the first call in each process, so a report
tells a survivor whose mutated code never ran (the rows do not reach it) from
one that ran and changed nothing the rows check.
"""
