"""Who a run's directory in shared memory belongs to: `<root>/<run>/owner.json` names the driver's host and pid,
so that a later run on the host removes what a run killed outright (SIGKILL, the OOM killer) left there. Runs are
keyed by run (the config's name and the run directory's id), never reused by a later run: without the sweep a
killed run's weights would stay in /dev/shm until the machine restarts."""
from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

OWNER_FILE = "owner.json"


def claim(run_root: Path) -> None:
    """Record this process (on this host) as the owner of `run_root`, creating it."""
    run_root.mkdir(parents=True, exist_ok=True)
    tmp = run_root / (OWNER_FILE + ".tmp")
    tmp.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    tmp.replace(run_root / OWNER_FILE)


def sweep_dead_runs(root: Path) -> list[str]:
    """Remove the run directories under `root` whose owner, on this host, is no longer alive; their names.
    Directories without an owner, or owned on another host, are left alone."""
    removed = []
    for run_root in sorted(root.iterdir()) if root.is_dir() else []:
        try:
            owner = json.loads((run_root / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if owner.get("host") != socket.gethostname() or _owner_alive(owner.get("pid")):
            continue
        shutil.rmtree(run_root, ignore_errors=True)
        removed.append(run_root.name)
    return removed


def _owner_alive(pid: object) -> bool:
    return pid_alive(pid) if isinstance(pid, int) else True  # unreadable: not ours to judge


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host: signal 0 reaches it, or is refused because another user owns
    it (the one liveness test of a pid written in a record: run owners here, the run directory's driver)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
