"""Row ids, the settings resolver and CaseReport, as plain functions."""

from __future__ import annotations

import pytest

from conformance.contract.results import CaseReport
from conformance.contract.rows import format_row_id, parse_row_id, row_matches
from conformance.runner.settings import IMPL_ENV, TIMING_REPEATS_ENV, SettingError, resolve_settings

NO_CLI: dict[str, tuple[str, object]] = {}


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
    assert not row_matches("misc/device_id_auto_wrap[kind=transformer]", "misc/device_id")
    assert row_matches(row, "checkpoint/*") and not row_matches(row, "misc/*")


def test_settings_defaults_and_sources() -> None:
    settings = resolve_settings(NO_CLI, env={})
    assert settings.impls.value == ("reference",) and settings.impls.source == "default"
    assert settings.rank_mode.value == "both" and settings.timing_repeats.value == 3
    env = {IMPL_ENV: "torch-fsdp2, reference", "FSDP_RANK_MODE": "thread", TIMING_REPEATS_ENV: "5"}
    from_env = resolve_settings(NO_CLI, env=env)
    assert from_env.impls.value == ("torch-fsdp2", "reference") and from_env.impls.source == IMPL_ENV
    assert (from_env.rank_mode.value, from_env.rank_mode.source) == ("thread", "FSDP_RANK_MODE")
    assert (from_env.timing_repeats.value, from_env.timing_repeats.source) == (5, TIMING_REPEATS_ENV)
    assert "rank mode: thread (from FSDP_RANK_MODE)" in from_env.describe()


def test_command_line_wins_over_environment() -> None:
    cli = {"impls": ("--impl", ["torch-fsdp1"]), "rank_mode": ("--rank-mode", "process"),
           "timing_repeats": ("--timing-repeats", 2)}
    settings = resolve_settings(cli, env={IMPL_ENV: "reference", "FSDP_RANK_MODE": "thread"})
    assert settings.impls.value == ("torch-fsdp1",) and settings.impls.source == "--impl"
    assert settings.rank_mode.value == "process" and settings.timing_repeats.value == 2


def test_bad_values_name_their_source() -> None:
    with pytest.raises(SettingError, match=r"^FSDP_CONFORMANCE_IMPL='nope': unknown implementation\(s\) \['nope'\]"):
        resolve_settings(NO_CLI, env={IMPL_ENV: "nope"})
    with pytest.raises(SettingError, match=r"^--timing-repeats=0: expected a whole number >= 1$"):
        resolve_settings({"timing_repeats": ("--timing-repeats", 0)}, env={})
    with pytest.raises(SettingError, match=r"^FSDP_CONFORMANCE_TIMING_REPEATS='x': expected a whole number"):
        resolve_settings(NO_CLI, env={TIMING_REPEATS_ENV: "x"})


def test_case_report_refuses_what_the_matrix_cannot_show() -> None:
    assert CaseReport(reason="ok", metrics={"ms": 1.5}).metrics["ms"] == 1.5
    with pytest.raises(TypeError, match=r"metrics\['ms'\] = '1': expected a str name and a number"):
        CaseReport(metrics={"ms": "1"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"metrics\['ms'\] = nan"):
        CaseReport(metrics={"ms": float("nan")})
