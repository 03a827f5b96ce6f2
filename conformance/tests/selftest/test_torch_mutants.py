"""The machinery of the torch mutant campaigns ([Note: torch mutants] in conformance/selftest/torch_mutants):
operators, enumeration and sampling, injection into spawned processes, verdicts, reports, the command line.

Everything here runs on small fixture modules written to ``tmp_path``; no test
reads or runs torch's FSDP sources (a campaign is a nightly command, not a test).
"""

from __future__ import annotations

import ast
import json
import multiprocessing
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from conformance.selftest.torch_mutants import campaign_cli
from conformance.selftest.torch_mutants.campaign import Campaign, Outcome, default_timeout
from conformance.selftest.torch_mutants.campaign_report import summary_line, to_json, to_table
from conformance.selftest.torch_mutants.catalog import PROBE, apply, enumerate_mutants, sample
from conformance.selftest.torch_mutants.injection import Markers, make_overlay, overlay_env, read_markers
from conformance.selftest.torch_mutants.suite_run import Selection, run_rows
from conformance.selftest.torch_mutants.verdicts import RunResult, classify

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

FIXTURE = '''"""A module docstring: 1 == 1."""
from typing import TYPE_CHECKING
import logging
import warnings

logger = logging.getLogger(__name__)
if TYPE_CHECKING:
    HIDDEN = 1 == 2


def scale(x: int = 3, flag: bool = True) -> int:
    """Docstring with True in it."""
    assert x != 7
    logger.debug("x is %s", x > 2)
    warnings.warn(f"{x == 4}")
    if x < 0 and flag:
        return 0
    while x >= 10:
        x = x - 5
    y = x * 2 if x in (1, 2) or not flag else None
    if (y
            is None):
        record(
            x,
        )
    return y


def record(value: int) -> None:
    value.bit_length()
'''


def _ids(source: str = FIXTURE) -> list[str]:
    return [mutant.id for mutant in enumerate_mutants(source, "fix")]


def test_every_mutant_of_the_fixture_compiles_and_keeps_the_line_count() -> None:
    mutants = enumerate_mutants(FIXTURE, "fix")
    assert len(mutants) > 15
    for mutant in mutants:
        for probe in (False, True):
            mutated = apply(FIXTURE, mutant, probe=probe)
            ast.parse(mutated)
            assert mutated.count("\n") == FIXTURE.count("\n"), mutant.id
            assert mutated != FIXTURE and (PROBE in mutated) == probe, mutant.id


@pytest.mark.parametrize("expected", [
    "fix:16:7:compare:x < 0 -> x >= 0",
    "fix:18:10:compare:x >= 10 -> x < 10",
    "fix:20:17:compare:x in (1, 2) -> x not in (1, 2)",
    "fix:21:8:compare:y is None -> y is not None",
    "fix:16:7:boolop:x < 0 and flag -> x < 0 or flag",
    "fix:20:17:boolop:x in (1, 2) or not flag -> x in (1, 2) and (not flag)",
    "fix:16:7:negate:x < 0 and flag -> not (x < 0 and flag)",
    "fix:20:17:negate:x in (1, 2) or not flag -> not (x in (1, 2) or not flag)",
    "fix:11:19:int:3 -> 4",
    "fix:11:19:int:3 -> 2",
    "fix:17:15:int:0 -> 1",
    "fix:11:35:bool:True -> False",
    "fix:19:12:arith:x - 5 -> x + 5",
    "fix:20:8:arith:x * 2 -> x / 2",
    "fix:23:8:delete:record(x) -> pass",
    "fix:30:4:delete:value.bit_length() -> pass",
    "fix:26:11:return:return y -> return None",
    "fix:17:15:return:return 0 -> return None",
])
def test_each_operator_yields_its_mutant(expected: str) -> None:
    assert expected in _ids()


def test_skipped_code_has_no_mutants() -> None:
    ids = _ids()
    lines = {int(mutant_id.split(":")[1]) for mutant_id in ids}
    # docstrings, TYPE_CHECKING, the annotations of line 11, assert, logging, warnings
    assert not lines & {1, 7, 8, 12, 13, 14, 15}, sorted(lines)
    assert "fix:16:11:int:0 -> -1" not in ids and "fix:17:15:int:0 -> -1" not in ids  # 0 only becomes 1
    assert not any(":negate:" in i and "x >= 10" in i for i in ids)  # one comparison: compare's flip covers it


