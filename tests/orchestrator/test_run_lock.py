"""One live run per run directory (orchestrator/records/run_lock.py): a second taker is refused with the holder's pid
while the holder lives, the directory is free again once it ends however it ends, and the attempts a supervisor starts
share its hold; `tide run` and `tide resume` on a held directory exit 2 before anything starts."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from orchestrator.records.rundir import RunDir
from orchestrator.records.run_lock import INHERITED_ENV, RunDirBusy, hold_run_dir
from orchestrator.run.supervisor import Supervisor

ROOT = Path(__file__).resolve().parents[2]
HOLDER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from orchestrator.records.run_lock import hold_run_dir
    hold_run_dir({run!r})
    print("held", flush=True)
    time.sleep(600)
""")


def _holder(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER.format(root=str(ROOT), run=str(run_dir))],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_holder_refuses_others_and_its_death_frees_the_directory(tmp_path):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(RunDirBusy, match=rf"{tmp_path} is in use by a live run \(pid {proc.pid}\)"):
            hold_run_dir(tmp_path)
    finally:
        proc.send_signal(signal.SIGKILL)  # no clean-up of its own: the kernel releases the lock
        proc.wait()
    fd = hold_run_dir(tmp_path)
    assert (tmp_path / "lock").read_text() == f"{os.getpid()}\n"
    os.close(fd)


def test_the_cli_refuses_a_held_run_directory_before_starting_anything(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("name: held\niterations: 1\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("name: held\niterations: 1\n")
    proc = _holder(run_dir)
    try:
        for args in (["run", str(config), "--run-dir", str(run_dir)], ["resume", str(run_dir)]):
            out = subprocess.run([sys.executable, "-m", "orchestrator.run.cli", *args], capture_output=True, text=True,
                                 cwd=ROOT, timeout=120)
            assert out.returncode == 2, out.stderr
            assert f"{run_dir} is in use by a live run (pid {proc.pid})" in out.stderr
    finally:
        proc.kill()
        proc.wait()
    assert not (run_dir / "status.json").exists()


def test_a_supervisors_attempts_share_its_hold(tmp_path):
    run = RunDir(tmp_path / "run")
    run.hold()
    fd = run.lock_fd
    script = tmp_path / "attempt.py"
    # an attempt takes the directory as a driver does: through the descriptor it inherited, not a second lock
    script.write_text(f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
                      f"from orchestrator.records.run_lock import hold_run_dir\n"
                      f"assert hold_run_dir({str(run.path)!r}) == {fd}\n")
    assert Supervisor(run.path, 0, 0.0, driver=(sys.executable, str(script)), lock_fd=fd).run([]) == 0
    os.environ[INHERITED_ENV] = str(fd + 1000)  # a stale or foreign number is not taken for the lock
    try:
        assert _holder_refused(run.path)
    finally:
        del os.environ[INHERITED_ENV]
    os.close(fd)


def _holder_refused(path: Path) -> bool:
    try:
        os.close(hold_run_dir(path))
    except RunDirBusy:
        return True
    return False
