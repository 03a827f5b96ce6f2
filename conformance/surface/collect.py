"""The public surface of torch's FSDPs as the installed torch has it, read with :mod:`inspect`.

Public means not starting with ``_``. What is enumerated:

- every class and function ``torch.distributed.fsdp.__all__`` names: a class's members (methods,
  properties, static and class methods, context managers) that it or a base other than ``nn.Module``
  and ``object`` defines, a dataclass's fields (inherited ones included), an enum's members;
  its functions together as one surface;
- the arguments of ``FullyShardedDataParallel.__init__`` and of ``fully_shard``;
- the functions ``torch.distributed.checkpoint.state_dict.__all__`` names, and the fields of its
  ``StateDictOptions``.

Attributes an instance sets in ``__init__`` (``sharding_strategy``, ``process_group``, ...) are not
on the class and are not enumerated.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch.nn as nn

__all__ = ["STATE_DICT_MODULE", "installed_surfaces", "kind_of_member"]

STATE_DICT_MODULE = "torch.distributed.checkpoint.state_dict"
#: The surfaces of call arguments: the dotted path in ``torch.distributed.fsdp`` of each callable.
_ARGUMENT_SURFACES = ("FullyShardedDataParallel.__init__", "fully_shard")


def installed_surfaces() -> dict[str, dict[str, str]]:
    """Surface name -> {public name -> its kind}, for the installed torch."""
    import torch.distributed.checkpoint.state_dict as state_dict_api
    import torch.distributed.fsdp as fsdp_api

    surfaces: dict[str, dict[str, str]] = {}
    for module in (fsdp_api, state_dict_api):
        surfaces.update(_module_surfaces(module))
    for path in _ARGUMENT_SURFACES:
        surfaces[path] = _arguments(_resolve(fsdp_api, path))
    return surfaces


def _module_surfaces(module: ModuleType) -> dict[str, dict[str, str]]:
    """A module's functions as one surface (named after the module), and one surface per class."""
    names = [name for name in getattr(module, "__all__", ()) if not name.startswith("_")]
    out: dict[str, dict[str, str]] = {module.__name__: {}}
    for name in names:
        value = getattr(module, name)
        if inspect.isclass(value):
            if module.__name__ == STATE_DICT_MODULE and value.__module__ != STATE_DICT_MODULE:
                continue  # a re-export of a class whose own module is surveyed
            out[name] = _class_surface(value)
        elif inspect.isfunction(value):
            out[module.__name__][name] = "function"
    return out


def _class_surface(cls: type) -> dict[str, str]:
    """A dataclass's fields, an enum's members, or any other class's members."""
    if issubclass(cls, enum.Enum):
        return {name: "member" for name in cls.__members__ if not name.startswith("_")}
    if dataclasses.is_dataclass(cls):
        return {field.name: "field" for field in dataclasses.fields(cls) if not field.name.startswith("_")}
    members: dict[str, str] = {}
    for klass in cls.__mro__:
        if klass is object or issubclass(nn.Module, klass):
            continue
        for name, value in vars(klass).items():
            if not name.startswith("_") and name not in members:
                members[name] = kind_of_member(value)
    return dict(sorted(members.items()))


def kind_of_member(value: object) -> str:
    """``method``, ``property``, ``staticmethod``, ``classmethod`` or ``attribute``; a context manager
    (a function made by ``contextlib.contextmanager``) is ``context manager``, or ``static context
    manager`` when it is a staticmethod."""
    if isinstance(value, property):
        return "property"
    static = isinstance(value, staticmethod)
    if isinstance(value, (staticmethod, classmethod)):
        function = value.__func__
        kind = "staticmethod" if static else "classmethod"
    elif inspect.isfunction(value):
        function, kind = value, "method"
    else:
        return "attribute"
    unwrapped = inspect.unwrap(function)
    if unwrapped is not function and inspect.isgeneratorfunction(unwrapped):
        return "static context manager" if static else "context manager"
    return kind


def _arguments(function: Callable[..., Any]) -> dict[str, str]:
    """A callable's parameters other than ``self``."""
    parameters = inspect.signature(function).parameters
    return {name: "argument" for name in parameters if name != "self" and not name.startswith("_")}


def _resolve(module: ModuleType, path: str) -> Any:
    value: Any = module
    for part in path.split("."):
        value = getattr(value, part)
    return value
