"""Per-case isolation inside a reused rank process (or a thread-rank run).

[Note: per-case reset]
A pooled rank process runs many cases. Before each case it seeds every RNG
identically, applies the case's environment, and takes a snapshot of what a
case may change; afterwards it restores: environment variables, warning
filters, the ``torch.distributed`` debug level, any attribute of
``torch.distributed`` / ``distributed_c10d`` a case monkeypatched (e.g. a
collective recorder left installed after a failure), and it destroys every
process group the case created, so the next case sees only the default group.
"""

from __future__ import annotations

import os
import random
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["seed_everything", "case_scope", "process_global_scope"]


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
        warnings.filters[:] = saved_filters
        warnings._filters_mutated()  # type: ignore[attr-defined]
        dist.set_debug_level(saved_level)
        for module, attrs in saved_attrs:
            _restore_attrs(module, attrs)


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
    before = set(c10d._world.pg_map)
    seed_everything(seed)
    with process_global_scope(env):
        try:
            yield
        finally:
            _destroy_new_groups(before)


def _destroy_new_groups(before: set[Any]) -> None:
    default = c10d._world.default_pg
    for group in [g for g in list(c10d._world.pg_map) if g not in before and g is not default]:
        try:
            dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 - a broken group must not poison the next case
            c10d._world.pg_map.pop(group, None)
