"""Hypothesis's caches go to the user's cache directory, not ``.hypothesis/`` in the working directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

DRAW = ("from conformance.fuzz.example import examples\n"
        "from conformance.fuzz.driver import keep_hypothesis_out_of_cwd\n"
        "from hypothesis import find, settings\n"
        "if {keep}:\n"
        "    keep_hypothesis_out_of_cwd()\n"
        "find(examples(world_size=2), lambda e: True, settings=settings(database=None))\n")


def _draw(cwd: Path, cache: Path, *, keep: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_STORAGE_DIRECTORY"}
    env["XDG_CACHE_HOME"] = str(cache)
    subprocess.run([sys.executable, "-c", DRAW.format(keep=keep)], cwd=cwd, env=env, check=True, timeout=300,
                   capture_output=True)


def test_the_fuzzer_keeps_hypothesis_out_of_the_working_directory(tmp_path: Path) -> None:
    plain, kept, cache = tmp_path / "plain", tmp_path / "kept", tmp_path / "cache"
    plain.mkdir()
    kept.mkdir()
    _draw(plain, cache, keep=False)
    assert (plain / ".hypothesis").exists(), "hypothesis no longer writes to the cwd: this test proves nothing"
    _draw(kept, cache, keep=True)
    assert not (kept / ".hypothesis").exists()
    assert (cache / "fsdp-conformance" / "hypothesis").is_dir()
