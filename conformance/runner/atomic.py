"""Report files: paths checked before the run, written whole or not at all, one run per path.

[Note: report files]
- A report path is checked when the session is configured, before any case
  runs (:func:`check_path`): its directory is created, and a path that is a
  directory, lies under a file, or cannot be written (a temporary file is
  created there and removed, as the write will) is a usage error naming
  it and the option that gave it.
- A report is written to a temporary file in the same directory, flushed to
  disk and renamed over the path (:func:`write_atomic`): a reader sees the
  old file or the new one, never half of one, and a write that fails (a full
  disk) leaves the old file as it was.
- Two runs writing the same path: the second is refused (a usage error naming
  the path and the other run's pid) instead of both finishing and one run's
  rows being lost. The guard is an advisory lock (``fcntl.flock``) on
  ``PATH.lock``, held by the run from configuration until its reports are
  written; the kernel drops it if the run dies, so a killed run never leaves
  a path locked. The lock file is removed when the run ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from pathlib import Path

__all__ = ["ReportLock", "check_path", "write_atomic"]


def check_path(path: Path, option: str) -> None:
    """Create ``path``'s directory; raise ``ValueError`` naming ``path`` and ``option`` if a report cannot be
    written there."""
    if path.is_dir():
        raise ValueError(f"{option} {path}: is a directory; give a file path")
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"{option} {path}: {parent} is a file, not a directory")
        if parent.exists():
            break
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{option} {path}: cannot create its directory: {exc.strerror}") from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path}: directory {path.parent} is not writable")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{option} {path}: the existing file is not writable")
    try:  # what the write will do: a temporary file in the directory (os.access is no proof: root, /proc)
        fd, probe = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".probe")
    except OSError as exc:
        raise ValueError(f"{option} {path}: cannot create a file in {path.parent}: {exc.strerror}") from None
    os.close(fd)
    os.unlink(probe)


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` by a file holding ``text``, atomically ([Note: report files])."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as a plain open() would have created it
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class ReportLock:
    """This run's claim on a report path ([Note: report files])."""

    def __init__(self, path: Path, option: str) -> None:
        self.path = path.with_name(path.name + ".lock")
        for _ in range(3):  # another run may remove the file between our open and our lock
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise ValueError(f"{option} {path}: cannot create its lock file {self.path}: {exc.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise ValueError(f"{option} {path}: another run is writing this report (pid {holder}, lock "
                                 f"{self.path}); wait for it to end or choose another path") from None
            if _same_file(fd, self.path):
                os.ftruncate(fd, 0)
                os.write(fd, str(os.getpid()).encode())
                self.fd: int | None = fd
                return
            os.close(fd)
        raise ValueError(f"{option} {path}: could not lock {self.path}")

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent)."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False
