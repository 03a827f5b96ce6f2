"""Every row that wraps asks ``supports_strategy`` for the strategies it uses, the default included; user names
of buffers do not hang on a wrapper's attribute names ([Note: a row's strategies] in conformance.contract.case).

The acceptance test runs the rows that wrap with the default strategy (accumulation, state dicts, activation
checkpointing, unit outputs, the fuzz reproducers) and the stateful fuzzer against a DDP-like adapter that
refuses every sharding strategy and holds the model as ``self.module``
(:mod:`conformance.tests.adapters.ddp_like_adapter`): none may fail for a strategy it refuses or for a name, and every
row ``list --impl`` previews as ``n/a`` is ``n/a`` in the run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from conformance.contract.adapter import DEFAULT_STRATEGY, WrapSpec
from conformance.contract.applicability import not_applicable_reason
from conformance.contract.case import CaseSpec
from conformance.contract.declared import DeclaredAdapter, UndeclaredStrategy
from conformance.fuzz.controls import user_buffers
from conformance.runner import cli
from conformance.runner.listing import collect_rows
from conformance.tests.adapters.ddp_like_adapter import REFUSED, DataParallelWrapper, DDPLikeAdapter
from harness.tests.inprocess import run_main

ADAPTERS = "ddp-like=conformance.tests.adapters.ddp_like_adapter:DDPLikeAdapter"
#: Rows that wrap with the default strategy, and the stateful fuzzer (buffer names behind ``self.module``).
SELECTION = "grad_accumulation or state_dict or checkpoint or unit_outputs or repro or stateful"


def test_a_row_declaring_no_strategy_wraps_with_the_default() -> None:
    assert WrapSpec().strategy == DEFAULT_STRATEGY
    assert CaseSpec(id="a/b").strategies_for({}) == [DEFAULT_STRATEGY]
    assert CaseSpec(id="a/b").strategies_for({"strategy": "NO_SHARD"}) == ["NO_SHARD"]
    assert CaseSpec(id="a/b", strategies=("SHARD_GRAD_OP",)).strategies_for({}) == ["SHARD_GRAD_OP"]
    assert CaseSpec(id="a/b", strategies=()).strategies_for({}) == []
    assert CaseSpec(id="a/b", draws_strategies=("FULL_SHARD", "NO_SHARD")).strategies_for({}) == []
    with pytest.raises(ValueError, match="strategies \\['SHARDED'\\] not in"):
        CaseSpec(id="a/b", strategies=("SHARDED",))


def test_default_and_drawn_strategies_decide_applicability() -> None:
    adapter = DDPLikeAdapter()
    params = {"rank_mode": "process"}
    assert not_applicable_reason(CaseSpec(id="a/b"), adapter, params) == (
        "ddp-like does not support strategy FULL_SHARD")
    assert not_applicable_reason(CaseSpec(id="a/b", strategies=()), adapter, params) is None
    assert not_applicable_reason(CaseSpec(id="a/b"), adapter, {**params, "strategy": None}) is None
    assert not_applicable_reason(CaseSpec(id="a/b", draws_strategies=("FULL_SHARD", "NO_SHARD")), adapter,
                                 params) is None
    assert not_applicable_reason(CaseSpec(id="a/b", draws_strategies=("FULL_SHARD",)), adapter, params) == (
        "ddp-like supports none of the strategies a/b draws from (FULL_SHARD)")


def test_an_undeclared_refused_strategy_is_an_error_in_the_case() -> None:
    guarded = DeclaredAdapter(DDPLikeAdapter(), [], "demo/forgets", strategies=["NO_SHARD"])
    with pytest.raises(UndeclaredStrategy, match="case demo/forgets wraps with strategy FULL_SHARD, which ddp-like "
                                                 "does not support and the row does not declare"):
        guarded.wrap(nn.Linear(2, 2), WrapSpec())


def test_buffer_names_do_not_hang_on_wrapper_attribute_names() -> None:
    """A wrapper holding the model as ``self.module`` (DDP's name, no leading ``_``) names no user buffer."""
    user = nn.Sequential(nn.BatchNorm1d(3), nn.Sequential(nn.BatchNorm1d(3)))
    want = {name: buf.detach().clone() for name, buf in user.named_buffers()}
    names = {module: path for path, module in user.named_modules()}
    user[1] = DataParallelWrapper(user[1])
    wrapped = DataParallelWrapper(user)
    assert {n.split(".")[0] for n, _ in wrapped.named_buffers()} == {"module"}
    got = user_buffers(wrapped, want, names)
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value)


def test_ddp_like_adapter_rows_are_na_not_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in os.environ if name.startswith("FSDP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("FSDP_CONFORMANCE_ADAPTERS", ADAPTERS)
    preview = {row.row_id: row.not_applicable.get("thread") for row in collect_rows(SELECTION, impl="ddp-like")}
    out = tmp_path / "r.json"
    run = run_main(cli.main, "run", "--impl", "ddp-like", "--rank-mode", "thread", "-k", SELECTION,
                   "--json", str(out))
    rows = {row["case"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(preview), "list --impl and run select different rows"
    bad = {case: row["reason"] for case, row in rows.items() if row["outcome"] in ("FAIL", "error")
           and any(word in row["reason"] for word in (REFUSED, "UndeclaredStrategy", "names differ"))}
    assert not bad, f"rows failing for a refused strategy or a name: {bad}"
    predicted = {case for case, reason in preview.items() if reason is not None}
    assert predicted, "the DDP-like adapter refuses sharding: rows wrapping with it must be previewed n/a"
    assert {case: rows[case]["outcome"] for case in predicted if rows[case]["outcome"] != "n/a"} == {}
    assert all(rows[case]["reason"] == preview[case] for case in predicted)
    stateful = [row["outcome"] for case, row in rows.items() if case.startswith("fuzz/stateful_")]
    assert stateful and set(stateful) == {"pass"}, run.stdout[-3000:]
