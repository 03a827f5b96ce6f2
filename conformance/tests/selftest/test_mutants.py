"""Every case fails against a reference with the behaviour it checks broken.

Each mutant (``conformance/selftest/mutants/``) declares which cases must turn into FAIL
against it; a case that still passes is not testing what it claims. Mutants run
in batches, a pytest session per batch: those declared in one module with the
same rank mode, GPU need and timing need. Each batch session selects, for each
of its mutants, only the rows its keyword names (``-k "(m1 and (kw1)) or ..."``,
one ``--fsdp-impl`` per mutant); a mutant's patches last one case (the harness's
per-case reset reverts them), so its neighbours in the session run against the
reference they expect. Batching spares each mutant a session's start-up (its
interpreter's and its rank pool's torch imports, about 6 s on a 2-core box).
``-k <module>`` selects the batches holding a module's mutants (``-k runtime``; a
batch's id names its modules and rank mode, e.g. ``precision+runtime+sharing-thread``).
Patch targets and expectations are checked without running anything first. The
batches are marked ``nightly`` ([Note: nightly tests] in ``conformance/tests/__init__.py``):
``pytest --nightly`` runs them.

Placement mutants are only visible on GPU rows: on a CPU-only machine the CPU is
both where ``device_id`` points and where a module falls back to, so the CPU
variants of the device rows (``device_id_auto_wrap``, ``device_id_cpu_offload``,
``ignored_params_not_moved``) cannot tell a correct placement from a broken one.
Those expectations declare the GPUs they need and skip here with the reason;
the nightly GPU job runs them.
"""

from __future__ import annotations

import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

from conformance.contract.case import CaseSpec
from conformance.contract.rows import parse_row_id
from conformance.runner.cli import CASES_DIR
from conformance.selftest import apply_patches, problems_of, revert_patches, run_session
from conformance.selftest.mutants import MUTANTS, Expect, Patch, check_declaration
from harness.ranks import devices

#: mutant name -> the cases that must report FAIL against it (declared on each mutant).
EXPECTED: dict[str, Expect] = {name: cls.expect for name, cls in MUTANTS.items()}


def _declared_specs() -> tuple[dict[str, CaseSpec], dict[str, str]]:
    """Every declared case id -> its declaration, and -> the path of the module declaring it."""
    import importlib

    specs, modules = {}, {}
    for path in sorted(CASES_DIR.glob("test_*.py")):
        module = importlib.import_module(f"conformance.cases.{path.stem}")
        for fn in vars(module).values():
            for mark in getattr(fn, "pytestmark", ()):
                if mark.name == "conformance":
                    specs[mark.args[0].id] = mark.args[0]
                    modules[mark.args[0].id] = str(path)
    return specs, modules


#: Every declared case id -> its declaration; -> the module file declaring it.
DECLARED, DECLARED_IN = _declared_specs()


def _runs_timing_case(expect: Expect) -> bool:
    cases = (parse_row_id(pattern)[0] for pattern in expect.must_fail)
    return any(DECLARED[case].timing for case in cases if case in DECLARED)


@dataclass(frozen=True)
class Batch:
    """Mutants whose cases run in one pytest session."""

    name: str
    mutants: tuple[str, ...]
    rank_mode: str
    accelerators: int
    timing: bool
    timing_repeats: int | None = None
    stateful_examples: int | None = None

    def marks(self) -> list[pytest.MarkDecorator]:
        """nightly ([Note: nightly tests]); gpu where the mutants need accelerators; timing where they run a
        timing case (alone under -n)."""
        return [pytest.mark.nightly] + [pytest.mark.gpu] * bool(self.accelerators) + [pytest.mark.timing] * self.timing

    def keyword(self) -> str:
        """Each mutant's own rows: its adapter's name (in every row id) and its keyword."""
        return " or ".join(f"({name} and ({EXPECTED[name].keyword}))" for name in self.mutants)

    def case_files(self) -> list[str]:
        """The modules declaring the expected cases (each module not imported saves start-up); every
        module if a pattern names no declared case, so the staleness check reports it."""
        cases = {parse_row_id(p)[0] for name in self.mutants for p in EXPECTED[name].must_fail}
        return sorted({DECLARED_IN[c] for c in cases}) if cases <= DECLARED_IN.keys() else [str(CASES_DIR)]


#: Declaring modules per batch session: each session pays its interpreter's and its rank pools' start-up once
#: (about 7 CPU-seconds on a 2-core box), and two xdist workers still get several sessions to balance.
MODULES_PER_BATCH = 3


def _session_key(name: str) -> tuple[str, int, bool, int, int]:
    """What a batch's session shares: rank mode, GPUs, timing phase, timing repeats, stateful fuzz budget."""
    expect = EXPECTED[name]
    return (expect.rank_mode, expect.accelerators, _runs_timing_case(expect), expect.timing_repeats or 0,
            expect.stateful_examples or 0)


def _module(name: str) -> str:
    return MUTANTS[name].__module__.rsplit(".", 1)[-1]


