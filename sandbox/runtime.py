"""The execution engine's door: a started SandboxRuntime runs requests on a pool of worker threads, each owning one
cgroup slot (run_pool.py), and hosts sessions on seats of their own (session_seats.py); every step of a run is one
crun container on a per-execution overlay (containers.py), a request's steps and result are execution.py's.

This module sets the service up and takes it down: the cgroup pool, the state directory (a tmpfs: crun's state,
the seats' mount points and network namespaces), the read-only crun, the images; and what dead services left
behind. It admits requests (validated here, queued by the run pool) and answers the service's questions.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from concurrent.futures import Future
from pathlib import Path

from .cgroups import CgroupLayout, CgroupPool, detect
from .config import SandboxConfig
from .containers import CRUN_ENV, Containers
from .errors import BadRequest, Overloaded
from .execution import Executor
from .images import Image, build_host_image, rootfs_image
from .languages import LANGUAGES, get_language
from .models import RunRequest, RunResult, SessionRequest
from .run_pool import RunPool, Worker
from .session_seats import SessionHost, SessionSeat
from .sessions import Session
from .sysutil import (
    MS_NODEV,
    MS_NOSUID,
    MS_RDONLY,
    enter_private_mount_namespace,
    mount,
    mounts_under,
    pid_alive,
    umount_quiet,
)
from .value_tests import split_test
from .workdir import clean_path

__all__ = ["BadRequest", "Overloaded", "SandboxRuntime", "languages"]
log = logging.getLogger("tide.sandbox")


class SandboxRuntime:
    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        self.layout: CgroupLayout | None = None
        self.pool: CgroupPool | None = None
        self.images: dict[str, Image] = {}
        self.dir = self.config.state_dir / str(os.getpid())
        self.containers = Containers(self.config, self.dir)
        self.runs = RunPool(self.config)
        self.executor = Executor(self.config, self.containers, self.images)
        self.sessions = SessionHost(self.config, self.containers, self.images, self._session_seat)
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
        self.containers.prepare()
        for slot in slots:
            self.containers.seat_dirs(slot.index)
        self.images["host"] = build_host_image(self.dir / "images" / "host")
        for name, path in self.config.rootfs_images.items():
            self.images[name] = rootfs_image(name, Path(path))
        if self.config.default_image not in self.images:
            raise RuntimeError(f"default image {self.config.default_image!r} is not configured")
        self.runs.start([(slot, self.containers.netns(slot.index)) for slot in slots], self.executor.execute)
        self._started = True
        log.info("sandbox ready: cgroups %s, %d slots, state %s", layout.mode.value, len(slots), self.dir)
        return self

    def _session_seat(self, index: int) -> SessionSeat:
        """A new seat past the run pool's slots: its cgroup slot, mount points and network namespace."""
        slot = self.pool.add_slot(index)
        self.containers.seat_dirs(index)
        return SessionSeat(slot, self.containers.netns(index))

    def close(self) -> None:
        if not self._started:
            return
        self._started = False
        self.sessions.close_all()
        self.runs.stop()
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

    # ---------------------------------------------------------------- sessions
    @property
    def max_sessions(self) -> int:
        """Live sessions allowed (each on a seat of its own, beside the run pool)."""
        return self.sessions.max_sessions

    def open_session(self, req: SessionRequest) -> Session:
        """Start a session on a seat of its own; its `ready` future gives the id once its kernel answers."""
        return self.sessions.open(req)

    def session(self, session_id: str) -> Session:
        return self.sessions.get(session_id)  # KeyError: unknown or ended

    def live_sessions(self) -> int:
        return self.sessions.live()

    # ---------------------------------------------------------------- runs
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
            clean_path(name)
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
        return self.runs.submit_many(reqs)

    def submit(self, req: RunRequest) -> Future:
        return self.submit_many([req])[0]

    def run(self, req: RunRequest, timeout: float | None = None) -> RunResult:
        return self.submit(req).result(timeout)

    @property
    def workers(self) -> list[Worker]:
        return self.runs.workers

    @property
    def capacity(self) -> int:
        """Most executions one request may carry: the working slots plus the queue (0 when none works)."""
        return self.runs.capacity

    def stats(self) -> dict[str, int]:
        return self.runs.stats()


def languages() -> list[str]:
    """The languages whose toolchain the host image has."""
    return sorted(name for name, lang in LANGUAGES.items() if lang.installed())
