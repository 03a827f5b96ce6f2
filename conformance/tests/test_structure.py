"""The house rules a reader relies on: imports point one way, modules and functions stay small.

* No import cycle among the project's modules, counting every import the code
  can execute or a type checker reads: module level, inside functions, and under
  ``if TYPE_CHECKING:``.
* Each package imports only the packages :data:`LAYERS` allows it (tests aside):
  the contract adapter authors import needs nothing above the harness; the
  runner, the cases and the self-test never import each other; the fuzz engine
  (``conformance.fuzz``) sits below the cases, which import it, and never
  imports them.
* No module imports a module path that moved (its one-line alias is for users' code).
* No module over :data:`MAX_MODULE_LINES` lines and no function over
  :data:`MAX_FUNCTION_LINES` (tests and golden text aside).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

ROOT = Path(__file__).resolve().parents[2]
#: The packages checked for import cycles.
IMPORT_PACKAGES = ("fsdp_impl", "harness", "conformance", "fixtures", "bench")
#: The packages checked for sizes (test modules excluded).
SIZE_PACKAGES = ("fsdp_impl", "harness", "conformance", "fixtures", "bench")
MAX_MODULE_LINES = 400
#: Package -> the other packages its modules may import, lowest layers first. A module's
#: package is its top-level package, or ``conformance.<sub>`` inside ``conformance``.
LAYERS: dict[str, frozenset[str]] = {
    "fsdp_impl": frozenset(),
    "harness": frozenset(),
    "conformance.contract": frozenset({"harness"}),
    "fixtures": frozenset({"harness", "conformance.contract"}),
    "conformance.adapters": frozenset({"conformance.contract", "fsdp_impl", "harness", "fixtures"}),
    "conformance.runner": frozenset({"conformance.contract", "harness"}),
    # The fuzz engine: ``conformance/cases/test_fuzz.py`` runs it; it never imports a case module.
    "conformance.fuzz": frozenset({"conformance.contract", "fixtures", "harness"}),
    "conformance.cases": frozenset({"conformance.contract", "conformance.fuzz", "fixtures", "harness"}),
    # The public-surface table reads torch and its own classification only.
    "conformance.surface": frozenset(),
    "conformance.selftest": frozenset({"conformance.contract", "conformance.adapters", "fsdp_impl", "harness",
                                       "fixtures"}),
    # ``python -m conformance`` is the CLI; the contract's old module paths alias it ([Note: moved modules]).
    "conformance": frozenset({"conformance.runner", "conformance.contract"}),
    "bench": frozenset({"conformance.contract", "conformance.runner", "fixtures", "harness", "fsdp_impl"}),
}
MAX_FUNCTION_LINES = 60


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every module under ``packages``."""
    return {
        _module_name(path): path
        for package in packages
        for path in sorted((ROOT / package).rglob("*.py"))
        if "__pycache__" not in path.parts
    }


