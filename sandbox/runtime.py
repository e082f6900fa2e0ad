"""The execution engine: a pool of worker threads, each owning one cgroup slot, running crun.

Per execution, on the slot's mount points: a tmpfs for the overlay's upper layer (size = disk limit), a
separate small tmpfs for captured stdout/stderr, stdin and the OCI bundles, and the overlay (image lower +
upper) as the container root. Compiled languages run a compile step and a run step on the same overlay.
Afterwards the three mounts (and with them every file of the run) are removed, crun state is checked gone,
and the slot is checked empty before it takes the next job.
"""
from __future__ import annotations

import base64
import hashlib
import itertools
import json
import logging
import math
import os
import queue
import select
import shlex
import shutil
import signal
import stat
import subprocess
import threading
import time
import uuid
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Iterator

from . import metrics
from .cgroups import CgroupLayout, CgroupPool, Slot, detect
from .config import Resolved, SandboxConfig
from .images import SANDBOX_GID, SANDBOX_UID, Image, build_host_image, rootfs_image
from .lru import LruCache
from .languages import LANGUAGES, Language, command, get_language, python_tests
from .models import CaseResult, CellResult, Limits, RunRequest, RunResult, SessionRequest, Status, Verdict
from .sessions import DRIVER as SESSION_DRIVER
from .sessions import Session
from .oci import runtime_spec
from .value_tests import (
    EXPECTED_DIR,
    VALUES_PATH,
    Expected,
    Split,
    expected_key,
    parse_values,
    read_values,
    split_test,
    valued,
)
from .sysutil import (
    MS_BIND,
    MS_NODEV,
    MS_NOSUID,
    MS_RDONLY,
    MS_REMOUNT,
    enter_private_mount_namespace,
    mount,
    mounts_under,
    pid_alive,
    umount_quiet,
)

log = logging.getLogger("tide.sandbox")

PID_SLACK = 4  # the slot's pids limit also counts crun and the worker thread
ENV = ["PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/tmp", "TMPDIR=/tmp", "LANG=C.UTF-8"]
# crun's own environment: nothing of the service's. crun acts on NOTIFY_SOCKET (binds the host's notify
# socket into the container) and LISTEN_FDS (hands its own open fds, e.g. its log file, to the container),
# both of which a service under systemd inherits.
CRUN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}


class Overloaded(Exception):
    """The queue is full: the caller should retry later."""


class BadRequest(ValueError):
    pass


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


# Judge mode (sandbox/harness/judge_driver.py is the container's init; the program runs once per case under it).
JUDGE_RUN = ("python3", "-I", ".tide_judge.py")
_HARNESS = Path(__file__).with_name("harness")
_JUDGE_DRIVER = (_HARNESS / "judge_driver.py").read_text()
_CHECKERS = (_HARNESS / "checkers.py").read_text()
_ZYGOTE = (_HARNESS / "python_zygote.py").read_text()  # Python's fork server in judge mode
_JUPYTER_DRIVER = (_HARNESS / "jupyter_driver.py").read_text()
_CONTAINER_INIT = (_HARNESS / "container_init.py").read_text()  # what each driver loads first
_ECHO_BYTES = 1024  # of each case's output, returned for debugging
CHECKER_DIR = ".tide_checker_build"  # under /work of a checker program's own build container
_C_RUN_BINARY = "prog"  # what the compiled checker languages (c, cpp, go, rust) build


def judge_files(req: RunRequest, lang, limits: Resolved, nonce: str, checker: bytes | None = None,
                wall_factor: float = 1.0) -> dict[str, str | bytes]:
    """The driver, its spec and (`checker`: a checker program, source or binary) the checker's file. Written only
    after the compile step: a compiler could embed any file it finds (Rust's include_str!, Go's embed)."""
    checker_cmd = None
    if checker is not None:
        checker_cmd = ["python3", "-I", "{checker}"] if req.checker.language == "python" else ["{checker}"]
    spec = {"nonce": nonce, "cmd": command(lang, lang.run, {lang.source: ""}, limits.memory_mb),
            "checker_cmd": checker_cmd, "zygote_source": _ZYGOTE if lang.name == "python" else None,
            "cases": [c.model_dump() for c in req.cases], "checker": req.checker.model_dump(),
            "timeout_s": limits.timeout_s, "wall_factor": wall_factor, "output_bytes": limits.output_kb * 1024,
            "memory_kb": limits.memory_mb * 1024, "echo_bytes": _ECHO_BYTES,
            "stop_on_first_failure": req.stop_on_first_failure,
            "checkers_source": _CHECKERS}
    return {".tide_judge.py": _JUDGE_DRIVER, ".tide_judge.json": json.dumps(spec), ".tide_init.py": _CONTAINER_INIT,
            **({".tide_checker": checker} if checker is not None else {})}


