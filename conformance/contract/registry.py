"""Finding adapters by name.

Adapters register under the ``fsdp_conformance.adapters`` entry-point group,
name -> ``module:Class``. The built-in ones register the same way in this
project's ``pyproject.toml``; :data:`BUILTIN` is only a fallback for running
from a source tree whose metadata predates an adapter.
"""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass
from importlib.metadata import entry_points

from conformance.contract.adapter import FSDPAdapter
from conformance.contract.optional import CAPABILITY_METHODS, protocol_version

__all__ = ["ENTRY_POINT_GROUP", "ENV_VAR", "BUILTIN", "UnknownAdapter", "AdapterEntry", "parse_entries", "registered",
           "load"]

ENTRY_POINT_GROUP = "fsdp_conformance.adapters"
ENV_VAR = "FSDP_CONFORMANCE_ADAPTERS"

BUILTIN: dict[str, str] = {
    "reference": "conformance.adapters.reference:ReferenceAdapter",
    "torch-fsdp1": "conformance.adapters.torch_fsdp1:TorchFSDP1Adapter",
    "torch-fsdp2": "conformance.adapters.torch_fsdp2:TorchFSDP2Adapter",
    "fairscale-fsdp": "conformance.adapters.fairscale_fsdp:FairScaleFSDPAdapter",
    "torchtitan-simple-fsdp": "conformance.adapters.torchtitan_simple_fsdp:TorchTitanSimpleFSDPAdapter",
    "deepspeed-zero1": "conformance.adapters.deepspeed_zero:DeepSpeedZero1Adapter",
    "deepspeed-zero2": "conformance.adapters.deepspeed_zero:DeepSpeedZero2Adapter",
    "deepspeed-zero3": "conformance.adapters.deepspeed_zero:DeepSpeedZero3Adapter",
}


class UnknownAdapter(LookupError):
    """No adapter is registered under the requested name."""


@dataclass(frozen=True)
class AdapterEntry:
    name: str
    target: str  # "module:Class"


def registered() -> dict[str, AdapterEntry]:
    """Every adapter name -> entry: built-ins, entry points, then :data:`ENV_VAR` entries.

    ``FSDP_CONFORMANCE_ADAPTERS="name=module:Class,other=pkg.mod:Cls"`` registers
    adapters without packaging (handy while writing one); a malformed entry is
    an error naming the variable.
    """
    found = {name: AdapterEntry(name, target) for name, target in BUILTIN.items()}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found[ep.name] = AdapterEntry(ep.name, ep.value)
    raw = os.environ.get(ENV_VAR, "")
    try:
        extra = parse_entries(raw)
    except ValueError as exc:
        raise ValueError(f"{ENV_VAR}={raw!r}: {exc}") from None
    found.update({entry.name: entry for entry in extra})
    return found


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_TARGET = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


def parse_entries(raw: str) -> tuple[AdapterEntry, ...]:
    """The entries of a :data:`ENV_VAR` value, ``name=module:Class`` separated by commas; ``ValueError``
    naming the first malformed entry (the run's settings check the variable with it before any row runs)."""
    entries: list[AdapterEntry] = []
    for item in filter(None, (part.strip() for part in str(raw).split(","))):
        name, _, target = (part.strip() for part in item.partition("="))
        if not _NAME.fullmatch(name) or not _TARGET.fullmatch(target):
            raise ValueError(f"entry {item!r} is not name=module:Class (e.g. my-fsdp=my_package.adapter:MyAdapter)")
        if any(entry.name == name for entry in entries):
            raise ValueError(f"entry {item!r} names {name!r} a second time")
        entries.append(AdapterEntry(name, target))
    return tuple(entries)


def load(name: str) -> FSDPAdapter:
    """Instantiate the adapter registered as ``name``.

    Raises :class:`UnknownAdapter` listing the known names, or the import error
    of a registered adapter whose module cannot be imported.
    """
    entries = registered()
    if name not in entries:
        raise UnknownAdapter(
            f"no FSDP adapter named {name!r}; registered: {', '.join(sorted(entries))} "
            f"(third parties register under the {ENTRY_POINT_GROUP!r} entry-point group)"
        )
    module_name, _, attr = entries[name].target.partition(":")
    adapter_cls = getattr(importlib.import_module(module_name), attr)
    adapter = adapter_cls()
    # hasattr, not isinstance(adapter, FSDPAdapter): since Python 3.12 a runtime-checkable
    # Protocol looks members up statically, so an adapter that delegates through __getattr__
    # would be refused there with nothing missing, and accepted on 3.11.
    missing = [m for m in _REQUIRED if not hasattr(adapter, m)]
    if missing:
        raise TypeError(f"adapter {name!r} ({entries[name].target}) does not implement FSDPAdapter: "
                        f"missing {', '.join(missing)}")
    protocol_version(adapter)
    for capability, methods in CAPABILITY_METHODS.items():
        lacking = [method for method in methods if not hasattr(adapter, method)]
        if capability in adapter.capabilities and lacking:
            raise TypeError(f"adapter {name!r} declares Capability.{capability.name} but has no "
                            f"{', '.join(lacking)} method (conformance.contract.optional documents its signature)")
    return adapter


_REQUIRED = ("name", "capabilities", *sorted(m for m in vars(FSDPAdapter) if not m.startswith("_")
                                             and callable(getattr(FSDPAdapter, m))))


def expand(names: list[str]) -> list[str]:
    """Resolve ``all`` (every registered adapter usable here) and drop duplicates, keeping the order given.

    An adapter that is registered but unavailable here (an optional extra not
    installed) is left out of ``all``; named explicitly, it gives ``error`` rows
    with its reason.
    """
    out: list[str] = []
    for name in names:
        for item in _usable() if name == "all" else [name]:
            if item not in out:
                out.append(item)
    return out


def _usable() -> list[str]:
    usable = []
    for name in registered():
        try:
            if load(name).unavailable_reason() is None:
                usable.append(name)
        except Exception:  # noqa: BLE001 - an adapter that does not load is reported when named
            usable.append(name)
    return usable
