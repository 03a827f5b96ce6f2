"""The forkserver imports a session's rank-test modules before it forks ranks ([Note: preloaded task modules]),
except one that probes CUDA as it is imported; a session's processes are frozen at exit ([Note: frozen at
exit]). Each check needs a process of its own: its first session names the modules, its forkserver starts
once, and its exit is what is observed."""

from __future__ import annotations

import pytest
import torch

pytest_plugins = ["pytester"]  # on every torch: only a CUDA build has the probes the forkserver refuses

CONFTEST = '''
import atexit, gc, os

os.environ["SESSION_PID"] = str(os.getpid())  # the forkserver's parent: how test_failing knows it is there

def _report_freeze() -> None:  # registered before the plugin's handler, so it runs after it
    with open(os.environ["FREEZE_REPORT"], "w") as f:
        f.write(str(gc.get_freeze_count()))

atexit.register(_report_freeze)
'''

PLAIN = '''
import os, pytest

IMPORTED_BY = os.getpid()

@pytest.mark.ranks(world_size=2)
def test_imported_by_the_forkserver(ctx):
    assert IMPORTED_BY == os.getppid(), (IMPORTED_BY, os.getpid(), os.getppid())
'''

PROBING = '''
import os, pytest, torch

IMPORTED_BY = os.getpid()
HAS_GPU = torch.cuda.is_available()  # a probe at import, as a skip marker makes

@pytest.mark.ranks(world_size=2)
def test_imported_by_the_rank(ctx):
    assert IMPORTED_BY == os.getpid(), (IMPORTED_BY, os.getpid(), os.getppid())
'''

FAILING = '''
import os, pytest

if os.getppid() == int(os.environ["SESSION_PID"]):  # the forkserver, which the session started
    raise RuntimeError("this module cannot be imported by the forkserver")
IMPORTED_BY = os.getpid()

@pytest.mark.ranks(world_size=2)
def test_imported_by_the_rank(ctx):
    assert IMPORTED_BY == os.getpid(), (IMPORTED_BY, os.getpid(), os.getppid())
'''

#: Only a torch built with CUDA has the probes the forkserver refuses; a CPU build's ``is_available()``
#: answers without reaching a driver, so a module calling it is preloaded like any other.
CUDA_BUILD = hasattr(torch._C, "_cuda_getDeviceCount")


def test_rank_test_modules_are_imported_once_by_the_forkserver(pytester: pytest.Pytester,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank-test module is imported by the forkserver, so a rank (its child) finds it imported; one that
    probes CUDA at import is, on a CUDA build, left to each rank, and so is one whose import raises in the
    forkserver (which would otherwise end it, and every rank start after); the session's processes end frozen."""
    pytester.makeconftest(CONFTEST)
    # On a CPU build nothing is refused, so the probing module is preloaded like the plain one.
    probing = PROBING if CUDA_BUILD else PROBING.replace("IMPORTED_BY == os.getpid()", "IMPORTED_BY == os.getppid()")
    pytester.makepyfile(test_plain=PLAIN, test_probing=probing, test_failing=FAILING)
    report = pytester.path / "freeze.txt"
    monkeypatch.setenv("FREEZE_REPORT", str(report))
    result = pytester.runpytest_subprocess("-q", "-p", "conformance.pytest_plugin", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=6)
    assert int(report.read_text()) > 100_000, "the session's objects were not frozen at its exit"