def judge_limits(per_case: Resolved, n_cases: int, wall_factor: float = 1.0) -> Resolved:
    """The container's limits around n cases: their longest wall times and the driver's report, plus start-up
    slack."""
    return Resolved(timeout_s=n_cases * (per_case.timeout_s * wall_factor + 0.25) + 5,
                    memory_mb=per_case.memory_mb + 64, pids=per_case.pids + 4, disk_mb=per_case.disk_mb,
                    output_kb=per_case.output_kb + n_cases * (_ECHO_BYTES * 6 + 8192) // 1024 + 64)


def _driver_report(stdout: str, nonce: str) -> tuple[dict | None, str]:
    """A driver's report (its one line behind the nonce; judge and Jupyter modes) and the rest of stdout."""
    report, kept = None, []
    for line in stdout.splitlines(keepends=True):
        if line.startswith(nonce + " "):
            report = json.loads(line[len(nonce) + 1:])
        else:
            kept.append(line)
    return report, "".join(kept)


def judged(result: RunResult, req: RunRequest, nonce: str) -> RunResult:
    """The driver's report as per-case results; without it, the whole judge run failed (its status says how)
    and every case counts as failed."""
    report, rest = _driver_report(result.stdout, nonce)
    cases = [CaseResult.model_validate(c) for c in report["cases"]] if report else []
    return result.model_copy(update={
        "stdout": rest.rstrip("\n"), "cases": cases, "cases_total": len(req.cases),
        "cases_passed": sum(c.verdict == Verdict.accepted for c in cases)})


# Jupyter mode (sandbox/harness/jupyter_driver.py is the container's init and starts one ipykernel).
JUPYTER_RUN = ("python3", "-I", ".tide_jupyter.py")
_KERNEL_START_S = 20.0


def jupyter_files(req: RunRequest, limits: Resolved, nonce: str) -> dict[str, str]:
    spec = {"nonce": nonce, "cells": req.cells, "cell_timeout_s": req.cell_timeout_s,
            "start_timeout_s": _KERNEL_START_S}
    return {".tide_jupyter.py": _JUPYTER_DRIVER, ".tide_jupyter.json": json.dumps(spec),
            ".tide_init.py": _CONTAINER_INIT}


def jupyter_limits(limits: Resolved) -> Resolved:
    """The request's limits for the cells, plus the kernel's start (about a second) and the report."""
    return Resolved(timeout_s=limits.timeout_s + _KERNEL_START_S, memory_mb=limits.memory_mb,
                    output_kb=limits.output_kb * 2 + 64, pids=limits.pids, disk_mb=limits.disk_mb)


def jupyter_result(result: RunResult, nonce: str) -> RunResult:
    """Cells from the driver's report; a kernel that would not start is a runtime error naming why."""
    report, rest = _driver_report(result.stdout, nonce)
    update: dict = {"stdout": rest.strip("\n"), "cells": []}
    if report:
        update["cells"] = [CellResult.model_validate(c) for c in report["cells"]]
        if report.get("kernel_error"):
            update.update(status=Status.runtime_error, stderr=result.stderr + report["kernel_error"])
    elif result.status == Status.ok:
        update.update(status=Status.runtime_error, stderr=result.stderr + "the Jupyter driver gave no report")
    return result.model_copy(update=update)


def fetch_files(work: Path, names: list[str], max_total: int) -> tuple[dict[str, str], list[str]]:
    """The regular files among `names` under the run's /work, base64 (missing and non-regular ones left out), and a
    note per file left out for the bounds below. Read from the host side of the overlay, so every path component
    is opened without following symlinks (a program's `ln -s /etc/shadow out` must not read the host's file) and
    non-blocking (a FIFO is skipped, not waited on).

    The response is bounded as a whole, not per file: the files' apparent sizes (what reading them gives, holes
    of a sparse file included) add up to at most `max_total`, and a file comes back once however many names
    reach it (hard links, `d//f` and `d/f`), so a run cannot turn a few blocks of disk into a response that
    exhausts the service's memory."""
    out: dict[str, str] = {}
    left_out: list[str] = []
    seen: dict[tuple[int, int], str] = {}
    total = 0
    for name in names:
        try:
            parts = PurePosixPath(_clean_path(name)).parts
        except BadRequest:
            continue
        fds: list[int] = []
        try:
            fds.append(os.open(work, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW))
            for part in parts[:-1]:
                fds.append(os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fds[-1]))
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fds[-1])
            fds.append(fd)
            st = os.fstat(fd)
            inode = (st.st_dev, st.st_ino)
            if not stat.S_ISREG(st.st_mode):
                pass  # a directory, FIFO or device: left out, as a missing file is
            elif inode in seen:
                left_out.append(f"{name!r}: the same file as {seen[inode]!r}, returned once")
            elif total + st.st_size > max_total:
                left_out.append(f"{name!r}: {st.st_size} bytes would take the response past its {max_total}-byte cap")
            else:
                with os.fdopen(os.dup(fd), "rb") as f:
                    data = f.read(max_total - total + 1)[:max_total - total]  # it may have grown since fstat
                seen[inode] = name
                total += len(data)
                out[name] = base64.b64encode(data).decode()
        except OSError:
            continue
        finally:
            for fd in fds:
                os.close(fd)
    return out, left_out


