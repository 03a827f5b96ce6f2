"""How a mutant is declared: patches as data, the cases that must catch it, and the base adapter.

A mutant states, in its class body, everything about it:

* ``patches``: :class:`Patch` values naming an attribute of ``fsdp_impl`` as a
  string (``"fsdp_impl.unit:_final_callback"`` or
  ``"fsdp_impl.flat_param:FlatParamHandle.reshard"``) and a replacement built
  from the original;
* ``expect``: an :class:`Expect`, the cases that must report FAIL against it;
* for breakage that is not a patch, ``spec_overrides`` or an override of
  ``_mutate_unit`` / an adapter method.

Every target is resolved when :mod:`conformance.selftest.mutants` is imported
(:func:`check_declaration`), so a rename in ``fsdp_impl`` fails at import and in
a fast unit test, not in a slow mutant session.
"""

from __future__ import annotations

import importlib
import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch.nn as nn

from conformance.adapters.reference import ReferenceAdapter
from conformance.contract.adapter import WrapSpec
from harness.ranks.rank_mode import SPAWNED
from harness.ranks.reset import on_case_end

__all__ = ["Expect", "Patch", "PatchedAdapter", "check_declaration", "apply_patches", "revert_patches", "_Mutant",
           "_state_of", "drop_grads"]


@dataclass(frozen=True)
class Expect:
    """Run the cases selected by ``keyword`` against one mutant.

    Every row a ``must_fail`` pattern matches (:func:`conformance.contract.rows.row_matches`:
    a case id, optionally with a subset of its parameters) must FAIL.
    ``accelerators`` is how many GPUs the selected rows need (0: they run on CPU).
    ``timing_repeats``, for a mutant that pushes a timing case's measurement past a
    bound by far more than the machine's jitter, is how many times the case repeats
    each timed region (``--fsdp-timing-repeats``; ``None``: the default). One run then
    proves the bound can fail; a mutant that must bring a measurement *under* a
    bound keeps the default's median. ``stateful_examples``, for a mutant the stateful fuzzer
    must catch, is the programs each of its rows draws (``--fsdp-fuzz-stateful-examples``; ``None``:
    the main job's budget): a breakage that needs a particular sequence of operations is found
    by the nightly budget, not always by the main job's few programs.
    """

    keyword: str
    rank_mode: str
    must_fail: tuple[str, ...]
    accelerators: int = 0
    timing_repeats: int | None = None
    stateful_examples: int | None = None

    def __post_init__(self) -> None:
        if self.rank_mode not in SPAWNED:
            raise ValueError(f"rank_mode must be one of {', '.join(map(str, SPAWNED))}, got {self.rank_mode!r}")
        if not self.must_fail:
            raise ValueError(f"{self.keyword!r}: must_fail names no case")
        if self.accelerators < 0:
            raise ValueError(f"{self.keyword!r}: accelerators must be >= 0, got {self.accelerators}")
        if self.timing_repeats is not None and self.timing_repeats < 1:
            raise ValueError(f"{self.keyword!r}: timing_repeats must be >= 1, got {self.timing_repeats}")
        if self.stateful_examples is not None and self.stateful_examples < 1:
            raise ValueError(f"{self.keyword!r}: stateful_examples must be >= 1, got {self.stateful_examples}")


@dataclass(frozen=True)
class Patch:
    """Replace one attribute: ``target`` is ``"module:name"`` or ``"module:Class.attr"``.

    ``replace`` receives the attribute's original value and returns what goes in
    its place (a wrapper around it, or something unrelated). Targets must be
    late-bound by the code under test (looked up on the module or class at call
    time), which ``fsdp_impl/README.md`` promises for the names it lists.
    """

    target: str
    replace: Callable[[Any], Any]

    @classmethod
    def instead(cls, target: str, value: Any) -> Patch:
        """A patch that puts ``value`` in place of the original, whatever it was."""
        return cls(target, lambda _original: value)

    def resolve(self) -> tuple[Any, str, Any]:
        """``(owner, attribute, current value)``; LookupError naming the target if it is stale."""
        module_name, sep, path = self.target.partition(":")
        if not sep or not module_name or not path:
            raise ValueError(f"patch target {self.target!r} is not 'module:name' or 'module:Class.attr'")
        try:
            owner: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            raise LookupError(f"patch target {self.target!r}: no module {module_name!r}") from exc
        *parents, attr = path.split(".")
        for part in parents:
            if not hasattr(owner, part):
                raise LookupError(f"patch target {self.target!r}: {owner!r} has no attribute {part!r}")
            owner = getattr(owner, part)
        if not hasattr(owner, attr):
            raise LookupError(f"patch target {self.target!r}: {owner!r} has no attribute {attr!r}")
        if isinstance(inspect.getattr_static(owner, attr), (staticmethod, classmethod, property)):
            raise TypeError(f"patch target {self.target!r} is a {type(inspect.getattr_static(owner, attr))}: "
                            "patch the plain function it wraps instead")
        return owner, attr, getattr(owner, attr)


