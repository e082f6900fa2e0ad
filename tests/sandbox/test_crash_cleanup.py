"""A service killed mid-run leaves a container, slot cgroups and state behind; the next start removes them."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sandbox.client import SandboxClient

pytestmark = [pytest.mark.root, pytest.mark.timeout(120)]
REPO = Path(__file__).resolve().parents[2]
STATE = Path("/run/tide-sandbox-crashtest")


def _start(port: int) -> tuple[subprocess.Popen, SandboxClient]:
    proc = subprocess.Popen([sys.executable, "-m", "sandbox.cli", "serve", "--port", str(port), "--pool-size", "1",
                             "--state-dir", str(STATE), "--log-level", "warning"], cwd=REPO)
    c = SandboxClient(f"http://127.0.0.1:{port}", retries=0)
    try:
        c.wait_ready(timeout_s=60)
    except Exception:
        proc.kill()
        raise
    return proc, c


def _uid_procs(service_pid: int) -> list[int]:
    """Live (non-zombie) sandbox-user processes in the slots of the service with this pid."""
    out = []
    for d in os.listdir("/proc"):
        try:
            if not d.isdigit() or os.stat(f"/proc/{d}").st_uid != 65534:
                continue
            if f"tide-sandbox-{service_pid}-slot" in Path(f"/proc/{d}/cgroup").read_text():
                out.append(int(d))
        except OSError:
            pass
    return out


def test_restart_cleans_up_after_a_crash(service):  # `service`: skips without root/crun, like the others
    import socket

    from sandbox.cgroups import CgroupPool, detect

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc, c = _start(port)
    def long_run() -> None:
        try:
            c.run("bash", "sleep 60", limits={"timeout_s": 60})
        except Exception:  # the service is killed under it: expected
            pass

    threading.Thread(target=long_run, daemon=True).start()
    deadline = time.monotonic() + 30
    while c.health().busy == 0 or not _uid_procs(proc.pid):
        assert time.monotonic() < deadline, "the long run never started"
        time.sleep(0.05)
    dead = proc.pid
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    pool = CgroupPool(detect(), 0)
    assert pool.owned_by(dead) and (STATE / str(dead)).exists() and _uid_procs(dead)

    proc2, c2 = _start(port)
    try:
        assert not pool.owned_by(dead), "slot cgroups of the dead service remain"
        assert not (STATE / str(dead)).exists(), "state of the dead service remains"
        deadline = time.monotonic() + 10
        while _uid_procs(dead) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _uid_procs(dead), "the dead service's container still runs"
        assert c2.run("bash", "echo alive").stdout == "alive\n"
    finally:
        proc2.send_signal(signal.SIGTERM)
        proc2.wait(timeout=30)
    assert not pool.owned_by(proc2.pid) and not (STATE / str(proc2.pid)).exists()
    STATE.rmdir()  # empty once both services are gone; leave nothing in /run


def test_a_service_whose_parent_dies_shuts_down_and_cleans_up(service):
    """`--parent-pid` (how a run starts its own service): the parent SIGKILLed, the service stops by itself,
    its slot cgroups and state removed, as on SIGTERM."""
    import socket

    from rollout.engine_proc import pids_alive, wait_gone
    from sandbox.cgroups import CgroupPool, detect

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    starter = ("import os, subprocess, sys, time\n"
               f"p = subprocess.Popen([sys.executable, '-m', 'sandbox.cli', 'serve', '--port', '{port}', "
               f"'--pool-size', '1', '--state-dir', '{STATE}', '--log-level', 'warning', "
               "'--parent-pid', str(os.getpid())], start_new_session=True)\n"
               "print(p.pid, flush=True)\n"
               "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", starter], cwd=REPO, stdout=subprocess.PIPE, text=True)
    served = int(parent.stdout.readline())
    try:
        with SandboxClient(f"http://127.0.0.1:{port}", retries=0) as c:
            c.wait_ready(timeout_s=60)
            assert c.run("bash", "echo alive").stdout == "alive\n"
        pool = CgroupPool(detect(), 0)
        assert pool.owned_by(served) and (STATE / str(served)).exists()
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        # a re-parented service is reaped by whoever adopts it, maybe never in a container: a zombie counts as gone
        assert not wait_gone([served], 30), "the service outlived the process that started it by 30 s"
        assert not pool.owned_by(served), "slot cgroups of the service remain"
        assert not (STATE / str(served)).exists(), "state of the service remains"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if pids_alive([served]):
            os.kill(served, signal.SIGKILL)
    STATE.rmdir()
