"""Per-case isolation inside a reused rank process (or a thread-rank run).

[Note: per-case reset]
A pooled rank process runs many cases. Before each case it seeds every RNG
identically, applies the case's environment, and takes a snapshot of what a
case may change; afterwards it restores: environment variables, warning
filters, the ``torch.distributed`` debug level, any attribute of
``torch.distributed`` / ``distributed_c10d`` a case monkeypatched (e.g. a
collective recorder left installed after a failure), and it destroys every
process group the case created, so the next case sees only the default group.
Last, it calls every function registered with :func:`on_case_end`: code that
changes its own process-global state for one case (the suite's mutants patch
``fsdp_impl`` from inside a case) undoes it there, so the next case in the
process starts from the pristine state.

[Note: groups outlive their handshake]
A rank's ``new_group`` can return before its peers have finished connecting to
it (gloo's full-mesh handshake). Destroying the group at once then closes
sockets a peer is still handshaking on, and the peer's ``new_group`` fails
with "Gloo connectFullMesh failed ... Connection closed by peer". In a loop of
two-rank cases that each create one group, that was 26 failures in 1,731 runs
on a 2-core box, and none with a barrier between creating and destroying. So
after a case that returned normally on this rank and created groups, the
ranks meet at a barrier on the default group before the reset destroys them.
"Created groups" is read from c10d's group counter, which every rank's
``new_group`` call advances, member or not: a rank outside ``new_group([0, 1])``
gets no group in its map, yet ranks 0 and 1 wait for it at the barrier.
A rank whose case raised skips it; a peer left waiting there is counted as
aborted, as one blocked in a collective is (the pool is replaced after a
failure anyway).

[Note: mesh-keyed caches]
A ``DeviceMesh`` hashes and compares by its ranks, layout, device type and dim
names, not by the process groups behind it. DTensor caches keyed by a mesh
(sharding propagation, mesh topology) therefore hand a later case an *equal*
mesh object from an earlier case, whose groups the reset has destroyed: the
later case fails with "Could not resolve the process group registered under the
name N" for a group it never made. The reset clears those caches whenever it
destroys a group (and only then: a case that made none, or only groups its
context keeps, [Note: kept groups] in :mod:`harness.ranks.kept_groups`, leaves
them warm for the next). They are torch internals;
``harness/tests/ranks/test_reset.py`` pins them.
"""

from __future__ import annotations

import os
import random
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from harness.ranks.kept_groups import is_kept, request_scope

__all__ = ["seed_everything", "case_scope", "groups_scope", "process_global_scope", "clear_mesh_keyed_caches",
           "on_case_end"]

#: Called, in registration order, at the end of every case scope ([Note: per-case reset]).
_case_end: list[Callable[[], None]] = []


def on_case_end(fn: Callable[[], None]) -> None:
    """Call ``fn`` at the end of every later case in this process (once, however often registered).

    Under thread ranks it runs once per run, after every rank thread has finished;
    under process ranks once per case in each rank process.
    """
    if fn not in _case_end:
        _case_end.append(fn)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy

        numpy.random.seed(seed)
    except ImportError:
        pass


@contextmanager
def process_global_scope(env: Mapping[str, str] | None) -> Iterator[None]:
    """Restore env vars, warning filters, debug level and ``torch.distributed`` attributes."""
    saved_env = dict(os.environ)
    saved_filters = warnings.filters[:]
    saved_level = dist.get_debug_level()
    saved_attrs = [(module, dict(vars(module))) for module in (dist, c10d)]
    os.environ.update(env or {})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        cast(list, warnings.filters)[:] = saved_filters
        warnings._filters_mutated()  # type: ignore[attr-defined]
        dist.set_debug_level(saved_level)
        for module, attrs in saved_attrs:
            _restore_attrs(module, attrs)
        for fn in list(_case_end):
            fn()


def _restore_attrs(module: Any, saved: dict[str, Any]) -> None:
    """Put back every function or class that existed before and was replaced.

    Only callables are restored: monkeypatches replace functions, while data
    attributes are c10d's own bookkeeping (``_group_count`` must keep
    counting, or a new group would reuse an old group's store keys). New
    attributes are left alone: importing a submodule during a case (e.g.
    ``torch.distributed._functional_collectives``) legitimately adds one.
    """
    current = vars(module)
    for name, value in saved.items():
        if callable(value) and current.get(name, _MISSING) is not value:
            setattr(module, name, value)


_MISSING = object()


@contextmanager
def case_scope(seed: int, env: Mapping[str, str] | None) -> Iterator[None]:
    """Everything :func:`process_global_scope` restores, plus seeds and new process groups."""
    seed_everything(seed)
    with process_global_scope(env), groups_scope():
        yield


@contextmanager
def groups_scope() -> Iterator[None]:
    """Destroy on leaving every process group made inside but those kept ([Note: kept groups]), and then
    DTensor's caches of their meshes, after a barrier when it is left normally; collective: every rank
    enters and leaves alike. Requests to keep a group or mesh are counted afresh inside.

    [Note: groups made per example]
    Every gloo group keeps a loop thread and two worker threads until it is
    destroyed. A case that makes groups for each of many examples (a fuzzer's
    programs each wrap a model over a mesh or hybrid groups of their own) ran
    350 threads per rank half a minute into a world-size-4 row, and the load
    average of a 2-core box past 900; ranks then missed their timeouts. A case
    scopes each example's groups with this, as the reset scopes a case's.

    Destroying them has one hazard on torch 2.13: a group with a hashed name
    (``new_group(..., use_local_synchronization=True)``, which FSDP2's
    ``set_separate_reduce_scatter_group`` makes) is named after its ranks and the
    size of c10d's group table, which shrinks again when the group is destroyed.
    The next such group over the same ranks in the pool takes the same name and
    reads the destroyed one's rendezvous keys from the pool's store: a hang, or
    gloo's "Connection refused" (measured standalone on one ``FileStore``: the
    second creation hangs). torch 2.14 salts the name with the group count, which
    only grows. So on torch 2.13 only one scope per pool may make a hashed-name
    group over a given set of ranks."""
    before = set(c10d._world.pg_map)
    groups_made = c10d._world.group_count
    try:
        with request_scope():
            yield
        if c10d._world.group_count != groups_made:
            dist.barrier()  # see [Note: groups outlive their handshake]
    finally:
        if _destroy_new_groups(before):
            clear_mesh_keyed_caches()  # a destroyed group may leave stale entries; kept ones do not


def clear_mesh_keyed_caches() -> None:
    """Drop DTensor's caches keyed by (value-equal) meshes; see [Note: mesh-keyed caches]."""
    if "torch.distributed.tensor" not in sys.modules:
        return  # nothing DTensor-related ran in this process
    from torch.distributed.tensor import DTensor, _redistribute
    from torch.distributed.tensor._collective_utils import MeshTopoInfo

    # Thread-local: clears this rank's cache (each thread rank runs its own reset).
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the native dispatch fast path's copy
    MeshTopoInfo.build_from_mesh.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()


def _destroy_new_groups(before: set[Any]) -> bool:
    """Destroy every group made since ``before`` except those kept ([Note: kept groups]); whether any was."""
    default = c10d._world.default_pg
    made = [g for g in list(c10d._world.pg_map) if g not in before and g is not default and not is_kept(g)]
    for group in made:
        try:
            dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 - a broken group must not poison the next case
            c10d._world.pg_map.pop(group, None)
    return bool(made)