def test_a_multi_line_span_is_replaced_whole() -> None:
    mutant = next(m for m in enumerate_mutants(FIXTURE, "fix") if m.id == "fix:21:8:compare:y is None -> y is not None")
    mutated = apply(FIXTURE, mutant).split("\n")
    assert mutated[20] == "    if ((y is not None"
    assert mutated[21] == ")):"


def _run_scale(source: str, *args: object) -> tuple[object, list[object]]:
    """What the fixture's ``scale(*args)`` returns in ``source``, and the values it passed to ``record``."""
    namespace: dict[str, object] = {}
    exec(compile(source, "fix", "exec"), namespace)
    calls: list[object] = []
    namespace["record"] = calls.append
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return namespace["scale"](*args), calls  # type: ignore[operator]


def test_a_deleted_call_does_nothing_and_the_rest_is_unchanged() -> None:
    mutant = next(m for m in enumerate_mutants(FIXTURE, "fix") if m.operator == "delete" and m.line == 23)
    assert _run_scale(FIXTURE, 5, True) == (None, [5])
    assert _run_scale(apply(FIXTURE, mutant), 5, True) == (None, [])
    assert _run_scale(apply(FIXTURE, mutant, probe=True).replace(f"{PROBE}()", "None"), 5, True) == (None, [])
    assert _run_scale(apply(FIXTURE, mutant), -3, True) == _run_scale(FIXTURE, -3, True) == (0, [])


def test_enumeration_is_deterministic_and_the_sample_seeded() -> None:
    assert _ids() == _ids()
    mutants = enumerate_mutants(FIXTURE, "fix")
    first, again, other = sample(mutants, 5, seed=1), sample(mutants, 5, seed=1), sample(mutants, 5, seed=2)
    assert first == again and len(first) == 5 and set(first) <= set(mutants)
    assert first != other
    assert [mutants.index(m) for m in first] == sorted(mutants.index(m) for m in first)
    assert sample(mutants, len(mutants) + 3, seed=1) == mutants


def _fixture_package(root: Path) -> Path:
    """``root/fixpkg/value.py``, whose ``answer()`` is 2; the file's path."""
    package = root / "fixpkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    path = package / "value.py"
    path.write_text("def answer() -> int:\n    return 1 + 1\n")
    return path


def _child(result: str) -> None:
    """Run in a spawned process: import the fixture module and write what ``answer()`` returns."""
    import fixpkg.value

    Path(result).write_text(json.dumps([fixpkg.value.answer(), fixpkg.value.__file__]))


def test_a_spawned_child_runs_the_mutant_and_the_file_is_untouched(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = _fixture_package(tmp_path / "src")
    before = path.read_bytes()
    mutant = next(m for m in enumerate_mutants(before.decode(), "fixpkg.value") if m.operator == "arith")
    overlay = make_overlay(tmp_path / "overlay", {"fixpkg.value": apply(before.decode(), mutant, probe=True)})
    env = overlay_env(overlay, {"PYTHONPATH": str(tmp_path / "src")})
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    monkeypatch.syspath_prepend(str(tmp_path / "src"))  # spawn gives the child this process's sys.path
    child = multiprocessing.get_context("spawn").Process(target=_child, args=(str(tmp_path / "result"),))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert json.loads((tmp_path / "result").read_text()) == [0, str(path)]  # 1 - 1, from the installed path
    assert path.read_bytes() == before and not list((path.parent / "__pycache__").glob("value.*"))
    markers = read_markers(overlay)
    assert [m["pid"] for m in markers.imported] == [child.pid] == [m["pid"] for m in markers.hits]
    assert markers.modules_imported() == {"fixpkg.value"} and not markers.import_errors


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_an_existing_sitecustomize_still_runs(tmp_path: Path) -> None:
    _fixture_package(tmp_path / "src")
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITE_RAN'] = 'yes'\n")
    overlay = make_overlay(tmp_path / "overlay", {"fixpkg.value": "def answer():\n    return 5\n"})
    env = overlay_env(overlay, {"PYTHONPATH": f"{other}:{tmp_path / 'src'}"})
    done = _python("import os, fixpkg.value; print(fixpkg.value.answer(), os.environ.get('OTHER_SITE_RAN'))", env)
    assert done.stdout.split() == ["5", "yes"], done.stderr


def test_a_module_that_raises_while_loading_is_marked(tmp_path: Path) -> None:
    _fixture_package(tmp_path / "src")
    overlay = make_overlay(tmp_path / "overlay", {"fixpkg.value": "raise RuntimeError('broken by the mutant')\n"})
    done = _python("import fixpkg.value", overlay_env(overlay, {"PYTHONPATH": str(tmp_path / "src")}))
    assert done.returncode != 0
    errors = read_markers(overlay).import_errors
    assert len(errors) == 1 and "broken by the mutant" in str(errors[0]["detail"])


def test_an_overlay_needs_an_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "overlay").mkdir()
    (tmp_path / "overlay" / "left.txt").write_text("")
    with pytest.raises(ValueError, match="overlay"):
        make_overlay(tmp_path / "overlay", {})