def _batches() -> list[Batch]:
    groups: dict[tuple[str, int, bool, int, int], list[str]] = {}
    for name in sorted(EXPECTED, key=lambda n: (_module(n), n)):
        groups.setdefault(_session_key(name), []).append(name)
    batches = []
    for (mode, gpus, timing, repeats, programs), names in sorted(groups.items()):
        modules = sorted({_module(n) for n in names})
        for start in range(0, len(modules), MODULES_PER_BATCH):
            chunk = modules[start:start + MODULES_PER_BATCH]
            label = "-".join(["+".join(chunk), mode, *([f"gpu{gpus}"] if gpus else []),
                              *(["timing"] if timing else []), *([f"repeats{repeats}"] if repeats else []),
                              *([f"programs{programs}"] if programs else [])])
            batches.append(Batch(label, tuple(n for n in names if _module(n) in chunk), mode, gpus, timing,
                                 repeats or None, programs or None))
    return batches


BATCHES = _batches()


def _spec(name: str) -> str:
    """What ``FSDP_CONFORMANCE_ADAPTERS`` registers mutant ``name`` as."""
    return f"conformance.selftest.mutants:{MUTANTS[name].__name__}"


def _run(batch: Batch, tmp_path: Path) -> list[dict]:
    # A mutant is caught when its rows FAIL; shrinking a fuzz row's failure cannot change that ([Note: unshrunk
    # failures] in conformance/fuzz/driver.py).
    options = ["--fsdp-fuzz-shrink", "0"]
    options += [] if batch.timing_repeats is None else ["--fsdp-timing-repeats", str(batch.timing_repeats)]
    if batch.stateful_examples is not None:
        options += ["--fsdp-fuzz-stateful-examples", str(batch.stateful_examples)]
    return run_session({name: _spec(name) for name in batch.mutants}, {name: EXPECTED[name] for name in batch.mutants},
                       report=tmp_path / f"{batch.name}.json", files=batch.case_files(), options=options)


@pytest.mark.parametrize("batch", [pytest.param(b, id=b.name, marks=b.marks()) for b in BATCHES])
def test_mutants_are_caught(batch: Batch, tmp_path: Path) -> None:
    found = devices.visible_gpus()
    if found < batch.accelerators:
        pytest.skip(f"needs {batch.accelerators} GPUs, found {found}")
    rows = _run(batch, tmp_path)
    problems = [f"{problem} [breaks {MUTANTS[name].breaks}]"
                for name in batch.mutants for problem in problems_of(name, EXPECTED[name], rows)]
    assert not problems, "\n".join(problems)


@pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]
def test_a_mutants_patches_end_with_its_row(tmp_path: Path) -> None:
    """In one session, a patching mutant's row is followed by the reference's, which must pass.

    ``mutant-assumes-parameters`` passes ``ignored_params_not_moved`` (its patch
    is harmless there) and fails ``no_params``; it runs each case's rows before the
    reference (its ``--fsdp-impl`` comes first). Had the patch outlived the mutant's
    ``no_params`` row, the reference's ``no_params`` row, next in the same rank
    processes (or thread host), would fail.
    """
    mutant = "mutant-assumes-parameters"
    options = ["--fsdp-impl", "reference", "--fsdp-rank-mode", "both",
               "-k", "(ignored_params_not_moved and not gpu) or (no_params and False)"]
    report = run_session({mutant: _spec(mutant)}, {mutant: EXPECTED[mutant]}, report=tmp_path / "r.json",
                         files=[DECLARED_IN["placement/no_params"]], options=options)
    rows = [(r["case"].split("[")[0], r["impl"], r["rank_mode"], r["outcome"]) for r in report]
    assert rows == [(case, impl, mode, "FAIL" if (case, impl) == ("placement/no_params", mutant) else "pass")
                    for case in ("placement/ignored_params_not_moved", "placement/no_params")
                    for mode in ("process", "thread") for impl in (mutant, "reference")], rows


def test_batches_hold_every_mutant_once() -> None:
    """Each batch shares what its session runs with: rank mode, GPUs, timing phase, timing repeats."""
    names = [name for batch in BATCHES for name in batch.mutants]
    assert sorted(names) == sorted(EXPECTED)
    for batch in BATCHES:
        for name in batch.mutants:
            expect = EXPECTED[name]
            assert (expect.rank_mode, expect.accelerators, _runs_timing_case(expect), expect.timing_repeats,
                    expect.stateful_examples) == (batch.rank_mode, batch.accelerators, batch.timing,
                                                  batch.timing_repeats, batch.stateful_examples), (batch.name, name)


def test_every_mutant_declares_an_expectation() -> None:
    missing = sorted(name for name, cls in MUTANTS.items() if not isinstance(getattr(cls, "expect", None), Expect))
    assert not missing, f"mutants without `expect = Expect(...)`: {missing}"


