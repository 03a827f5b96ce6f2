"""Row ids, the settings resolver and CaseReport, as plain functions."""

from __future__ import annotations

import pytest

from conformance.contract.case import CaseSettings
from conformance.contract.results import CaseReport
from conformance.contract.rows import format_row_id, parse_row_id, row_matches
from conformance.runner.settings import (
    FUZZ_EXAMPLES_ENV,
    FUZZ_SEED_ENV,
    FUZZ_VERBOSE_ENV,
    IMPL_ENV,
    TIMING_REPEATS_ENV,
    SettingError,
    resolve_settings,
)
from harness.setting_sources import Resolved

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

NO_CLI: dict[str, tuple[str, object]] = {}
#: The rank mode is the harness's to resolve; the runner takes it as given.
BOTH = Resolved("rank mode", "both", "default")


def test_row_ids_name_their_parameters_in_declaration_order() -> None:
    row = format_row_id("checkpoint/wrapping", {"nesting": "roots", "cpu_offload": True, "strategy": None, "n": 3})
    assert row == "checkpoint/wrapping[nesting=roots,cpu_offload=True,strategy=None,n=3]"
    assert parse_row_id(row) == ("checkpoint/wrapping",
                                 {"nesting": "roots", "cpu_offload": "True", "strategy": "None", "n": "3"})
    assert format_row_id("misc/no_grid", {}) == "misc/no_grid"
    assert format_row_id("misc/cls", {"kind": CaseReport}) == "misc/cls[kind=CaseReport]"


def test_a_value_that_would_make_the_id_ambiguous_is_refused() -> None:
    with pytest.raises(ValueError, match=r"parameter mode='a,b': a row-id value may not contain ','"):
        format_row_id("misc/x", {"mode": "a,b"})
    with pytest.raises(ValueError, match="is not name=value"):
        parse_row_id("misc/x[flag]")


def test_patterns_match_a_subset_of_parameters_in_any_order() -> None:
    row = "checkpoint/wrapping[nesting=under_root,use_orig_params=True,offload_activations=False]"
    assert row_matches(row, "checkpoint/wrapping")
    assert row_matches(row, "checkpoint/wrapping[offload_activations=False,nesting=under_root]")
    assert not row_matches(row, "checkpoint/wrapping[offload_activations=True]")
    assert not row_matches(row, "checkpoint/wrap")
    assert not row_matches("placement/device_id_auto_wrap[kind=transformer]", "placement/device_id")
    assert row_matches(row, "checkpoint/*") and not row_matches(row, "misc/*")


def test_settings_defaults_and_sources() -> None:
    settings = resolve_settings(NO_CLI, rank_mode=BOTH, env={})
    assert settings.impls.value == ("reference",) and settings.impls.source == "default"
    assert settings.rank_mode is BOTH and settings.timing_repeats.value == 3
    assert (settings.fuzz_examples.value, settings.fuzz_seed.value, settings.fuzz_verbose.value) == (None, 0, False)
    env = {IMPL_ENV: "torch-fsdp2, reference", TIMING_REPEATS_ENV: "5", FUZZ_EXAMPLES_ENV: "40",
           FUZZ_SEED_ENV: "7", FUZZ_VERBOSE_ENV: "1"}
    from_env = resolve_settings(NO_CLI, rank_mode=BOTH, env=env)
    assert from_env.impls.value == ("torch-fsdp2", "reference") and from_env.impls.source == IMPL_ENV
    assert (from_env.timing_repeats.value, from_env.timing_repeats.source) == (5, TIMING_REPEATS_ENV)
    assert from_env.for_cases() == CaseSettings(timing_repeats=5, fuzz_examples=40, fuzz_seed=7, fuzz_verbose=True)
    assert "fuzz seed: 7 (from FSDP_FUZZ_SEED)" in from_env.describe()


def test_command_line_wins_over_environment() -> None:
    cli = {"impls": ("--impl", ["torch-fsdp1"]), "timing_repeats": ("--timing-repeats", 2),
           "fuzz_seed": ("--fuzz-seed", "3"), "fuzz_verbose": ("--fuzz-verbose", False)}
    settings = resolve_settings(cli, rank_mode=BOTH, env={IMPL_ENV: "reference", FUZZ_SEED_ENV: "9",
                                                          FUZZ_VERBOSE_ENV: "1"})
    assert settings.impls.value == ("torch-fsdp1",) and settings.impls.source == "--impl"
    assert settings.timing_repeats.value == 2 and settings.fuzz_seed.describe() == "fuzz seed: 3 (from --fuzz-seed)"
    assert settings.fuzz_verbose.value is False  # a given switch wins over the environment


def test_implementations_split_on_commas_from_every_source() -> None:
    for given in (["reference,torch-fsdp1"], ["reference", "torch-fsdp1"], ["reference, torch-fsdp1"]):
        settings = resolve_settings({"impls": ("--impl", given)}, rank_mode=BOTH, env={})
        assert settings.impls.value == ("reference", "torch-fsdp1"), given


