"""Run directories in shared memory carry their owner (ckpt_transfer/owners.py): a later run on the host removes
what a killed run left, and nothing of a live run, another host's, or a directory without an owner."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

from ckpt_transfer.config import PublishConfig
from ckpt_transfer.owners import OWNER_FILE, claim, sweep_dead_runs
from ckpt_transfer.weight_sync import SharedMemorySync


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_runs_weights_are_swept_by_the_next_run_and_nothing_else(tmp_path):
    root = tmp_path / "shm"
    for name, owner in {"killed": {"host": socket.gethostname(), "pid": _dead_pid()},
                        "elsewhere": {"host": "another-host", "pid": _dead_pid()}}.items():
        (root / name / "0000001").mkdir(parents=True)
        (root / name / OWNER_FILE).write_text(json.dumps(owner))
    (root / "unowned" / "0000001").mkdir(parents=True)
    claim(root / "live")
    assert sweep_dead_runs(root) == ["killed"]
    assert sorted(p.name for p in root.iterdir()) == ["elsewhere", "live", "unowned"]
    # a weight sync does it when it opens, and claims its own run's directory
    (root / "killed2").mkdir()
    (root / "killed2" / OWNER_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid()}))
    sync = SharedMemorySync("twins-0123", PublishConfig(shm_root=str(root)), engines=1)
    assert sync.swept == ["killed2"] and json.loads((root / "twins-0123" / OWNER_FILE).read_text())["pid"] > 0
    sync.close()
    assert not (root / "twins-0123").exists()
