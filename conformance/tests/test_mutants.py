"""Every case fails against a reference with the behaviour it checks broken.

Each mutant (``conformance/mutants/``) runs in its own pytest session, since
it patches the reference in-process. Each mutant's ``expect`` says which cases
must turn into FAIL; a case that still passes is not testing what it claims.
Patch targets and expectations are checked without running anything first.

Placement mutants are only visible on GPU rows: on a CPU-only machine the CPU is
both where ``device_id`` points and where a module falls back to, so the CPU
variants of the device rows (``device_id_auto_wrap``, ``device_id_cpu_offload``,
``ignored_params_not_moved``) cannot tell a correct placement from a broken one.
Those expectations declare the GPUs they need and skip here with the reason;
the nightly GPU job runs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from conformance.case import CaseSpec, accelerator_skip_reason
from conformance.cli import CASES_DIR
from conformance.mutants import MUTANTS, Expect, Patch, check_declaration
from conformance.mutants._base import apply_patches
from conformance.rows import parse_row_id, row_matches

#: mutant name -> the cases that must report FAIL against it (declared on each mutant).
EXPECTED: dict[str, Expect] = {name: cls.expect for name, cls in MUTANTS.items()}


def _run(mutant: str, expect: Expect, tmp_path: Path) -> list[dict]:
    report = tmp_path / f"{mutant}.json"
    env = {**os.environ, "FSDP_CONFORMANCE_ADAPTERS": ",".join(
        f"{name}=conformance.mutants:{cls.__name__}" for name, cls in MUTANTS.items())}
    # Only the modules declaring the expected cases are collected (a session per mutant: each
    # module it need not import saves that start-up); a pattern naming no declared case still
    # collects every module, so the staleness check below reports it.
    cases = {parse_row_id(pattern)[0] for pattern in expect.must_fail}
    files = sorted({DECLARED_IN[c] for c in cases}) if cases <= DECLARED_IN.keys() else [str(CASES_DIR)]
    cmd = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider",
           "--fsdp-impl", mutant, "--rank-mode", expect.rank_mode, "-k", expect.keyword,
           "--conformance-json", str(report)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(report.read_text())


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


def _marks(expect: Expect, specs: dict[str, CaseSpec]) -> list[pytest.MarkDecorator]:
    """gpu where the mutant needs accelerators; timing where it runs a timing case (alone under -n)."""
    timing = any(specs[case].timing for case in (parse_row_id(p)[0] for p in expect.must_fail) if case in specs)
    return [pytest.mark.gpu] * bool(expect.accelerators) + [pytest.mark.timing] * timing


@pytest.mark.parametrize(
    "mutant",
    [pytest.param(name, marks=_marks(EXPECTED[name], DECLARED)) for name in sorted(EXPECTED)],
)
def test_mutant_is_caught(mutant: str, tmp_path: Path) -> None:
    expect = EXPECTED[mutant]
    hardware = accelerator_skip_reason(expect.accelerators)
    if hardware is not None:
        pytest.skip(hardware)
    rows = _run(mutant, expect, tmp_path)
    unmatched = [p for p in expect.must_fail if not any(row_matches(r["case"], p) for r in rows)]
    assert not unmatched, f"no case matched {unmatched}; the expectation table is stale"
    selected = [r for r in rows if any(row_matches(r["case"], p) for p in expect.must_fail)]
    missed = [f"{r['case']} ({r['outcome']})" for r in selected if r["outcome"] != "FAIL"]
    assert not missed, f"{mutant} ({MUTANTS[mutant].breaks}) was not caught by: {missed}"


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
        expect = Expect("k", "thread", ("misc/no_params",))
        patches = (Patch.instead(target, None),)

    with pytest.raises(LookupError, match=f"mutant Stale: patch target '{target}'"):
        check_declaration(Stale)


def test_a_malformed_target_is_rejected() -> None:
    with pytest.raises(ValueError, match="'fsdp_impl.unit._final_callback' is not 'module:name'"):
        Patch.instead("fsdp_impl.unit._final_callback", None).resolve()


def test_the_first_patch_of_a_target_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Thread ranks share one process: a second rank's patch must not wrap the first one's."""
    module = types.ModuleType("mutant_patch_probe")
    module.f = lambda: 1  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    double = Patch("mutant_patch_probe:f", lambda original: lambda: 2 * original())
    apply_patches((double,))
    apply_patches((double,))
    assert module.f() == 2  # type: ignore[attr-defined]


def test_a_mutant_without_expectation_is_rejected() -> None:
    class Undeclared:
        patches = ()

    with pytest.raises(TypeError, match="mutant Undeclared declares no `expect"):
        check_declaration(Undeclared)


def _declared_cases() -> dict[str, int]:
    """Every declared case id -> the accelerators it needs."""
    return {case: spec.accelerators for case, spec in DECLARED.items()}


def test_expectations_name_declared_cases() -> None:
    """Expectations that skip here (GPU) still have to name real cases, checked without running them."""
    ids = set(_declared_cases())
    assert "misc/device_id_auto_wrap_gpu" in ids, sorted(ids)
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
    cpu_only_by_gpu = sorted(case for case, gpus in cases.items() if gpus == 0 and 0 not in covered[case])
    assert not cpu_only_by_gpu, f"CPU cases whose only mutants need a GPU: {cpu_only_by_gpu}"
