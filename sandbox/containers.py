"""One container to its end under crun, on a seat (a cgroup slot and a network namespace).

Per execution, on the seat's mount points: a tmpfs for the overlay's upper layer (size = disk limit), a
separate small tmpfs for captured stdout/stderr, stdin and the OCI bundles, and the overlay (image lower +
upper) as the container root (`workspace`). Each step of a run is one container on that overlay (`phase`): crun
started in the slot's cgroups with the step's limits, its time and output watched while it runs, killed past
them, its crun state checked gone. Leaving the workspace removes the three mounts and with them every file of
the run.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import select
import shutil
import signal
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

from .cgroups import Slot
from .config import Resolved, SandboxConfig
from .images import Image
from .oci import runtime_spec
from .sessions import Session
from .sysutil import MS_BIND, MS_NODEV, MS_NOSUID, MS_RDONLY, MS_REMOUNT, mount, umount_quiet
from .workdir import write_files

PID_SLACK = 4  # the slot's pids limit also counts crun and the worker thread
ENV = ["PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/tmp", "TMPDIR=/tmp", "LANG=C.UTF-8"]
# crun's own environment: nothing of the service's. crun acts on NOTIFY_SOCKET (binds the host's notify
# socket into the container) and LISTEN_FDS (hands its own open fds, e.g. its log file, to the container),
# both of which a service under systemd inherits.
CRUN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}


class Seat(Protocol):
    """Where a container runs: a run worker's or a session's cgroup slot and network namespace."""

    slot: Slot
    netns: str | None


@dataclass
class Phase:
    exit_code: int | None
    stdout: bytes
    stderr: bytes
    wall_ms: float
    cpu_ms: float
    peak_kb: int
    timed_out: bool
    output_exceeded: bool
    oom: bool
    runtime_error: str | None  # crun could not start the container


class Containers:
    """crun and the seats' mount points, under the service's state directory `state`."""

    def __init__(self, config: SandboxConfig, state: Path):
        self.config = config
        self.dir = state
        self.crun_root = state / "crun"
        self.crun = config.crun  # prepare() replaces it with a read-only bind of the binary
        self._crun_env = dict(CRUN_ENV)  # prepare() adds the cloned-binary marker for the read-only bind
        self._seq = itertools.count()

    def prepare(self) -> None:
        """crun's state directory, the seats' network namespaces' directory and the read-only crun, in the
        (mounted) state directory."""
        for d in (self.crun_root, self.dir / "netns"):
            d.mkdir(parents=True, exist_ok=True)
        self.crun = self._readonly_crun()

    def _readonly_crun(self) -> str:
        """crun guards against CVE-2019-5736 (a container overwriting the runtime binary through
        /proc/<pid>/exe) by re-executing itself from a sealed copy on every start, unless the binary it
        runs from is on a read-only mount and `_LIBCONTAINER_CLONED_BINARY` is set (runc's rule, which crun
        shares). So the service runs crun from a read-only bind of the binary in its state directory: the
        same protection without a second exec and dynamic link per container."""
        real = shutil.which(self.config.crun)
        if real is None:
            raise RuntimeError(f"crun binary {self.config.crun!r} not found")
        target = self.dir / "bin" / "crun"
        target.parent.mkdir(exist_ok=True)
        target.touch()
        mount(os.path.realpath(real), str(target), None, MS_BIND)
        mount(None, str(target), None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
        self._crun_env = {**CRUN_ENV, "_LIBCONTAINER_CLONED_BINARY": "1"}
        return str(target)

    def seat_dirs(self, index: int) -> None:
        for sub in ("rootfs", "disk", "out"):
            (self.dir / "slots" / f"slot{index}" / sub).mkdir(parents=True, exist_ok=True)

    def netns(self, index: int) -> str:
        """An empty network namespace for a seat (only a downed loopback): created once, reused by every run."""
        netns = self.dir / "netns" / f"slot{index}"
        netns.touch()
        subprocess.run(["unshare", f"--net={netns}", "true"], check=True)
        return str(netns)

    @contextmanager
    def workspace(self, w: Seat, limits: Resolved, image: Image, files: dict[str, str],
                  binary_files: dict[str, bytes], stdin_bytes: bytes, out_bytes: int) -> Iterator[tuple[str, str, str]]:
        """The seat's three mounts for one execution (rootfs, out, and the path of the stdin file), the files
        written under /work; everything is unmounted on the way out. The seat's mount points persist;
        everything a run writes lives inside these mounts."""
        root = f"{self.dir}/slots/slot{w.slot.index}"
        rootfs, disk, out = f"{root}/rootfs", f"{root}/disk", f"{root}/out"
        mounted: list[str] = []
        try:
            inodes = max(4096, limits.disk_mb * 256)  # bounds kernel memory spent on many tiny files too
            mount("tmpfs", disk, "tmpfs", MS_NOSUID | MS_NODEV, f"size={limits.disk_mb}m,nr_inodes={inodes},mode=755")
            mounted.append(disk)
            # Captured output (and the bundles, stdin) live apart from the writable layer, so a disk-filling
            # program keeps its stdout.
            out_size = out_bytes + len(stdin_bytes) + 256 * 1024
            mount("tmpfs", out, "tmpfs", MS_NOSUID | MS_NODEV, f"size={out_size},mode=700")
            mounted.append(out)
            os.mkdir(f"{disk}/upper")
            os.mkdir(f"{disk}/work")
            mount("overlay", rootfs, "overlay", 0, f"lowerdir={image.lower},upperdir={disk}/upper,workdir={disk}/work")
            mounted.append(rootfs)
            write_files(Path(rootfs, "work"), files)
            write_files(Path(rootfs, "work"), binary_files)
            stdin = f"{out}/stdin"
            with open(stdin, "wb") as f:
                f.write(stdin_bytes)
            yield rootfs, out, stdin
        finally:
            for m in reversed(mounted):
                umount_quiet(m)

    def phase(self, w: Seat, rootfs: str, image: Image, args: list[str], limits: Resolved, stdin: str | None,
              out: str, tag: str, session: Session | None = None, cpu_time: bool = False) -> Phase:
        """One container to its end. With `session`, its stdin and stdout are pipes the session serves cells
        over until it ends (the container is then killed); otherwise they are files."""
        slot = w.slot
        cid = f"tide-{os.getpid()}-{slot.index}-{next(self._seq)}-{tag}"
        bundle = f"{out}/{tag}"
        os.mkdir(bundle)
        spec = runtime_spec(rootfs=rootfs, image=image, args=args, env=ENV, netns=w.netns,
                            shm_mb=max(1, min(64, limits.disk_mb)))
        with open(f"{bundle}/config.json", "w") as f:
            f.write(json.dumps(spec))  # dumps: the C encoder (json.dump streams through the Python one)
        pidfile, crunlog = f"{bundle}/pid", f"{bundle}/crun.log"
        slot.set_limits(limits.memory_mb * 1024 * 1024, limits.pids + PID_SLACK,
                        int(self.config.cpu_per_slot * 100_000))
        slot.begin()
        cmd = [*slot.spawn_prefix(), self.crun, "--root", str(self.crun_root), "--cgroup-manager=disabled",
               f"--log=file:{crunlog}", "run", *(["--no-pivot"] if self.config.no_pivot else []), "--no-new-keyring",
               "--bundle", bundle, "--pid-file", pidfile, cid]
        out_limit = limits.output_kb * 1024
        timed_out = exceeded = False
        with open(f"{out}/{tag}.stdout", "w+b") as fo, open(f"{out}/{tag}.stderr", "w+b") as fe, \
                open(stdin if stdin else os.devnull, "rb") as fi:
            t0 = time.monotonic()
            piped = subprocess.PIPE if session else None
            proc = subprocess.Popen(cmd, stdin=piped or fi, stdout=piped or fo, stderr=fe, close_fds=True,
                                    env=self._crun_env)
            deadline = t0 + limits.timeout_s
            # cpu_time: limits.timeout_s is the CPU the container spends, within wall_time_factor x it of wall time
            # (as a judge case's: a program that waited for a core on a busy node is not out of time)
            cap = t0 + limits.timeout_s * (self.config.wall_time_factor if cpu_time else 1.0)
            pidfd = os.pidfd_open(proc.pid)
            try:
                if session is not None:
                    session.serve(proc, pidfd, deadline)
                    if proc.poll() is None:
                        self._kill(slot, pidfile)
                    proc.stdin.close()
                    proc.stdout.close()
                poller = select.poll()
                poller.register(pidfd, select.POLLIN)
                while True:
                    left = deadline - time.monotonic()
                    if poller.poll(max(0, math.ceil(min(left, 0.1) * 1000))):
                        break
                    if os.fstat(fo.fileno()).st_size + os.fstat(fe.fileno()).st_size > out_limit:
                        exceeded = True
                    elif time.monotonic() >= deadline:
                        now, spent = time.monotonic(), slot.cpu_seconds()
                        if now < cap and spent < limits.timeout_s:
                            deadline = min(cap, now + max(limits.timeout_s - spent, 0.01))
                            continue
                        timed_out = True
                    else:
                        continue
                    self._kill(slot, pidfile)
                    break
                proc.wait()
            finally:
                os.close(pidfd)
            wall = (time.monotonic() - t0) * 1000
            slot.drain()
            stats = slot.end()
            size = os.fstat(fo.fileno()).st_size + os.fstat(fe.fileno()).st_size
            exceeded = exceeded or size > out_limit
            fo.seek(0)
            fe.seek(0)
            stdout, stderr = fo.read(out_limit), fe.read(out_limit)
        started = os.path.exists(pidfile)
        if os.path.exists(f"{self.crun_root}/{cid}"):
            subprocess.run([self.crun, "--root", str(self.crun_root), "delete", "-f", cid], capture_output=True,
                           env=self._crun_env)
        err = None
        # output past its limit is the program's: it ran, even where the kill that followed came before crun wrote
        # the pid file (seen once in a full suite run, as "container did not start")
        if not started and not timed_out and not exceeded:
            err = "container did not start: "
            try:
                with open(crunlog, errors="replace") as f:
                    err += f.read()[-2000:]
            except OSError:
                err += f"crun exited {proc.returncode}"
        code = proc.returncode
        if code is not None and code < 0:
            code = 128 - code
        return Phase(code, stdout, stderr, wall, stats.cpu_ns / 1e6, stats.peak_memory_bytes // 1024,
                     timed_out, exceeded, stats.oom_kills > 0, err)

    @staticmethod
    def _kill(slot: Slot, pidfile: str) -> None:
        """Kill the container's pid 1 (the kernel then kills its whole pid namespace). No fork: after a fork
        bomb the slot's pids limit would make `crun kill` fail."""
        inside = slot.foreign_pids()
        try:
            with open(pidfile) as f:
                pid = int(f.read())
        except (OSError, ValueError):
            pid = None
        targets = [pid] if pid in inside else inside
        for p in targets:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