def test_patch_targets_resolve() -> None:
    """Every patch target names an attribute that exists now (fast: nothing is patched)."""
    stale = []
    for name, cls in MUTANTS.items():
        for patch in getattr(cls, "patches", ()):
            try:
                owner, attr, original = patch.resolve()
            except (LookupError, TypeError, ValueError) as exc:
                stale.append(f"{name}: {exc}")
                continue
            assert getattr(owner, attr) is original, (name, patch.target)
    assert not stale, "stale patch targets:\n" + "\n".join(stale)


@pytest.mark.parametrize(
    "target",
    ["fsdp_impl.unit:_no_such_function", "fsdp_impl.no_such_module:f", "fsdp_impl.flat_param:FlatParamHandle.nope"],
)
def test_a_stale_target_is_named_at_declaration(target: str) -> None:
    class Stale:
        expect = Expect("k", "thread", ("placement/no_params",))
        patches = (Patch.instead(target, None),)

    with pytest.raises(LookupError, match=f"mutant Stale: patch target '{target}'"):
        check_declaration(Stale)


def test_a_malformed_target_is_rejected() -> None:
    with pytest.raises(ValueError, match="'fsdp_impl.unit._final_callback' is not 'module:name'"):
        Patch.instead("fsdp_impl.unit._final_callback", None).resolve()


def _probe_module(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType("mutant_patch_probe")
    module.f = lambda: 1  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


_DOUBLE = Patch("mutant_patch_probe:f", lambda original: lambda: 2 * original())


def test_the_first_patch_of_a_target_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Thread ranks share one process: a second rank's patch must not wrap the first one's."""
    module = _probe_module(monkeypatch)
    try:
        apply_patches((_DOUBLE,))
        apply_patches((_DOUBLE,))
        assert module.f() == 2  # type: ignore[attr-defined]
    finally:
        revert_patches()
    assert module.f() == 1  # type: ignore[attr-defined]


def test_patches_last_until_the_case_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness's per-case reset puts the originals back: the next mutant's case starts clean."""
    from harness.ranks.reset import process_global_scope

    module = _probe_module(monkeypatch)
    original = module.f  # type: ignore[attr-defined]
    with process_global_scope(None):
        apply_patches((_DOUBLE,))
        assert module.f() == 2  # type: ignore[attr-defined]
    assert module.f is original  # type: ignore[attr-defined]
    with process_global_scope(None):  # a later case patches afresh
        apply_patches((_DOUBLE,))
        assert module.f() == 2  # type: ignore[attr-defined]
    assert module.f is original  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank_mode": "both"}, "rank_mode must be one of process, thread, got 'both'"),
        ({"must_fail": ()}, "'k': must_fail names no case"),
        ({"accelerators": -1}, "'k': accelerators must be >= 0, got -1"),
        ({"timing_repeats": 0}, "'k': timing_repeats must be >= 1, got 0"),
        ({"stateful_examples": 0}, "'k': stateful_examples must be >= 1, got 0"),
    ],
)
def test_a_malformed_expectation_names_the_bad_value(kwargs: dict, message: str) -> None:
    fields = {"keyword": "k", "rank_mode": "thread", "must_fail": ("placement/no_params",), **kwargs}
    with pytest.raises(ValueError, match=re.escape(message)):
        Expect(**fields)


def test_a_mutant_without_expectation_is_rejected() -> None:
    class Undeclared:
        patches = ()

    with pytest.raises(TypeError, match="mutant Undeclared declares no `expect"):
        check_declaration(Undeclared)


def _declared_cases() -> dict[str, bool]:
    """Every declared case id -> whether it has CPU rows (a ``gpus`` function of the grid may give both)."""
    return {case: spec.gpus is None or callable(spec.gpus) for case, spec in DECLARED.items()}


def test_expectations_name_declared_cases() -> None:
    """Expectations that skip here (GPU) still have to name real cases, checked without running them."""
    ids = set(_declared_cases())
    assert "placement/device_id_auto_wrap" in ids, sorted(ids)
    stale = [(mutant, prefix) for mutant, expect in EXPECTED.items() for prefix in expect.must_fail
             if parse_row_id(prefix)[0] not in ids]
    assert not stale, f"expectations naming no declared case: {stale}"


def test_every_case_has_a_mutant() -> None:
    """Each case is caught by some mutant; a case that runs on CPU by one that runs on CPU."""
    covered: dict[str, set[int]] = {}
    for expect in EXPECTED.values():
        for pattern in expect.must_fail:
            covered.setdefault(parse_row_id(pattern)[0], set()).add(expect.accelerators)
    cases = _declared_cases()
    uncaught = sorted(case for case in cases if case not in covered)
    assert not uncaught, f"cases no mutant is expected to fail: {uncaught}"
    cpu_only_by_gpu = sorted(case for case, has_cpu_rows in cases.items() if has_cpu_rows and 0 not in covered[case])
    assert not cpu_only_by_gpu, f"CPU cases whose only mutants need a GPU: {cpu_only_by_gpu}"
