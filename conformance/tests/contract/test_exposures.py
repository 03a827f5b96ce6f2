"""Behaviour rows run once per parameter exposure the implementation offers ([Note: parameter exposures])."""

from __future__ import annotations

import pytest

from conformance.adapters.reference import ReferenceAdapter
from conformance.adapters.torch_fsdp2 import TorchFSDP2Adapter
from conformance.contract.exposures import parameter_exposures, under_exposure


def test_flat_parameters_only_where_declared() -> None:
    assert parameter_exposures(ReferenceAdapter()) == (True, False)
    assert parameter_exposures(TorchFSDP2Adapter()) == (True,)


def test_a_failure_names_its_exposure_and_keeps_its_type() -> None:
    with pytest.raises(AssertionError, match=r"^use_orig_params=False: grads differ$"), under_exposure(False):
        raise AssertionError("grads differ")
    with pytest.raises(RuntimeError, match="must be 2-D") as info, under_exposure(True):
        raise RuntimeError("'weight' must be 2-D")
    assert info.value.__notes__ == ["(raised under use_orig_params=True)"]
