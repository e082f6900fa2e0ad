"""One sandbox service per test session, plus probes of everything a run could leave behind."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STATE_DIR = Path("/run/tide-sandbox-tests")
TOKEN = "test-token"
POOL, QUEUE = 4, 8
SESSIONS = 256  # the test service's --max-sessions
SANDBOX_UID = 65534


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root (cgroups, overlayfs, namespaces)"
    if not shutil.which("crun"):
        return "crun is not installed (apt-get install crun)"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "kernel has no overlayfs"
    return None


SKIP_REASON = _why_not()
# A Debian rootfs built by scripts/build_sandbox_rootfs.sh, if there is one: served as image "debian".
ROOTFS = next((p.parent for p in sorted(Path("/var/lib/tide-sandbox/rootfs").glob("*/.tide-rootfs"))), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Service:
    url: str
    pid: int
    proc: subprocess.Popen
    log: Path

    def snapshot(self) -> dict[str, object]:
        """What a finished run must not leave: processes, cgroups, mounts, files, fds."""
        # The service keeps its state on a tmpfs in its own mount namespace: look through its root.
        state = Path(f"/proc/{self.pid}/root") / STATE_DIR.relative_to("/") / str(self.pid)
        return {
            "descendants": _descendants(self.pid),
            "sandbox_uid_procs": _uid_procs(SANDBOX_UID, self.pid),
            "mounts": len(Path(f"/proc/{self.pid}/mountinfo").read_text().splitlines()),
            "cgroups": _pool_cgroups(self.pid),
            "slot_procs": _slot_procs(self.pid),
            "state_files": sorted(str(p.relative_to(state)) for p in state.rglob("*") if "images" not in p.parts),
            "crun_state": sorted(os.listdir(state / "crun")),
            "fds": len(os.listdir(f"/proc/{self.pid}/fd")),
        }

    def assert_unchanged(self, before: dict[str, object]) -> None:
        after = self.snapshot()
        # Keep-alive sockets of earlier clients may close in between: fds may only go down.
        assert after.pop("fds") <= before["fds"], (after, before)  # type: ignore[operator]
        assert after == {k: v for k, v in before.items() if k != "fds"}


def _procs() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, uid) of every live process."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            st = Path(f"/proc/{d}/status").read_text()
        except OSError:
            continue
        f = dict(line.split(":", 1) for line in st.splitlines() if ":" in line)
        out[int(d)] = (int(f["PPid"].strip()), int(f["Uid"].split()[0]))
    return out


def _descendants(root: int) -> list[int]:
    procs = _procs()
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return sorted(out)


def _uid_procs(uid: int, service_pid: int) -> list[int]:
    """Processes running as the sandbox user that belong to this service: its descendants, or anything in
    one of its slot cgroups. (Other sandbox services on a shared machine run as the same uid.)"""
    mine = set(_descendants(service_pid))
    tag = f"tide-sandbox-{service_pid}-slot"
    out = []
    for p, (_, u) in _procs().items():
        if u != uid:
            continue
        try:
            in_slot = tag in Path(f"/proc/{p}/cgroup").read_text()
        except OSError:
            continue
        if in_slot or p in mine:
            out.append(p)
    return sorted(out)


def _slot_dirs(pid: int) -> list[Path]:
    from sandbox.cgroups import CgroupPool, detect

    return CgroupPool(detect(proc_cgroup=f"/proc/{pid}/cgroup"), 0).owned_by(pid)


def _pool_cgroups(pid: int) -> list[str]:
    dirs = _slot_dirs(pid)
    return sorted([str(d) for d in dirs] + [str(p) for d in dirs for p in d.rglob("*") if p.is_dir()])


def _slot_procs(pid: int) -> list[int]:
    return sorted(int(p) for d in _slot_dirs(pid) for p in (d / "cgroup.procs").read_text().split() if int(p) != pid)


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory) -> Service:
    if SKIP_REASON:
        pytest.skip(SKIP_REASON)
    port = free_port()
    log = tmp_path_factory.mktemp("sandbox") / "service.log"
    # The environment systemd gives a Type=notify, socket-activated service: the sandbox must not pass
    # any of it (or the token) on to crun or the containers (tests/sandbox/test_hostile.py, host-env).
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path_factory.mktemp("notify") / "notify.sock"))
    env = dict(os.environ, TIDE_SANDBOX_TOKEN=TOKEN, NOTIFY_SOCKET=notify.getsockname(), LISTEN_FDS="2",
               LISTEN_PID="1")
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sandbox.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--pool-size", str(POOL), "--max-queue", str(QUEUE), "--max-sessions", str(SESSIONS),
             "--state-dir", str(STATE_DIR),
             "--log-level", "warning", *(["--rootfs", f"debian={ROOTFS}"] if ROOTFS else []),
             *os.environ.get("TIDE_SANDBOX_TEST_ARGS", "").split()],  # e.g. "--no-pivot"
            cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env)
    from sandbox.client import SandboxClient

    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    with SandboxClient(url, token=TOKEN) as c:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"sandbox service exited {proc.returncode}:\n{log.read_text()}")
            try:
                c.wait_ready(timeout_s=1)
                break
            except Exception:
                if time.monotonic() > deadline:
                    proc.kill()
                    pytest.fail(f"sandbox service not ready in 60 s:\n{log.read_text()}")
    svc = Service(url, proc.pid, proc, log)
    yield svc
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    notify.close()
    with contextlib.suppress(OSError):  # the service removed its own state; leave no empty root in /run
        STATE_DIR.rmdir()


@pytest.fixture(scope="session")
def client(service: Service):
    from sandbox.client import SandboxClient

    with SandboxClient(service.url, token=TOKEN, timeout_s=120) as c:
        yield c


@pytest.fixture
def live_sessions(client):
    """The service's live sessions, once those being ended have gone (ending kills a container just after the
    request that ended it is answered): polled up to `within_s`."""
    def count(within_s: float = 10.0) -> int:
        deadline = time.monotonic() + within_s
        while client.health().sessions and time.monotonic() < deadline:
            time.sleep(0.05)
        return client.health().sessions
    return count


@pytest.fixture(scope="session")
def require_language(client):
    """Skips the calling test when the host lacks a language's toolchain (scripts/setup.sh installs them all)."""
    installed = set(client.health().languages)

    def require(language: str) -> None:
        if language not in installed:
            pytest.skip(f"{language} is not installed on this host (scripts/setup.sh installs it)")
    return require
