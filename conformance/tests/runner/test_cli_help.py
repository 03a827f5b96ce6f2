"""``fsdp-conformance --help`` answers at once (no torch, no pytest imported) and explains every option."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conformance.runner import cli

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]


def test_help_imports_neither_torch_nor_pytest() -> None:
    probe = ("import sys, contextlib, io\n"
             "from conformance.runner.cli import main\n"
             "for argv in (['--help'], ['run', '--help'], ['list', '--help']):\n"
             "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
             "        main(argv)\n"
             "print(sorted(m for m in ('torch', 'pytest', 'conformance.contract') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_every_option_is_explained() -> None:
    parser = cli._parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices  # type: ignore[union-attr]
    for name, sub in commands.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
    text = commands["run"].format_help()
    assert "median" in text and "timing cases" in text, "--timing-repeats must say what it repeats and why"
    assert "--case-timeout" in text and "--max-time" in text and "--rows-from" in text


def test_fuzz_verbose_is_forwarded_as_a_switch() -> None:
    args = cli._run_args(cli._parser().parse_args(["run", "--fuzz-verbose"]))
    assert args.count("--fsdp-fuzz-verbose") == 1 and "True" not in args
