"""State-dict mutants: optimizer state, and loading in the middle of an iteration."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from conformance.selftest.declare import Expect, Patch, _Mutant

__all__ = ["OptimStateNotLoaded", "LoadRefusedAfterForward"]

Fn = Callable[..., Any]


def _without_state(to_load: Fn) -> Fn:
    def to_load_dropping_state(model: Any, optim: Any, osd: Any) -> Any:
        return {**to_load(model, optim, osd), "state": {}}

    return to_load_dropping_state


class OptimStateNotLoaded(_Mutant):
    """Loads an optimizer state dict's hyperparameters but drops its per-parameter state."""

    name = "mutant-optim-state-not-loaded"
    breaks = "loading optimizer state (e.g. Adam's moments)"
    expect = Expect(
        "roundtrip or cross_impl", "thread",
        ("state_dict/roundtrip", "state_dict/cross_impl[dst=reference]"),
    )
    patches = (Patch("fsdp_impl.state_dict:optim_state_dict_to_load", _without_state),)


def _refusing_unsharded(check_idle: Fn) -> Fn:
    def check_idle_and_resharded(units: Any) -> None:
        check_idle(units)
        held = [u.fqn_prefix or "<root>" for u in units if u.handle.state.name != "SHARDED"]
        if held:
            raise RuntimeError(f"state dicts need resharded units; {held} still hold unsharded parameters")

    return check_idle_and_resharded


class LoadRefusedAfterForward(_Mutant):
    """Refuses state-dict loads while a unit still holds parameters from a forward."""

    name = "mutant-load-refused-after-forward"
    breaks = "loading a state dict after a forward (e.g. rolling back an abandoned iteration)"
    expect = Expect(
        "load_in_loop and after_forward", "thread", ("state_dict/load_in_loop[point=after_forward]",),
    )
    patches = (Patch("fsdp_impl.state_dict:_check_idle", _refusing_unsharded),)
