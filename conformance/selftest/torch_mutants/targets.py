"""Which of torch's installed modules are mutated for an implementation, and where their sources are.

``torch-fsdp2``: every module of the package ``torch.distributed.fsdp._fully_shard``
as installed; ``torch-fsdp1``: the flat parameter, the runtime hooks, the state
dict and the optimizer state dict code. Files are found through importlib, in
whichever torch the running interpreter imports.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["IMPLS", "TargetError", "target_modules", "target_source"]

_FSDP2_PACKAGE = "torch.distributed.fsdp._fully_shard"
_FSDP1_MODULES = ("_flat_param", "_runtime_utils", "_state_dict_utils", "_optim_utils")
#: The implementations whose torch sources can be mutated.
IMPLS = ("torch-fsdp1", "torch-fsdp2")


class TargetError(ValueError):
    """An implementation or module that cannot be mutated, named in the message."""


def _spec_origin(module: str) -> Path:
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        spec = None
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise TargetError(f"target module {module!r} has no Python source in the installed torch")
    return Path(spec.origin)


def target_modules(impl: str) -> list[str]:
    """The dotted names of ``impl``'s target modules, sorted."""
    if impl == "torch-fsdp1":
        return sorted(f"torch.distributed.fsdp.{name}" for name in _FSDP1_MODULES)
    if impl == "torch-fsdp2":
        package = _spec_origin(_FSDP2_PACKAGE).parent
        names = [_FSDP2_PACKAGE if path.stem == "__init__" else f"{_FSDP2_PACKAGE}.{path.stem}"
                 for path in package.glob("*.py")]
        return sorted(names)
    raise TargetError(f"unknown --impl {impl!r}: torch mutants exist for {', '.join(IMPLS)}")


def target_source(module: str) -> str:
    """The installed source text of ``module``."""
    return _spec_origin(module).read_text()
