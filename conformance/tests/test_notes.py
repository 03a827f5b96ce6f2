"""Every note a reader is sent to (a reference: the note's name after ``Note:``, in square brackets) exists:
a line of a Python module holding the reference alone, in a docstring or after ``#``, followed by its text.
References are counted in the project's Python modules and Markdown documents; each note is defined once."""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

ROOT = Path(__file__).resolve().parents[2]
_NOTE = re.compile(r"\[Note: ([^\]]+)\]")
_DEFINITION = re.compile(r"^\s*(?:#\s*)?\[Note: ([^\]]+)\]\s*$")
_WRAP = re.compile(r"\s*\n\s*(?:#\s*|>\s*)?")  # a reference wrapped over lines of a comment, a docstring or a quote


def _files(*patterns: str) -> list[Path]:
    listed = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / name for name in listed.stdout.split()]


def _definitions() -> Counter[str]:
    return Counter(match.group(1) for path in _files("*.py")
                   for line in path.read_text(encoding="utf-8").splitlines()
                   if (match := _DEFINITION.match(line)))


def test_every_note_referenced_is_defined_once() -> None:
    defined = _definitions()
    assert defined, "no note found: the pattern no longer matches how notes are written"
    sources = [path for path in _files("*.py", "*.md") if path != Path(__file__).resolve()]  # its patterns aside
    missing = sorted({f"{path.relative_to(ROOT)}: {name}" for path in sources
                      for name in _NOTE.findall(_WRAP.sub(" ", path.read_text(encoding="utf-8")))
                      if name not in defined})
    assert not missing, f"references to notes that no module defines: {missing}"
    twice = sorted(name for name, count in defined.items() if count > 1)
    assert not twice, f"notes defined more than once: {twice}"