def test_bad_values_name_their_source() -> None:
    with pytest.raises(SettingError, match=r"^FSDP_CONFORMANCE_IMPL='nope': unknown implementation\(s\) \['nope'\]"):
        resolve_settings(NO_CLI, rank_mode=BOTH, env={IMPL_ENV: "nope"})
    with pytest.raises(SettingError, match=r"^--timing-repeats=0: expected a whole number >= 1$"):
        resolve_settings({"timing_repeats": ("--timing-repeats", 0)}, rank_mode=BOTH, env={})
    with pytest.raises(SettingError, match=r"^FSDP_CONFORMANCE_TIMING_REPEATS='x': expected a whole number"):
        resolve_settings(NO_CLI, rank_mode=BOTH, env={TIMING_REPEATS_ENV: "x"})
    with pytest.raises(SettingError, match=r"^FSDP_FUZZ_EXAMPLES='many': expected a whole number >= 1$"):
        resolve_settings(NO_CLI, rank_mode=BOTH, env={FUZZ_EXAMPLES_ENV: "many"})
    with pytest.raises(SettingError, match=r"^FSDP_FUZZ_VERBOSE='yes': expected one of 0, 1$"):
        resolve_settings(NO_CLI, rank_mode=BOTH, env={FUZZ_VERBOSE_ENV: "yes"})


def test_case_report_refuses_what_the_matrix_cannot_show() -> None:
    assert CaseReport(reason="ok", metrics={"ms": 1.5}).metrics["ms"] == 1.5
    with pytest.raises(TypeError, match=r"metrics\['ms'\] = '1': expected a str name and a number"):
        CaseReport(metrics={"ms": "1"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"metrics\['ms'\] = nan"):
        CaseReport(metrics={"ms": float("nan")})


def test_the_usage_guide_lists_every_fsdp_variable_the_code_reads() -> None:
    """Every ``"FSDP_..."`` string in the packages (but a Python constant's name in ``__all__``) names a
    variable docs/USAGE.md mentions, and its settings tables list nothing the code does not read."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    sources = [path for package in ("fsdp_impl", "harness", "conformance", "fixtures", "bench")
               for path in (root / package).rglob("*.py") if "tests" not in path.parts]
    texts = [path.read_text() for path in sources]
    constants = {name for text in texts for name in re.findall(r"^(FSDP_[A-Z_]+)\s*[:=]", text, flags=re.MULTILINE)}
    read = {name for text in texts for name in re.findall(r"[\"'](FSDP_[A-Z_]+)[\"']", text)} - constants
    readme = (root / "docs" / "USAGE.md").read_text()
    listed = set(re.findall(r"^\| `(FSDP_[A-Z_]+)` \|", readme, flags=re.MULTILINE))
    mentioned = set(re.findall(r"`(FSDP_[A-Z_]+)`", readme))
    assert "FSDP_RANK_MODE" in read and len(listed) >= 10
    missing = sorted(read - mentioned)
    assert not missing, f"FSDP_* variables read by the code but missing from docs/USAGE.md's settings: {missing}"
    unknown = sorted(listed - read)
    assert not unknown, f"docs/USAGE.md's settings tables list variables nothing reads: {unknown}"


def test_one_table_makes_both_command_lines_and_the_usage_rows() -> None:
    """[Note: one table of options]: docs/USAGE.md's settings rows are the table's, in its order; every option
    the table gives the suite's plugin is a pytest option of the plugin, and every one is a flag of
    ``fsdp-conformance run`` that forwards as the table says."""
    from pathlib import Path

    from conformance.runner import cli
    from conformance.runner.options import OPTIONS, usage_rows
    from harness.ranks.devices import SETTINGS

    usage = (Path(__file__).resolve().parents[3] / "docs" / "USAGE.md").read_text()
    rows = usage_rows()
    assert "\n".join(rows) in usage, "docs/USAGE.md's settings rows differ from conformance.runner.options.usage_rows()"
    assert next(o for o in OPTIONS if o.name == "device").metavar == "|".join(SETTINGS)
    given = {"impls": ["reference", "torch-fsdp2"], "rank_mode": "thread", "device": "cpu", "timing_repeats": "5",
             "case_timeout": "9", "max_time": "99", "fuzz_examples": "2", "fuzz_seed": "3", "fuzz_verbose": True,
             "fuzz_stateful_examples": "4", "fuzz_shrink": "0", "workers": "2", "world_size": "3"}
    assert set(given) == {o.name for o in OPTIONS}
    argv = ["run"]
    for option in OPTIONS:
        value = given[option.name]
        argv += ([option.run_flag] if value is True else
                 [part for item in value for part in (option.run_flag, item)] if isinstance(value, list) else
                 [option.run_flag, value])
    forwarded = cli._run_args(cli._parser().parse_args(argv))
    for option in OPTIONS:
        value = given[option.name]
        want = ([option.pytest_flag] if value is True else
                [part for item in value for part in (option.pytest_flag, item)] if isinstance(value, list) else
                [option.pytest_flag, value])
        start = forwarded.index(want[0])
        assert forwarded[start:start + len(want)] == want, (option.name, forwarded)