def _imported(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``module`` imports anywhere in its file (function bodies and TYPE_CHECKING too).

    ``from package import name`` is an edge to ``package.name`` when that is a
    module, else to ``package`` itself. Parent packages' ``__init__`` are not
    counted as edges: importing ``a.b`` runs ``a/__init__`` first, but that is
    the package's own business, not a dependency of the importer on it.
    """
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                child = f"{base}.{alias.name}"
                out.add(child if child in known else base)
    return {name for name in out if name in known and name != module}


def import_graph(packages: tuple[str, ...] = IMPORT_PACKAGES) -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    known = _modules(packages)
    return {name: _imported(name, path, known) for name, path in known.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(component, graph) for component in components]


def _cycle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A concrete cycle through the component's first module (breadth-first, so a short one)."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for target in sorted(graph[node] & members):
            if target == start:
                return [*paths[node], start]
            if target not in paths:
                paths[target] = [*paths[node], target]
                queue.append(target)
    raise AssertionError(f"component {component} has no cycle through {start}")


def test_find_cycles_names_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_imports_see_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    graph = import_graph()
    assert "fsdp_impl.unit_state" in graph["fsdp_impl.unit"], graph["fsdp_impl.unit"]
    assert "fsdp_impl.unit" in graph["fsdp_impl.fully_sharded_data_parallel"]
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fsdp_impl import unit\n" \
             "def f():\n    import fsdp_impl.init\n"
    probe = tmp_path / "probe.py"
    probe.write_text(source)
    known = _modules(("fsdp_impl",))
    assert _imported("probe", probe, known) == {"fsdp_impl.unit", "fsdp_impl.init"}


def test_no_import_cycles() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_no_module_imports_a_moved_path() -> None:
    """The project imports every module by its path now: an old one kept for users' code
    (:data:`conformance.contract.moved.MOVED`, [Note: moved modules]) warns, and goes in a later version."""
    from conformance.contract.moved import MOVED
    from harness.moved import MOVED as HARNESS_MOVED

    moved = set(MOVED) | set(HARNESS_MOVED)
    graph = import_graph()
    found = [f"{module} imports {target}" for module, targets in sorted(graph.items())
             for target in sorted(targets & moved)]
    assert not found, "imports of moved paths (import the new one):\n" + "\n".join(found)


def package_of(module: str) -> str:
    """The :data:`LAYERS` key a module belongs to (``conformance.fuzz.model`` -> ``conformance.fuzz``)."""
    parts = module.split(".")
    if parts[0] == "conformance" and len(parts) > 1 and (ROOT / "conformance" / parts[1]).is_dir():
        return ".".join(parts[:2])
    return parts[0]


def _is_test_module(module: str) -> bool:
    return "tests" in module.split(".")


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """``a imports b`` for every import of a non-test module that :data:`LAYERS` does not allow."""
    found = []
    for module, targets in sorted(graph.items()):
        if _is_test_module(module):
            continue
        source = package_of(module)
        if source not in LAYERS:
            found.append(f"{module}: package {source} has no entry in LAYERS")
            continue
        found += [f"{module} imports {target}" for target in sorted(targets)
                  if package_of(target) != source and package_of(target) not in LAYERS[source]]
    return found


def test_layer_violations_are_named() -> None:
    graph = {"conformance.runner.cli": {"conformance.cases.test_x"}, "conformance.cases.test_x": {"harness.run"},
             "conformance.tests.test_y": {"conformance.selftest.declare"}, "conformance.__main__": {"fsdp_impl"}}
    assert layer_violations(graph) == ["conformance.__main__ imports fsdp_impl",
                                       "conformance.runner.cli imports conformance.cases.test_x"]


def test_the_fuzz_engine_sits_below_the_cases() -> None:
    """The case module imports the engine; the engine importing a case module is a violation."""
    graph = {"conformance.cases.test_fuzz": {"conformance.fuzz.driver"},
             "conformance.fuzz.neighbours": {"conformance.cases.test_placement", "fixtures.rank_settings"}}
    assert layer_violations(graph) == ["conformance.fuzz.neighbours imports conformance.cases.test_placement"]


def test_packages_import_only_lower_layers() -> None:
    violations = layer_violations(import_graph())
    assert not violations, "imports against conformance/tests/test_structure.py's LAYERS:\n" + "\n".join(violations)


def longest_chain(graph: dict[str, set[str]], package: str) -> list[str]:
    """The longest chain of imports inside ``package`` (its tests aside), importer first."""
    inside = {m for m in graph if (m == package or m.startswith(package + ".")) and ".tests" not in m}
    chains: dict[str, list[str]] = {}

    def chain(module: str) -> list[str]:
        if module not in chains:
            below = [chain(n) for n in sorted(graph[module] & inside) if n != module]
            chains[module] = [module, *max(below, key=len, default=[])]
        return chains[module]

    return max((chain(m) for m in sorted(inside)), key=len, default=[])


def test_longest_chain_follows_imports_inside_the_package() -> None:
    graph = {"p.a": {"p.b", "q.x"}, "p.b": {"p.c"}, "p.c": set(), "q.x": {"p.a"}, "p.tests.t": {"p.a"}}
    assert longest_chain(graph, "p") == ["p.a", "p.b", "p.c"]


def test_the_fuzz_engine_is_no_deeper_than_the_harness() -> None:
    """A reader following the fuzz engine's imports meets no longer chain than in the harness's."""
    graph = import_graph()
    fuzz, harness = longest_chain(graph, "conformance.fuzz"), longest_chain(graph, "harness")
    assert len(fuzz) <= len(harness), f"the fuzz engine's longest chain of imports: {' -> '.join(fuzz)}"


def _readme_layout() -> list[str]:
    """fsdp_impl's modules in the order of its README's layout table (lowest first)."""
    text = (ROOT / "fsdp_impl" / "README.md").read_text()
    return ["fsdp_impl." + name for name in re.findall(r"^\| `(\w+)\.py` \|", text, flags=re.MULTILINE)]


def test_fsdp_impl_imports_follow_its_readme_layout() -> None:
    """Each fsdp_impl module imports only modules listed above it in ``fsdp_impl/README.md``."""
    layout = _readme_layout()
    graph = import_graph(("fsdp_impl",))
    library = {name for name in graph if name != "fsdp_impl" and not name.startswith("fsdp_impl.tests")}
    assert set(layout) == library, f"README layout table vs modules: {sorted(set(layout) ^ library)}"
    upward = [
        f"{module} imports {target}, listed below it"
        for module in layout
        for target in sorted(graph[module])
        if target in layout and layout.index(target) > layout.index(module)
    ]
    assert not upward, "\n".join(upward)


def _checked_files() -> Iterator[Path]:
    for package in SIZE_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "tests" not in path.relative_to(ROOT).parts and "__pycache__" not in path.parts:
                yield path


def _long_functions(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno is not None
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_modules_are_small() -> None:
    long = [
        f"{path.relative_to(ROOT)} ({n} lines)"
        for path in _checked_files()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(long)


def test_functions_are_small() -> None:
    long = [entry for path in _checked_files() for entry in _long_functions(path)]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (signature and docstring included):\n" + "\n".join(
        long
    )
