"""Subgroups and meshes a rank process keeps from one case to the next.

[Note: kept groups]
DTensor caches its sharding decisions by mesh *value* ([Note: mesh-keyed
caches] in :mod:`harness.ranks.reset`), so when a case's groups are destroyed
the caches must go with them, and the next case pays DTensor's sharding
propagation afresh for every operator it meets: two Adam steps of a
``fully_shard``-ed model over two process ranks took 0.11 to 0.16 CPU-seconds a
rank with the caches cleared before each case and 0.025 to 0.037 with them
kept. So a process rank keeps the subgroups and meshes a case asks its context
for (:meth:`RankContext.new_group`, :meth:`RankContext.device_mesh`) for the
later cases of its pool, as a training job keeps one mesh for its whole life:

* the k-th request with the same arguments inside a scope (a case, or one of
  a fuzzer's examples: :func:`harness.ranks.reset.groups_scope`) returns what
  the k-th such request returned before, so two requests in one case still
  get two groups, and a fuzzer's hundredth example reuses its first's;
* what is kept belongs to the process's default group; a new default group
  (a new pool) starts an empty store;
* groups a case makes by other means (``dist.new_group``, an implementation's
  own) are destroyed when the case ends, and only then are the caches cleared.

Only process ranks keep anything: a failed case replaces their pool, and what
it kept goes with it, so no later case meets a group left mid-collective.
Thread ranks make a new world for every run, and a launched job's ranks run
on after a failed case, so their contexts keep nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch.distributed.distributed_c10d as c10d

__all__ = ["kept", "is_kept", "request_scope"]

T = TypeVar("T")

_store: dict[tuple[Hashable, ...], Any] = {}
_groups: set[Any] = set()  # every process group made for something in _store
_world: list[Any] = [None]  # the default group _store belongs to
_requests: list[Counter[tuple[Hashable, ...]]] = []  # one per open scope, innermost last


@contextmanager
def request_scope() -> Iterator[None]:
    """Count requests afresh inside the block (a case, or one example of a fuzzer's)."""
    _requests.append(Counter())
    try:
        yield
    finally:
        _requests.pop()


def kept(key: tuple[Hashable, ...], make: Callable[[], T]) -> T:
    """What ``make()`` returned for the same ``key`` and request number earlier in this process, else
    ``make()``'s value, kept along with every process group it made ([Note: kept groups]). Collective
    when ``make`` is: every rank asks for the same keys in the same order."""
    default = c10d._world.default_pg
    if _world[0] is not default:
        _store.clear()
        _groups.clear()
        _world[0] = default
    counts = _requests[-1] if _requests else Counter()
    full = (*key, counts[key])
    counts[key] += 1
    if full not in _store:
        before = set(c10d._world.pg_map)
        _store[full] = make()
        _groups.update(group for group in c10d._world.pg_map if group not in before)
    return _store[full]  # type: ignore[no-any-return]


def is_kept(group: Any) -> bool:
    """Whether ``group`` was made for something :func:`kept` holds."""
    return group in _groups
