"""The project's own tests do not depend on which other adapters the environment installs.

docs/ADAPTER_GUIDE.md tells adapter authors to install their package, with its
``fsdp_conformance.adapters`` entry point, into the same environment; the
registry then lists it (and ``all`` may include it). The tests about the
built-in adapters must still pass there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import conformance

PROJECT = Path(conformance.__file__).resolve().parents[1]


def test_declarations_pass_with_a_third_party_adapter_installed(tmp_path: Path) -> None:
    dist = tmp_path / "third_party_fsdp-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: third-party-fsdp\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[fsdp_conformance.adapters]\nthird-party = third_party_fsdp:Adapter\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    listed = subprocess.run([sys.executable, "-m", "conformance", "impls"], env=env, capture_output=True, text=True,
                            timeout=300, check=False)
    assert "third-party" in listed.stdout, "the fake distribution must be visible, or this test proves nothing"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(PROJECT / "conformance" / "tests" / "test_declarations.py")],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