def _clean_path(name: str) -> str:
    p = PurePosixPath(name)
    if p.is_absolute() or not p.parts or any(part in ("..", ".", "") for part in p.parts) or "\x00" in name:
        raise BadRequest(f"bad file name {name!r}: must be a relative path without '..'")
    return str(p)


class Worker(threading.Thread):
    def __init__(self, rt: "SandboxRuntime", slot: Slot, netns: str | None):
        super().__init__(name=f"sandbox-slot{slot.index}", daemon=True)
        self.rt, self.slot, self.netns = rt, slot, netns
        self.busy = False
        self.broken = False

    def run(self) -> None:
        self.slot.join_current_thread()
        while True:
            job = self.rt._jobs.get()
            if job is None:
                return
            req, fut = job
            if not fut.set_running_or_notify_cancel():
                self.rt._release(1)
                continue
            self.busy = True
            metrics.BUSY.inc()
            try:
                res = self.rt._execute(self, req)
            except BadRequest as exc:
                res = RunResult(status=Status.internal_error, stderr=f"bad request: {exc}")
            except Exception as exc:  # never let one execution take the worker down
                log.exception("execution failed")
                res = RunResult(status=Status.internal_error, stderr=f"{type(exc).__name__}: {exc}")
            finally:
                self.busy = False
                metrics.BUSY.dec()
                self.rt._release(1)
            if not self.slot.drain(timeout_s=5.0):
                log.error("slot %d: processes survive SIGKILL; taking it out of service", self.slot.index)
                self.broken = True
                metrics.BROKEN.inc()
                fut.set_result(res)
                return
            fut.set_result(res)



@dataclass
class SessionSeat:
    """Where one session's container lives: a cgroup slot and a network namespace of the sessions' own, outside
    the run pool (a session idles while its agent's model generates: it must not hold a slot runs need). Seats
    are made when sessions first need them and reused after."""

    slot: Slot
    netns: str