def _report(*cells: tuple[str, str]) -> dict[str, object]:
    return {"schema_version": 2, "rows": [{"case": case, "impl": "torch-fsdp2", "rank_mode": "process",
                                           "outcome": outcome} for case, outcome in cells]}


_LOADED = Markers(({"module": "m", "pid": 1},), (), ())
BASELINE = RunResult(1, False, 10.0, _report(("a/x", "pass"), ("a/y", "pass"), ("a/z", "FAIL")), _LOADED)


@pytest.mark.parametrize(("run", "verdict", "killers"), [
    (RunResult(1, False, 9.0, _report(("a/x", "pass"), ("a/y", "FAIL"), ("a/z", "FAIL")), _LOADED),
     "killed", ("a/y [process]: pass -> FAIL",)),
    (RunResult(1, False, 9.0, _report(("a/x", "error"), ("a/y", "pass"), ("a/z", "error")), _LOADED),
     "killed", ("a/x [process]: pass -> error", "a/z [process]: FAIL -> error")),
    (RunResult(1, False, 9.0, _report(("a/x", "pass"), ("a/y", "pass"), ("a/z", "FAIL")), _LOADED), "survived", ()),
    (RunResult(1, False, 9.0, _report(("a/x", "n/a"), ("a/y", "skip"), ("a/z", "FAIL")), _LOADED), "survived", ()),
    (RunResult(3, False, 9.0, None, _LOADED), "killed", ()),
    (RunResult(3, False, 9.0, _report(("a/x", "pass"), ("a/y", "pass"), ("a/z", "FAIL")), _LOADED), "killed", ()),
    (RunResult(1, False, 9.0, _report(("a/x", "pass"), ("a/z", "FAIL")), _LOADED), "killed", ()),
    (RunResult(None, True, 99.0, None, _LOADED), "timed out", ()),
    (RunResult(None, True, 99.0, _report(("a/x", "pass")), _LOADED), "timed out", ()),
    (RunResult(None, True, 99.0, _report(("a/x", "error")), _LOADED), "killed", ("a/x [process]: pass -> error",)),
    (RunResult(1, False, 9.0, _report(("a/x", "FAIL")), Markers((), (), ())), "not reached", ()),
    (RunResult(1, False, 9.0, _report(("a/x", "FAIL")), _LOADED, controller=1), "not reached", ()),
    (RunResult(1, False, 9.0, _report(("a/x", "FAIL")), _LOADED, controller=2),
     "killed", ("a/x [process]: pass -> FAIL",)),
    (RunResult(1, False, 9.0, None, Markers(_LOADED.imported, ({"module": "m", "detail": "E\nNameError: x"},), ())),
     "import-broken", ()),
])
def test_verdicts(run: RunResult, verdict: str, killers: tuple[str, ...]) -> None:
    got = classify(BASELINE, run)
    assert (got.verdict, got.killers) == (verdict, killers)
    assert bool(got.detail) == (verdict != "survived" and (not killers or run.timed_out))


def _known(case: str, outcome: str, finding: str | None) -> dict[str, object]:
    return {"case": case, "impl": "torch-fsdp2", "rank_mode": "process", "outcome": outcome, "finding": finding}


