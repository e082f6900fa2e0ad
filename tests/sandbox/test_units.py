"""Pieces that need neither root nor crun: cgroup mode detection, harness generation, limits, OCI spec."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from sandbox.cgroups import CgroupMode, detect
from sandbox.config import SandboxConfig
from sandbox.images import Image
from sandbox.languages import command, get_language
from sandbox.models import Limits
from sandbox.oci import runtime_spec

V1_LINES = [f"{30 + i} 31 0:{30 + i} / /sys/fs/cgroup/{c} rw,relatime - cgroup cgroup rw,{c}"
            for i, c in enumerate(["cpu,cpuacct", "memory", "pids"])]
V2_LINE = "41 31 0:38 / {point} rw,relatime - cgroup2 cgroup2 rw"


def _layout(tmp_path: Path, lines: list[str], proc: str, controllers: str = ""):
    (tmp_path / "mountinfo").write_text("\n".join(lines) + "\n")
    (tmp_path / "cgroup").write_text(proc)
    return detect(str(tmp_path / "mountinfo"), str(tmp_path / "cgroup"))


def test_detect_v1(tmp_path):
    lay = _layout(tmp_path, V1_LINES, "4:memory:/a\n3:cpu,cpuacct:/\n2:pids:/b\n")
    assert lay.mode is CgroupMode.V1 and not lay.needs_unified_mask
    assert lay.v1_mounts["cpuacct"] == "/sys/fs/cgroup/cpu,cpuacct" and lay.own_paths["memory"] == "/a"


def test_detect_hybrid_and_empty_unified(tmp_path):
    unified = tmp_path / "unified"
    unified.mkdir()
    (unified / "cgroup.controllers").write_text("hugetlb\n")
    lines = V1_LINES + [V2_LINE.format(point=unified)]
    lay = _layout(tmp_path, lines, "0::/\n4:memory:/\n3:cpu,cpuacct:/\n2:pids:/\n")
    assert lay.mode is CgroupMode.HYBRID and lay.needs_unified_mask
    (unified / "cgroup.controllers").write_text("\n")  # systemd's hybrid: no controllers, crun accepts it
    assert _layout(tmp_path, lines, "0::/\n").mode is CgroupMode.V1


def test_detect_v2(tmp_path):
    lay = _layout(tmp_path, [V2_LINE.format(point="/sys/fs/cgroup")], "0::/kubepods/pod1/ctr\n")
    assert lay.mode is CgroupMode.V2 and lay.own_paths[""] == "/kubepods/pod1/ctr"


def test_limits_defaults_and_caps():
    cfg = SandboxConfig()
    eff = cfg.effective(Limits(timeout_s=1e6, memory_mb=64))
    assert eff.timeout_s == cfg.max_limits.timeout_s and eff.memory_mb == 64
    assert eff.output_kb == cfg.default_limits.output_kb


def test_java_command_and_harness():
    java = get_language("java")
    files = java.values("class Solution {}", ["Solution.f(1)"], "/work/.tide_values")
    assert set(files) == {"Solution.java", "Main.java", "TideShow.java"}
    assert 'TideShow.record("/work/.tide_values", 0, () -> (Solution.f(1)));' in files["Main.java"]
    assert "Solution.java" not in java.values(None, ["1"], "/work/v")  # the expected side: no solution
    cmd = command(java, java.compile, files, 256)
    assert cmd[0] == "javac" and "-J-Xmx128m" in cmd
    assert cmd[-3:] == ["Main.java", "Solution.java", "TideShow.java"]
    assert command(java, java.run, files, 256)[:2] == ["java", "-Xmx128m"]
    with pytest.raises(KeyError):
        get_language("cobol")


def test_spec_is_locked_down():
    spec = runtime_spec(rootfs="/r", image=Image("host", Path("/l"), (("/usr", "/usr"),)), args=["true"],
                        env=[], netns="/run/ns", shm_mb=8)
    p = spec["process"]
    assert p["user"]["uid"] == 65534 and p["noNewPrivileges"] and not any(p["capabilities"].values())
    ns = {n["type"]: n.get("path") for n in spec["linux"]["namespaces"]}
    assert set(ns) >= {"pid", "mount", "ipc", "uts", "network"} and ns["network"] == "/run/ns"
    seccomp = spec["linux"]["seccomp"]
    assert seccomp["defaultAction"] == "SCMP_ACT_ERRNO" and seccomp["defaultErrnoRet"] == 38  # an allow list
    allowed = {n for r in seccomp["syscalls"] if r["action"] == "SCMP_ACT_ALLOW" and not r.get("args") for n in r["names"]}
    denied = {n for r in seccomp["syscalls"] if r["action"] == "SCMP_ACT_ERRNO" for n in r["names"]}
    assert {"mount", "unshare", "ptrace", "bpf", "keyctl", "clone", "setns", "io_uring_setup"} <= denied
    assert not allowed & denied and "clone3" not in allowed and {"read", "execve", "memfd_create"} <= allowed
    assert spec["annotations"]["run.oci.seccomp_bpf_data"]  # precompiled, so crun does not compile it per start
    usr = next(m for m in spec["mounts"] if m["destination"] == "/usr")
    assert "ro" in usr["options"]


def test_judge_driver_gives_a_case_whose_exit_status_was_lost_an_re_never_a_pass():
    """The driver's verdict where nobody can say how a case ended (its fork server reaped it and was killed before
    reporting): RE, no exit code, a note in stderr; right output alone is not a pass."""
    from sandbox.harness import judge_driver as driver

    class StatusLost(driver.Exec):
        def reap(self, pid, deadline):
            super().reap(pid, deadline)  # the real child ends and is reaped; its status is then dropped
            return None, 0, 0.0, False

    no_memory_limit = 1 << 40  # KiB: a child forked from this test's process starts with its peak RSS
    lost = driver._run_case(StatusLost(["cat"]), "7\n", 10.0, 65536, no_memory_limit)
    assert (lost["verdict"], lost["exit_code"], lost["stdout"]) == ("RE", None, "7\n")
    assert "exit status was lost" in lost["stderr"]
    kept = driver._run_case(driver.Exec(["cat"]), "7\n", 10.0, 65536, no_memory_limit)
    assert (kept["verdict"], kept["exit_code"], kept["stdout"]) == (None, 0, "7\n")  # None: the checker decides


def test_session_reader_waits_on_descriptors_past_1024():
    """A service with hundreds of sessions holds more than 1024 descriptors; select() cannot watch those."""
    import fcntl
    import json
    import os
    import resource
    import struct
    import subprocess
    import threading

    from sandbox.replies import Channel

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1600:
        pytest.skip(f"descriptors limited to {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1600), hard))
    r, w = os.pipe()
    child = subprocess.Popen(["sleep", "30"])
    pidfd = os.pidfd_open(child.pid)
    # copies at free descriptors from 1500 up (F_DUPFD never takes one in use: dup2 onto a fixed number closed
    # whatever this worker held there, such as a pooled connection of the session's sandbox client)
    high_r, high_pid = fcntl.fcntl(r, fcntl.F_DUPFD, 1500), fcntl.fcntl(pidfd, fcntl.F_DUPFD, 1500)
    assert min(high_r, high_pid) >= 1500
    try:
        body = json.dumps({"id": "x", "stdout": "hi"}).encode()
        os.write(w, struct.pack("<I", len(body)) + body)
        reader = Channel(high_r, high_pid, threading.Event())
        reply = reader.message(time.monotonic() + 5)
        assert (reply["id"], reply["stdout"]) == ("x", "hi"), reply
    finally:
        child.kill()
        child.wait()
        for fd in (r, w, pidfd, high_r, high_pid):
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_client_threads_use_pools_of_their_own_and_close_closes_them_all():
    """No connection pool is shared between threads (httpcore may close one thread's connection while handing it
    to another's request); within a thread, one pool is reused."""
    import threading

    from sandbox.client import SandboxClient

    client = SandboxClient("http://127.0.0.1:9")
    mine = client._http
    assert client._http is mine
    theirs = []
    t = threading.Thread(target=lambda: theirs.append(client._http))
    t.start()
    t.join()
    assert theirs[0] is not mine and theirs[0]._transport is not mine._transport
    client.close()
    assert mine.is_closed and theirs[0].is_closed