def check_declaration(mutant: type) -> None:
    """Raise, naming ``mutant``, if its expectation is missing or one of its patch targets is stale."""
    if not isinstance(getattr(mutant, "expect", None), Expect):
        raise TypeError(f"mutant {mutant.__name__} declares no `expect = Expect(...)`")
    for patch in getattr(mutant, "patches", ()):
        try:
            patch.resolve()
        except (LookupError, TypeError, ValueError) as exc:
            raise type(exc)(f"mutant {mutant.__name__}: {exc}") from exc


_patch_lock = threading.Lock()
#: (id(owner), attribute) -> (owner, attribute, original value) of every patch applied in this process.
_patched: dict[tuple[int, str], tuple[Any, str, Any]] = {}


def apply_patches(patches: tuple[Patch, ...]) -> None:
    """Apply each patch unless its target was already patched in this process, until the case ends.

    ``wrap`` runs on every rank; under thread ranks the ranks share one process
    and its modules. The first rank's patch wins, so a replacement that wraps the
    original is never wrapped around another rank's replacement. When the case
    ends, the harness's per-case reset calls :func:`revert_patches`, so one
    process can run several mutants' cases one after another.
    """
    with _patch_lock:
        for patch in patches:
            owner, attr, original = patch.resolve()
            if (id(owner), attr) not in _patched:
                setattr(owner, attr, patch.replace(original))
                _patched[(id(owner), attr)] = (owner, attr, original)


def revert_patches() -> None:
    """Put back every original :func:`apply_patches` replaced in this process."""
    with _patch_lock:
        for owner, attr, original in _patched.values():
            setattr(owner, attr, original)
        _patched.clear()


on_case_end(revert_patches)  # in every process that imports the mutants: its rank processes and thread hosts


class PatchedAdapter:
    """Mix in before any adapter class: that adapter with one behaviour broken, declared as data.

    ``class NeverReshards(PatchedAdapter, MyAdapter)``: every :meth:`wrap` first
    applies :attr:`patches` (until the case ends) and replaces the spec fields in
    :attr:`spec_overrides`, then wraps as the adapter does. :attr:`expect` names
    the rows that must FAIL against it (:func:`conformance.selftest.uncaught` runs them).
    """

    #: What is broken, in words (shown when a row fails to catch it).
    breaks: ClassVar[str] = ""
    #: The cases that must report FAIL against this adapter.
    expect: ClassVar[Expect]
    #: Attributes replaced on the first wrap of a case, put back when it ends.
    patches: ClassVar[tuple[Patch, ...]] = ()
    #: ``WrapSpec`` fields replaced on every wrap, whatever the case asked for.
    spec_overrides: ClassVar[Mapping[str, Any]] = {}

    def wrap(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        apply_patches(self.patches)
        return super().wrap(module, self._mutate_spec(spec))  # type: ignore[misc,no-any-return]

    def _mutate_spec(self, spec: WrapSpec) -> WrapSpec:
        return replace(spec, **self.spec_overrides) if self.spec_overrides else spec


class _Mutant(PatchedAdapter, ReferenceAdapter):
    """The reference adapter with the declared breakage applied on every wrap."""

    def wrap(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        model = super().wrap(module, spec)
        for unit in self._api().FullyShardedDataParallel.fsdp_modules(model):
            self._mutate_unit(unit)
        return model

    def fully_shard(self, module: nn.Module | Sequence[nn.Module], **kwargs: Any) -> nn.Module:
        apply_patches(self.patches)
        return super().fully_shard(module, **kwargs)

    def _mutate_unit(self, unit: Any) -> None:
        """Per-unit breakage that is not a patch of a module attribute."""


def _state_of(unit: nn.Module) -> Any:
    """The reference unit's :class:`fsdp_impl.unit_state.UnitState`, for per-unit breakage."""
    from fsdp_impl.unit_state import unit_state

    state = unit_state(unit)
    if state is None:
        raise TypeError(f"{type(unit).__name__} is not a reference FSDP unit")
    return state


def drop_grads(handle: Any) -> None:
    """Forget a flat-parameter handle's gradients (the flat one and each original parameter's)."""
    handle.flat_param.grad = None
    for slot in handle.slots:
        slot.param.grad = None
