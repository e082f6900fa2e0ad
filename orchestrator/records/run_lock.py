"""One live run per run directory: the run holds RUN_DIR/lock (an flock, released by the kernel when the holder
exits, however it ends) for its whole life, so a second `tide run`/`tide resume` on the same directory is refused
while the first lives, instead of both appending to its files and overwriting its checkpoints.

Under `--max-restarts` the supervisor holds it and hands the same open file to each attempt (its descriptor
inherited, named by TIDE_RUN_LOCK_FD), so that no other run can take the directory between a fault and the restart.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = "lock"
INHERITED_ENV = "TIDE_RUN_LOCK_FD"


class RunDirBusy(RuntimeError):
    """Another live process holds the run directory."""


def hold_run_dir(run_dir: Path) -> int:
    """Take `run_dir` for this process (and its children); the lock's descriptor, open until the process ends.
    RunDirBusy names the live holder's pid."""
    path = Path(run_dir) / LOCK_FILE
    inherited = _inherited(path)
    if inherited is not None:
        return inherited
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunDirBusy(f"{run_dir} is in use by a live run (pid {holder}): wait for it to end, or choose "
                         f"another --run-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _inherited(path: Path) -> int | None:
    """The lock's descriptor when the supervisor that started this process holds it for us."""
    value = os.environ.get(INHERITED_ENV, "")
    if not value.isdigit():
        return None
    try:
        mine, theirs = os.fstat(int(value)), os.stat(path)
    except OSError:
        return None
    return int(value) if (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino) else None
