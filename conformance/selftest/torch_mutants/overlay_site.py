"""The ``sitecustomize.py`` of a mutant overlay: serve mutated sources for named modules, record who loaded them.

:mod:`~conformance.selftest.torch_mutants.injection` copies this file into an
overlay directory as ``sitecustomize.py``, next to ``torch_mutant.json``, and
puts the directory first on ``PYTHONPATH``. Every Python process started with
that environment (the run, its forkserver, rank processes, thread hosts) runs
it at start-up, before anything imports torch. It reads the JSON:

* ``modules``: module name -> the file holding the source to serve for it;
* ``markers``: a directory where each process that imports a served module
  writes ``import.<pid>.<module>``, one whose served module raises while it
  executes writes ``import-error.<pid>.<module>`` (with the traceback), and
  one that first runs a probed mutation writes ``hit.<pid>.<module>``.

A meta path finder placed first on ``sys.meta_path`` finds a served module's
installed file as the standard finder would (so ``__file__``, ``__path__`` and
relative imports are the installed module's) and executes the served source
instead; nothing is written to the installed files or their bytecode caches.
An existing ``sitecustomize`` further along ``sys.path`` is run afterwards, as
Python would have run it without the overlay. Standalone on purpose: it runs
before the project is importable.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import json
import linecache
import os
import sys
import traceback
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

_HERE = os.path.dirname(os.path.abspath(__file__))
#: The probe name, as :data:`conformance.selftest.torch_mutants.catalog.PROBE` spells it.
_PROBE = "__fsdp_mutant_hit__"


def _record(markers: str, kind: str, module: str, detail: str = "") -> None:
    """Write ``markers/<kind>.<pid>.<module>``: who this process is, and ``detail``."""
    facts = {"kind": kind, "module": module, "pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv[:3],
             "detail": detail}
    with open(os.path.join(markers, f"{kind}.{os.getpid()}.{module}"), "w") as out:
        json.dump(facts, out)


class _Probe:
    """Called where a mutation runs: records the first call in each process, returns ``None``."""

    def __init__(self, markers: str, module: str) -> None:
        self.markers, self.module, self.seen = markers, module, False
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self.seen = False

    def __call__(self) -> None:
        if not self.seen:
            self.seen = True
            _record(self.markers, "hit", self.module)


class _Loader(importlib.abc.Loader):
    def __init__(self, name: str, served: str, markers: str) -> None:
        self.name, self.served, self.markers = name, served, markers

    def create_module(self, spec: ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        with open(self.served) as f:
            source = f.read()
        assert module.__spec__ is not None and module.__spec__.origin is not None
        origin = module.__spec__.origin
        linecache.cache[origin] = (len(source), None, source.splitlines(keepends=True), origin)
        module.__dict__[_PROBE] = _Probe(self.markers, self.name)
        _record(self.markers, "import", self.name)
        try:
            exec(compile(source, origin, "exec", dont_inherit=True), module.__dict__)
        except BaseException:
            _record(self.markers, "import-error", self.name, traceback.format_exc())
            raise


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, modules: dict[str, str], markers: str) -> None:
        self.modules, self.markers = modules, markers

    def find_spec(self, name: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if name not in self.modules:
            return None
        found = importlib.machinery.PathFinder.find_spec(name, path)
        if found is None or not found.has_location:
            return None
        return importlib.util.spec_from_file_location(
            name, found.origin, loader=_Loader(name, self.modules[name], self.markers),
            submodule_search_locations=found.submodule_search_locations)


def _chain() -> None:
    """Run the ``sitecustomize`` this overlay hides, if ``sys.path`` has one after it."""
    others = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def _install() -> None:
    with open(os.path.join(_HERE, "torch_mutant.json")) as f:
        config = json.load(f)
    sys.meta_path.insert(0, _Finder(config["modules"], config["markers"]))


if __name__ == "sitecustomize":  # as the overlay's copy; importing this module itself does nothing
    _install()
    _chain()
