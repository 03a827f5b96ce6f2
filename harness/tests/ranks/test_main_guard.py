"""A script that calls harness.run without the main-module guard gets the spawn advice ([Note: main-module guard])."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

SCRIPT = '''
import harness

def body(ctx):
    return ctx.rank

def main():
    print(harness.run(body, world_size=2, mode="{mode}", timeout_s=60))

{call}
'''


def _script(tmp_path: Path, mode: str, call: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "script.py"
    path.write_text(SCRIPT.format(mode=mode, call=call))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_an_unguarded_call_gets_the_spawn_advice(tmp_path: Path, mode: str) -> None:
    done = _script(tmp_path, mode, "main()")
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: ") and 'without the `if __name__ == "__main__":` idiom' in last, done.stderr
    assert "script.py:10 calls harness.run" in last, "the line of the unguarded top-level call"
    assert "died" not in done.stderr and "unknown" not in done.stderr


def test_a_guarded_call_runs(tmp_path: Path) -> None:
    done = _script(tmp_path, "thread", 'if __name__ == "__main__":\n    main()')
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[0, 1]"


def test_a_package_main_is_not_refused(tmp_path: Path) -> None:
    """``python -m pkg`` runs ``pkg/__main__.py``, which multiprocessing's children never re-import."""
    package = tmp_path / "runs_ranks"
    package.mkdir()
    (package / "__init__.py").write_text("def body(ctx):\n    return ctx.rank\n")
    (package / "__main__.py").write_text("import harness\nfrom runs_ranks import body\n"
                                         "print(harness.run(body, world_size=2, mode='thread', timeout_s=60))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    done = subprocess.run([sys.executable, "-m", "runs_ranks"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[0, 1]"