@pytest.mark.parametrize(("cells", "verdict", "killers"), [
    ((("a/k", "FAIL", None), ("a/x", "pass", None)), "killed", ("a/k [process]: FAIL (known: f.md) -> FAIL",)),
    ((("a/k", "FAIL", "f.md"), ("a/x", "pass", None)), "survived", ()),
    ((("a/k", "FAIL", "g.md"), ("a/x", "pass", None)), "survived", ()),
    ((("a/k", "FAIL", "f.md"), ("a/x", "FAIL", "f.md")), "killed", ("a/x [process]: pass -> FAIL (known: f.md)",)),
])
def test_a_row_past_a_known_finding_kills_with_a_failure_of_its_own(
        cells: tuple[tuple[str, str, str | None], ...], verdict: str, killers: tuple[str, ...]) -> None:
    """A cell FAILing for a registered finding in the baseline (a stateful row that met one) still kills when
    the mutant makes it FAIL for a reason no finding explains; another known finding does not kill."""
    baseline = RunResult(1, False, 9.0, {"schema_version": 2, "rows": [_known("a/k", "FAIL", "f.md"),
                                                                        _known("a/x", "pass", None)]}, _LOADED)
    run = RunResult(1, False, 9.0, {"schema_version": 2, "rows": [_known(*cell) for cell in cells]}, _LOADED)
    got = classify(baseline, run)
    assert (got.verdict, got.killers) == (verdict, killers)


def test_no_verdict_without_a_baseline_report() -> None:
    with pytest.raises(ValueError, match="baseline"):
        classify(RunResult(3, False, 1.0, None, _LOADED), BASELINE)


def _campaign() -> Campaign:
    mutants = enumerate_mutants(FIXTURE, "fix")[:3]
    runs = [RunResult(1, False, 9.0, _report(("a/x", "FAIL"), ("a/y", "pass"), ("a/z", "FAIL")),
                      Markers(_LOADED.imported, (), ({"pid": 1},))),
            RunResult(1, False, 9.0, BASELINE.report, _LOADED),
            RunResult(None, True, 40.0, None, _LOADED)]
    outcomes = tuple(Outcome(m, run, classify(BASELINE, run)) for m, run in zip(mutants, runs, strict=True))
    return Campaign(Selection("torch-fsdp2", "reshard"), 7, 40, default_timeout(BASELINE), BASELINE, outcomes, 70.0)


def test_the_reports_count_and_name_the_killers() -> None:
    campaign = _campaign()
    line = summary_line(campaign)
    assert line.startswith("torch mutants (torch-fsdp2): 1 killed, 1 survived, 1 timed out, 0 not reached, "
                           "0 import-broken of 3 sampled from 40 (seed 7, rows 'reshard')")
    assert "score 33% of judged" in line and default_timeout(BASELINE) == 60.0
    table = to_table(campaign)
    assert "killed by a/x [process]: pass -> FAIL" in table
    document = to_json(campaign, {"torch": "x"})
    assert document["counts"]["killed"] == 1 and document["baseline"]["cells"] == 3
    assert [m["executed"] for m in document["mutants"]] == [True, False, False]
    assert json.loads(json.dumps(document)) == document


class _Sleeper(Selection):
    def command(self, report: Path) -> list[str]:
        return [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_run_over_its_limit_is_stopped(tmp_path: Path) -> None:
    overlay = make_overlay(tmp_path / "overlay", {})
    result = run_rows(_Sleeper("torch-fsdp2"), overlay, tmp_path / "run", timeout_s=0.5)
    assert result.timed_out and result.returncode is None and result.report is None and result.wall_s < 20


@pytest.mark.parametrize(("args", "named"), [
    (["--impl", "torch-fsdp3"], "unknown --impl 'torch-fsdp3'"),
    (["--impl", "torch-fsdp2", "--sample", "0"], "bad --sample '0'"),
    (["--impl", "torch-fsdp2", "--sample", "many"], "bad --sample 'many'"),
    (["--impl", "torch-fsdp2", "--timeout-s", "-1"], "bad --timeout-s '-1'"),
    (["--impl", "torch-fsdp1", "--module", "torch.distributed.fsdp._nowhere"],
     "--module 'torch.distributed.fsdp._nowhere' is not a target module of torch-fsdp1"),
])
def test_bad_input_is_named(args: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        campaign_cli.main(args)
    assert stopped.value.code == 2 and named in capsys.readouterr().err


def test_a_used_out_directory_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "old.json").write_text("{}")
    with pytest.raises(SystemExit) as stopped:
        campaign_cli.main(["--impl", "torch-fsdp1", "--out", str(tmp_path)])
    assert stopped.value.code == 2 and f"--out {str(tmp_path)!r}" in capsys.readouterr().err
