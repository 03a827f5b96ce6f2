"""The public surface of torch's FSDPs, and which rows or fuzzer operations of this suite exercise each name.

[Note: the surface table]
:mod:`conformance.surface.collect` enumerates, from the installed torch, every public name (not
starting with ``_``) of ``torch.distributed.fsdp`` and ``torch.distributed.checkpoint.state_dict``,
grouped into surfaces: a class's members, a dataclass's fields, an enum's members, a module's
functions, ``FullyShardedDataParallel.__init__``'s and ``fully_shard``'s arguments.
``classified.toml`` says, for each name, which rows exercise it with an observable check and what that
check asserts, or why nothing does (:mod:`conformance.surface.classification`);
:mod:`conformance.surface.render` makes docs/SURFACE.md from it, and ``python -m conformance.surface``
writes or checks that page.

Versions: an entry holds for every torch unless it carries ``since = "MAJOR.MINOR"`` (the first torch
with the name) or ``until = "MAJOR.MINOR"`` (the first without it). The installed torch must have
exactly the names whose entries hold for its version, of the kind classified; an entry for another
torch is listed on the page with its versions and otherwise ignored. The page is rendered from the
classification alone, so it is the same whichever torch generates it.
"""