class SandboxRuntime:
    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        self.layout: CgroupLayout | None = None
        self.pool: CgroupPool | None = None
        self.images: dict[str, Image] = {}
        self.workers: list[Worker] = []
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._inflight = 0
        self._sessions: dict[str, Session] = {}
        self._free_seats: list[SessionSeat] = []
        self._seats_made = 0
        self._expected: LruCache[Expected] = LruCache(4096)  # by test set (value_tests.expected_key)
        self._checkers: LruCache[bytes] = LruCache(16)  # compiled checker programs by source
        self._seq = itertools.count()
        self.dir = self.config.state_dir / str(os.getpid())
        self.crun_root = self.dir / "crun"
        self.crun = self.config.crun  # start() replaces it with a read-only bind of the binary
        self._crun_env = dict(CRUN_ENV)  # start() adds the cloned-binary marker for the read-only bind
        self._started = False

    # ---------------------------------------------------------------- lifecycle
    def start(self, private_namespace: bool = True) -> "SandboxRuntime":
        """Set up everything. With private_namespace, first move this (still single-threaded) process into
        its own mount namespace: needed on hybrid hosts to hide the cgroup2 mount from crun."""
        layout = detect()
        if private_namespace:
            enter_private_mount_namespace()
            if layout.needs_unified_mask and layout.v2_mount:
                # crun refuses hybrid mode; a tmpfs over the unified mount makes it see pure v1 (see
                # FEASIBILITY.md: unmounting it instead would let crun write into the shared tmpfs).
                mount("tmpfs", layout.v2_mount, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=755")
        elif layout.needs_unified_mask:
            raise RuntimeError("hybrid cgroup host: the runtime needs a private mount namespace")
        self.layout = layout
        self.pool = CgroupPool(layout, self.config.pool_size, self.config.cgroup_parent)
        # First kill what dead services left running (their crun and containers live in their slots), then
        # remove their files: a still-running crun would keep writing into its state directory.
        self.pool.cleanup_leftovers()
        self.cleanup_leftovers()
        slots = self.pool.create()
        # All service state on a tmpfs: crun creates and deletes its state files for every container, and on
        # a disk filesystem (ext4 here) inode allocation alone was ~10% of a container start's CPU.
        self.dir.mkdir(parents=True, exist_ok=True)
        mount("tmpfs", str(self.dir), "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=755")
        for d in (self.crun_root, self.dir / "netns"):
            d.mkdir(parents=True, exist_ok=True)
        self.crun = self._readonly_crun()
        for slot in slots:
            self._slot_dirs(slot.index)
        self.images["host"] = build_host_image(self.dir / "images" / "host")
        for name, path in self.config.rootfs_images.items():
            self.images[name] = rootfs_image(name, Path(path))
        if self.config.default_image not in self.images:
            raise RuntimeError(f"default image {self.config.default_image!r} is not configured")
        for slot in slots:
            self.workers.append(Worker(self, slot, self._netns(slot.index)))
        for w in self.workers:
            w.start()
        self._started = True
        log.info("sandbox ready: cgroups %s, %d slots, state %s", layout.mode.value, len(slots), self.dir)
        return self

    def _slot_dirs(self, index: int) -> None:
        for sub in ("rootfs", "disk", "out"):
            (self.dir / "slots" / f"slot{index}" / sub).mkdir(parents=True, exist_ok=True)

    def _netns(self, index: int) -> str:
        """An empty network namespace for a slot (only a downed loopback): created once, reused by every run."""
        netns = self.dir / "netns" / f"slot{index}"
        netns.touch()
        subprocess.run(["unshare", f"--net={netns}", "true"], check=True)
        return str(netns)

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

    def close(self) -> None:
        if not self._started:
            return
        self._started = False
        with self._lock:
            live = list(self._sessions.values())
        for session in live:
            session.close()
        for session in live:  # its thread has drained its seat
            session.ended.wait(timeout=30)
        for _ in self.workers:
            self._jobs.put(None)
        for w in self.workers:
            w.join(timeout=30)
        if self.pool:
            self.pool.destroy()
        self._remove_state_dir(self.dir)

    def cleanup_leftovers(self) -> None:
        """Remove state of services that died without cleaning up (mounts, crun state, files)."""
        root = self.config.state_dir
        if not root.is_dir():
            return
        for d in root.iterdir():
            if d.name.isdigit() and (int(d.name) == os.getpid() or not pid_alive(int(d.name))):
                log.warning("removing leftovers of sandbox %s", d)
                self._remove_state_dir(d)

    def _remove_state_dir(self, d: Path) -> None:
        croot = d / "crun"
        if croot.is_dir():
            for c in croot.iterdir():
                subprocess.run([self.config.crun, "--root", str(croot), "delete", "-f", c.name],
                               capture_output=True, env=CRUN_ENV)
        for m in mounts_under(str(d)):
            umount_quiet(m)
        if mounts_under(str(d)):
            raise RuntimeError(f"mounts remain under {d}; not deleting it")
        for _ in range(10):
            shutil.rmtree(d, ignore_errors=True)
            if not d.exists():
                return
            time.sleep(0.05)
        log.error("could not remove %s", d)

    # ---------------------------------------------------------------- submission
    # ---------------------------------------------------------------- sessions
    @property
    def max_sessions(self) -> int:
        """Live sessions allowed (each on a seat of its own, beside the run pool)."""
        return self.config.max_sessions

    def open_session(self, req: SessionRequest) -> Session:
        """Start a session on a seat of its own; its `ready` future gives the id once its kernel answers."""
        image = req.image or self.config.default_image
        if image not in self.images:
            raise BadRequest(f"unknown image {image!r}; known: {sorted(self.images)}")
        limits = self.config.effective(req.limits)
        session = Session(req, output_bytes=limits.output_kb * 1024, default_timeout_s=limits.timeout_s,
                          max_timeout_s=min(self.config.max_limits.timeout_s or math.inf, req.ttl_s))
        with self._lock:
            if len(self._sessions) >= self.max_sessions:
                metrics.REJECTED.inc()
                raise Overloaded(f"{len(self._sessions)} sessions live (max {self.max_sessions})")
            self._sessions[session.id] = session
        try:
            seat = self._take_seat()
        except Exception:
            self._session_ended(session)
            raise
        threading.Thread(target=self._serve_session, args=(seat, session), name=f"sandbox-session-{seat.slot.index}",
                         daemon=True).start()
        return session

    def _take_seat(self) -> SessionSeat:
        with self._lock:
            if self._free_seats:
                return self._free_seats.pop()
            index = self.config.pool_size + self._seats_made  # run slots are 0..pool_size-1
            self._seats_made += 1
        slot = self.pool.add_slot(index)
        self._slot_dirs(index)
        return SessionSeat(slot, self._netns(index))

    def _serve_session(self, seat: SessionSeat, session: Session) -> None:
        """The session's own thread: its container from start to end, then the seat drained and freed."""
        seat.slot.join_current_thread()
        metrics.SESSIONS.inc()
        try:
            self._execute_session(seat, session)
        except Exception as exc:  # a session that fails ends alone
            log.exception("session failed")
            if not session.ready.done():
                session.ready.set_exception(exc)
        finally:
            drained = seat.slot.drain(timeout_s=5.0)
            with self._lock:  # the session counts (health, the cap) until its seat is empty again
                self._sessions.pop(session.id, None)
                if drained:
                    self._free_seats.append(seat)
            if not drained:
                log.error("session slot %d: processes survive SIGKILL; not reused", seat.slot.index)
                metrics.BROKEN.inc()
            metrics.SESSIONS.dec()
            session.ended.set()

    def session(self, session_id: str) -> Session:
        with self._lock:
            return self._sessions[session_id]  # KeyError: unknown or ended

    def live_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    def _session_ended(self, session: Session) -> None:
        with self._lock:
            self._sessions.pop(session.id, None)

    def _execute_session(self, w: "Worker | SessionSeat", session: Session) -> None:
        limits = self.config.effective(session.req.limits)
        image = self.images[session.req.image or self.config.default_image]
        files = {".tide_session.py": SESSION_DRIVER}
        # The container lives until the session ends (at most max_session_s); limits.timeout_s is per cell.
        lifetime = Resolved(timeout_s=self.config.max_session_s, memory_mb=limits.memory_mb,
                            output_kb=limits.output_kb, pids=limits.pids, disk_mb=limits.disk_mb)
        args = ["python3", "-I", ".tide_session.py", str(limits.output_kb * 1024)]
        with self._workspace(w, limits, image, files, {}, b"", limits.output_kb * 1024) as (rootfs, out, _):
            self._phase(w, rootfs, image, args, lifetime, None, out, "session", session=session)

    def _reserve(self, n: int) -> None:
        with self._lock:
            if self._inflight + n > self.capacity:
                metrics.REJECTED.inc()
                raise Overloaded(f"{self._inflight} executions in flight")
            self._inflight += n
            metrics.QUEUED.set(max(0, self._inflight - len(self.workers)))

    def _release(self, n: int) -> None:
        with self._lock:
            self._inflight -= n
            metrics.QUEUED.set(max(0, self._inflight - len(self.workers)))

    def validate(self, req: RunRequest) -> None:
        lang = get_language(req.language)  # KeyError for unknown languages
        image = req.image or self.config.default_image
        if image not in self.images:
            raise BadRequest(f"unknown image {image!r}; known: {sorted(self.images)}")
        if image == "host" and not lang.installed():
            raise BadRequest(f"language {lang.name!r} is not installed on this host (scripts/setup.sh installs it)")
        if len(req.files) + len(req.binary_files) > self.config.max_files:
            raise BadRequest(f"too many files (max {self.config.max_files})")
        for name in [*req.files, *req.binary_files]:
            _clean_path(name)
        if req.cases and req.checker.kind == "program" and image == "host" \
                and not get_language(req.checker.language).installed():
            raise BadRequest(f"checker language {req.checker.language!r} is not installed on this host")
        if req.tests and lang.values:
            for test in req.tests:
                try:
                    split_test(lang.name, test)
                except ValueError as exc:
                    raise BadRequest(str(exc)) from None

    def submit_many(self, reqs: list[RunRequest]) -> list[Future]:
        """Queue all or none (raises Overloaded when they do not fit)."""
        for r in reqs:
            self.validate(r)
        if self.capacity == 0:
            raise Overloaded("no working slot")
        if len(reqs) > self.capacity:
            raise BadRequest(f"batch of {len(reqs)} exceeds the capacity of {self.capacity}; split it")
        self._reserve(len(reqs))
        futs: list[Future] = []
        for r in reqs:
            fut: Future = Future()
            self._jobs.put((r, fut))
            futs.append(fut)
        return futs

    def submit(self, req: RunRequest) -> Future:
        return self.submit_many([req])[0]

    def run(self, req: RunRequest, timeout: float | None = None) -> RunResult:
        return self.submit(req).result(timeout)

    @property
    def capacity(self) -> int:
        """Most executions one request may carry: the working slots plus the queue (0 when none works)."""
        working = sum(not w.broken for w in self.workers)
        return working + self.config.max_queue if working else 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            inflight = self._inflight
        busy = sum(w.busy for w in self.workers)
        return {"slots": len(self.workers), "busy": busy, "queued": max(0, inflight - busy),
                "broken": sum(w.broken for w in self.workers)}

    # ---------------------------------------------------------------- one execution
    def _execute(self, w: Worker, req: RunRequest) -> RunResult:
        lang = get_language(req.language)
        limits = self.config.effective(req.limits)
        image = self.images[req.image or self.config.default_image]
        nonce = uuid.uuid4().hex
        files = dict(req.files)
        code = lang.solution(req.code)
        splits = [split_test(lang.name, t) for t in req.tests] if req.tests and lang.values else None
        if splits is not None:
            files.update(lang.values(code, [s.value for s in splits], VALUES_PATH))
        elif req.tests:
            files.update(python_tests(code, req.tests, nonce, req.test_setup, req.solution_names))
        else:
            files[lang.source] = code
        if req.cells:
            files.pop(lang.source, None)  # the cells are the code
            files.update(jupyter_files(req, limits, nonce))
        out_bytes = limits.output_kb * 1024
        compile_out = (self.config.compile_limits.output_kb or 64) * 1024
        binary = {k: base64.b64decode(v, validate=True) for k, v in req.binary_files.items()}
        if splits is not None:
            expected = self._expected_values(w, image, lang, req, splits, binary)
        checker = None
        if req.cases and req.checker.kind == "program":
            checker = self._checker_program(w, image, req)
            if isinstance(checker, RunResult):
                return checker
        with self._workspace(w, limits, image, files, binary, req.stdin.encode(),
                             max(out_bytes, compile_out)) as (rootfs, out, stdin):
            compile_output = None
            if lang.compile:
                climits = self.config.compile_step(limits, req.compile_timeout_s)
                args = command(lang, lang.compile, files, climits.memory_mb)
                c = self._phase(w, rootfs, image, args, climits, None, out, "compile", cpu_time=True)
                compile_output = (c.stdout + c.stderr).decode("utf-8", "replace")
                compiled = dict(compile_output=compile_output, compile_exit_code=c.exit_code,
                                compile_wall_ms=round(c.wall_ms, 3), compile_timed_out=c.timed_out)
                if c.runtime_error:
                    return RunResult(status=Status.internal_error, stderr=c.runtime_error, wall_ms=c.wall_ms)
                if c.exit_code != 0 or c.timed_out or c.oom:
                    why = " (compiler timed out)" if c.timed_out else " (compiler ran out of memory)" if c.oom else ""
                    return RunResult(status=Status.compile_error, exit_code=c.exit_code, stderr=compile_output + why,
                                     wall_ms=c.wall_ms, cpu_ms=c.cpu_ms, peak_memory_kb=c.peak_kb,
                                     tests_passed=0 if req.tests else None,
                                     tests_total=len(req.tests) if req.tests else None,
                                     cases_passed=0 if req.cases else None,
                                     cases_total=len(req.cases) if req.cases else None, **compiled)
            else:
                compiled = {}
            plain = not (req.cases or req.cells)  # judge and Jupyter modes time each case or cell themselves
            if req.cases:
                factor = self.config.wall_time_factor
                self._write_late_files(Path(rootfs, "work"), judge_files(req, lang, limits, nonce, checker, factor))
                args, run_limits = list(JUDGE_RUN), judge_limits(limits, len(req.cases), factor)
            elif req.cells:
                args, run_limits = list(JUPYTER_RUN), jupyter_limits(limits)
            else:
                run = lang.tests_run if req.tests and lang.tests_run else lang.run
                args, run_limits = command(lang, run, files, limits.memory_mb), limits
            p = self._phase(w, rootfs, image, args, run_limits, stdin, out, "run", cpu_time=plain)
            result = self._result(p, req, nonce, out_bytes, compiled, judge_tests=splits is None)
            if splits is not None:
                got = read_values(f"{rootfs}/work", VALUES_PATH.rsplit("/", 1)[1], limits.disk_mb << 20)
                result = valued(result, req.tests, expected, parse_values(got, len(req.tests)))
            elif req.cases:
                result = judged(result, req, nonce)
            elif req.cells:
                result = jupyter_result(result, nonce)
            if req.fetch_files:
                files, left_out = fetch_files(Path(rootfs, "work"), req.fetch_files,
                                              min(limits.disk_mb, self.config.max_fetch_mb) << 20)
                result.files = files
                if left_out:
                    result.stderr += "".join(f"tide: fetch_files left out {why}\n" for why in left_out)
            return result

    def _side_limits(self) -> Resolved:
        """Limits of the task's own programs (expected values, checker builds): the service's, never a request's,
        so that what is cached for a test set does not depend on who asked first."""
        return self.config.compile_step(self.config.effective(Limits()))

    def _expected_values(self, w: Worker, image: Image, lang: Language, req: RunRequest, splits: list[Split],
                         binary_files: dict[str, bytes]) -> Expected:
        """Tests mode outside Python: evaluate the tests' expected sides, in a container of their own (with the
        request's files, without the solution), before anything of the solution's runs. Cached by test set, and
        only when every expected value was recorded by a program that ran to its end."""
        key = expected_key(lang.name, image.name, req)
        hit = self._expected.get(key)
        if hit is not None:
            return hit
        files = lang.values(None, [s.expected for s in splits], f"/work/{EXPECTED_DIR}/.tide_values")
        elimits = self._side_limits()
        steps = [command(lang, step, files, elimits.memory_mb) for step in (lang.compile, lang.run) if step]
        p, data = self._side_phase(w, image, "expected", EXPECTED_DIR, files, steps, elimits, ".tide_values",
                                   elimits.disk_mb << 20, req.files, binary_files)
        error = ""
        if p.runtime_error or p.exit_code != 0 or p.timed_out or p.oom or p.output_exceeded:
            why = (p.runtime_error or "timed out" if p.timed_out else "ran out of memory" if p.oom
                   else "output limit" if p.output_exceeded else f"exit status {p.exit_code}")
            detail = (p.stdout + p.stderr).decode("utf-8", "replace")[-2000:]
            error = f"tide: the tests' expected values did not all evaluate ({why}):\n{detail}"
        result = Expected(parse_values(data, len(splits)), error)
        if not error and len(result.values) == len(splits) and all(v is not None for v in result.values.values()):
            self._expected.put(key, result)
        return result

    def _checker_program(self, w: Worker, image: Image, req: RunRequest) -> bytes | RunResult:
        """Judge mode's checker program: Python's source, or a compiled language's binary built in a container of
        its own before anything of the solution's (cached by source); a checker that does not compile fails the
        request."""
        lang = get_language(req.checker.language)
        code = lang.solution(req.checker.code or "")
        if not lang.compile:
            return code.encode()
        key = hashlib.sha256(json.dumps([lang.name, image.name, code]).encode()).hexdigest()
        hit = self._checkers.get(key)
        if hit is not None:
            return hit
        files = {lang.source: code}
        climits = self._side_limits()
        p, binary = self._side_phase(w, image, "checker", CHECKER_DIR, files,
                                     [command(lang, lang.compile, files, climits.memory_mb)], climits,
                                     _C_RUN_BINARY, 256 << 20)
        if p.runtime_error or p.exit_code != 0 or not binary:
            detail = (p.runtime_error or "") + (p.stdout + p.stderr).decode("utf-8", "replace")[-4000:]
            return RunResult(status=Status.compile_error, stderr=f"the checker program did not compile:\n{detail}",
                             wall_ms=p.wall_ms, cases_passed=0, cases_total=len(req.cases))
        self._checkers.put(key, binary)
        return binary

    def _side_phase(self, w: Worker, image: Image, tag: str, subdir: str, files: dict[str, str],
                    steps: list[list[str]], limits: Resolved, product: str, max_bytes: int,
                    given: dict[str, str] | None = None, binary_files: dict[str, bytes] | None = None,
                    ) -> tuple[Phase, bytes]:
        """Run `steps` (e.g. compile, then run) on `files` in /work/<subdir> of a container of their own, with the
        request's files (`given`, `binary_files`) in /work, and return the phase and the file `product` it left there, read from
        outside without following links. The container's whole writable layer goes with its mounts, so nothing
        a toolchain writes anywhere (Go's build cache, Rust's target directory, Java's classes, temp files)
        outlives the phase: the solution's container starts from the image."""
        with self._workspace(w, limits, image, given or {}, binary_files or {}, b"",
                             limits.output_kb * 1024) as (rootfs, out, _):
            sub = Path(rootfs, "work", subdir)
            sub.mkdir()
            os.chown(sub, SANDBOX_UID, SANDBOX_GID)
            self._write_files(sub, files)
            script = f"cd {subdir} && " + "".join(shlex.join(s) + " && " for s in steps[:-1]) + "exec " + \
                shlex.join(steps[-1])
            p = self._phase(w, rootfs, image, ["sh", "-c", script], limits, None, out, tag)
            return p, read_values(str(sub), product, max_bytes)

    def _write_late_files(self, work: Path, files: dict[str, str | bytes]) -> None:
        """Files written between steps: whatever the earlier step left under those names goes first (a link
        there must not redirect the write)."""
        for name in files:
            path = work / _clean_path(name)
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.exists():
                shutil.rmtree(path)
        self._write_files(work, files)

    @contextmanager
    def _workspace(self, w: "Worker | SessionSeat", limits: Resolved, image: Image, files: dict[str, str],
                   binary_files: dict[str, bytes], stdin_bytes: bytes, out_bytes: int) -> Iterator[tuple[str, str, str]]:
        """The slot's three mounts for one execution (rootfs, out, and the path of the stdin file), the files
        written under /work; everything is unmounted on the way out. The slot's mount points persist;
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
            self._write_files(Path(rootfs, "work"), files)
            self._write_files(Path(rootfs, "work"), binary_files)
            stdin = f"{out}/stdin"
            with open(stdin, "wb") as f:
                f.write(stdin_bytes)
            yield rootfs, out, stdin
        finally:
            for m in reversed(mounted):
                umount_quiet(m)

    def _write_files(self, work: Path, files: dict[str, str] | dict[str, bytes]) -> None:
        for name, content in files.items():
            rel = _clean_path(name)
            path = work / rel
            parent = path.parent
            if parent != work:
                parent.mkdir(parents=True, exist_ok=True)
                for p in [parent, *parent.parents]:
                    if p == work:
                        break
                    os.chown(p, SANDBOX_UID, SANDBOX_GID)
            path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
            os.chown(path, SANDBOX_UID, SANDBOX_GID)

    def _phase(self, w: "Worker | SessionSeat", rootfs: str, image: Image, args: list[str], limits: Resolved,
               stdin: str | None, out: str, tag: str, session: Session | None = None, cpu_time: bool = False) -> Phase:
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

    @staticmethod
    def _result(p: Phase, req: RunRequest, nonce: str, out_bytes: int, compiled: dict,
                judge_tests: bool = True) -> RunResult:
        if p.runtime_error:
            return RunResult(status=Status.internal_error, stderr=p.runtime_error, wall_ms=p.wall_ms)
        if p.oom and p.exit_code != 0:
            status = Status.memory_limit
        elif p.output_exceeded:
            status = Status.output_limit
        elif p.timed_out:
            status = Status.timeout
        elif p.exit_code != 0:
            status = Status.runtime_error
        else:
            status = Status.ok
        stdout = p.stdout.decode("utf-8", "replace")
        passed = total = None
        if req.tests and not judge_tests:
            total, passed = len(req.tests), 0  # counted by valued()
        elif req.tests:
            total, passed, kept = len(req.tests), 0, []
            seen: set[int] = set()
            for line in stdout.splitlines(keepends=True):
                parts = line.split()
                if len(parts) == 3 and parts[0] == nonce and parts[1].isdigit():
                    i = int(parts[1])
                    if parts[2] == "pass" and i < total and i not in seen:
                        passed += 1
                    seen.add(i)
                else:
                    kept.append(line)
            stdout = "".join(kept)
        return RunResult(status=status, exit_code=p.exit_code, stdout=stdout,
                         stderr=p.stderr.decode("utf-8", "replace"), wall_ms=round(p.wall_ms, 3),
                         cpu_ms=round(p.cpu_ms, 3), peak_memory_kb=p.peak_kb, tests_passed=passed,
                         tests_total=total, **compiled)


def languages() -> list[str]:
    """The languages whose toolchain the host image has."""
    return sorted(name for name, lang in LANGUAGES.items() if lang.installed())
