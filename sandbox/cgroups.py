"""Cgroup detection (v1, hybrid, v2) and the pool of pre-created slots.

A slot is a set of cgroups (memory+swap, pids, cpu quota, cpu accounting) created once at start-up and
reused by one worker thread for every execution it runs. On v1/hybrid the worker thread writes its own TID
into the slot's `tasks` files once, so each crun it forks is born inside the slot and no process is ever
moved between cgroups (a move costs an RCU grace period, 8-40 ms here). v2 has no per-thread membership
outside threaded subtrees, so there each execution joins through `cgroup.procs` in a tiny exec wrapper.
"""
from __future__ import annotations

import enum
import errno
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .sysutil import pid_alive

CONTROLLERS_V1 = ("memory", "pids", "cpu", "cpuacct")
POOL_DIR = "tide-sandbox"  # slot cgroups are named tide-sandbox-<service pid>-slot<i>


class CgroupMode(str, enum.Enum):
    V1 = "v1"
    HYBRID = "hybrid"  # v1 hierarchies plus a cgroup2 mount that has controllers: crun refuses it
    V2 = "v2"


@dataclass
class CgroupLayout:
    mode: CgroupMode
    v1_mounts: dict[str, str] = field(default_factory=dict)  # controller -> hierarchy mount point
    v2_mount: str | None = None
    own_paths: dict[str, str] = field(default_factory=dict)  # controller (or "" for v2) -> own cgroup path

    @property
    def needs_unified_mask(self) -> bool:
        return self.mode is CgroupMode.HYBRID


def detect(mountinfo: str = "/proc/self/mountinfo", proc_cgroup: str = "/proc/self/cgroup") -> CgroupLayout:
    v1: dict[str, str] = {}
    v2_mount: str | None = None
    with open(mountinfo) as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fields = pre.split()
            fstype, _src, opts = (post.split() + ["", "", ""])[:3]
            point = fields[4]
            if fstype == "cgroup":
                for opt in opts.split(","):
                    if opt in CONTROLLERS_V1:
                        v1[opt] = point
            elif fstype == "cgroup2" and v2_mount is None:
                v2_mount = point
    own: dict[str, str] = {}
    with open(proc_cgroup) as f:
        for line in f:
            _hid, ctrls, path = line.rstrip("\n").split(":", 2)
            if ctrls == "":
                own[""] = path
            for c in ctrls.split(","):
                if c in CONTROLLERS_V1:
                    own[c] = path
    if v1:
        missing = [c for c in CONTROLLERS_V1 if c not in v1]
        if missing:
            raise RuntimeError(f"cgroup v1 controllers not mounted: {missing}")
        mode = CgroupMode.V1
        if v2_mount is not None:
            try:
                if Path(v2_mount, "cgroup.controllers").read_text().split():
                    mode = CgroupMode.HYBRID
            except OSError:
                pass
        return CgroupLayout(mode, v1_mounts=v1, v2_mount=v2_mount, own_paths=own)
    if v2_mount is None:
        raise RuntimeError("no cgroup filesystem mounted")
    return CgroupLayout(CgroupMode.V2, v2_mount=v2_mount, own_paths=own)


def _write(path: Path, value: str | int) -> None:
    with open(path, "w") as f:
        f.write(str(value))


def _read_kv(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in path.read_text().splitlines():
        k, _, v = line.partition(" ")
        if v.strip().lstrip("-").isdigit():
            out[k] = int(v)
    return out


@dataclass
class SlotStats:
    cpu_ns: int
    peak_memory_bytes: int
    oom_kills: int


class Slot:
    """One reusable set of cgroups. Methods are called only by the slot's own worker thread."""

    def __init__(self, layout: CgroupLayout, dirs: dict[str, Path], index: int):
        self.layout = layout
        self.dirs = dirs  # controller -> cgroup directory (v2: key "")
        self.index = index
        self._limits: tuple[int, int, int] | None = None
        self._base: SlotStats | None = None
        self._fds: dict[Path, int] = {}  # counters read and reset on every run stay open

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except PermissionError:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            self._fds[path] = fd
        return fd

    def _get(self, path: Path) -> str:
        return os.pread(self._fd(path), 65536, 0).decode()

    def _put(self, path: Path, value: int) -> None:
        os.pwrite(self._fd(path), str(value).encode(), 0)

    def open_counters(self) -> None:
        """Open the per-run counter files now, so a slot's fd count never changes while it serves."""
        if self.v2:
            files = [self.dirs[""] / "pids.current"]
        else:
            files = [self.dirs["cpuacct"] / "cpuacct.usage", self.dirs["memory"] / "memory.max_usage_in_bytes",
                     self.dirs["memory"] / "memory.oom_control", self.dirs["pids"] / "pids.current"]
        for f in files:
            self._fd(f)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    @property
    def v2(self) -> bool:
        return self.layout.mode is CgroupMode.V2

    def join_current_thread(self) -> None:
        """v1/hybrid: put the calling thread (not its process) into every slot cgroup."""
        if self.v2:
            return
        tid = threading.get_native_id()
        for d in set(self.dirs.values()):
            _write(d / "tasks", tid)

    def spawn_prefix(self) -> list[str]:
        """Command prefix that makes the spawned process join the slot (v2 only; empty on v1)."""
        if not self.v2:
            return []
        procs = str(self.dirs[""] / "cgroup.procs")
        return ["/bin/sh", "-c", 'echo 0 > "$0" && exec "$@"', procs]

    def set_limits(self, memory_bytes: int, pids: int, cpu_quota_us: int, period_us: int = 100_000) -> None:
        want = (memory_bytes, pids, cpu_quota_us)
        if want == self._limits:
            return
        if self.v2:
            d = self.dirs[""]
            _write(d / "memory.max", memory_bytes)
            if (d / "memory.swap.max").exists():
                _write(d / "memory.swap.max", 0)
            _write(d / "pids.max", pids)
            _write(d / "cpu.max", f"{cpu_quota_us} {period_us}")
        else:
            mem = self.dirs["memory"]
            memsw = mem / "memory.memsw.limit_in_bytes"
            old = int((mem / "memory.limit_in_bytes").read_text())
            # memsw must stay >= limit: raise memsw first when growing, lower it last when shrinking.
            if memsw.exists() and memory_bytes > old:
                _write(memsw, memory_bytes)
                _write(mem / "memory.limit_in_bytes", memory_bytes)
            else:
                _write(mem / "memory.limit_in_bytes", memory_bytes)
                if memsw.exists():
                    _write(memsw, memory_bytes)
            _write(self.dirs["pids"] / "pids.max", pids)
            _write(self.dirs["cpu"] / "cpu.cfs_period_us", period_us)
            _write(self.dirs["cpu"] / "cpu.cfs_quota_us", cpu_quota_us)
        self._limits = want

    def _raw_stats(self) -> SlotStats:
        if self.v2:
            d = self.dirs[""]
            cpu = _read_kv(d / "cpu.stat").get("usage_usec", 0) * 1000
            peak_file = d / "memory.peak"
            peak = int(peak_file.read_text()) if peak_file.exists() else int((d / "memory.current").read_text())
            ooms = _read_kv(d / "memory.events").get("oom_kill", 0)
            return SlotStats(cpu, peak, ooms)
        cpu = int(self._get(self.dirs["cpuacct"] / "cpuacct.usage"))
        peak = int(self._get(self.dirs["memory"] / "memory.max_usage_in_bytes"))
        oom = self._get(self.dirs["memory"] / "memory.oom_control")
        ooms = int(oom.split("oom_kill ", 1)[1].split()[0]) if "oom_kill " in oom else 0
        return SlotStats(cpu, peak, ooms)

    def begin(self) -> None:
        """Reset per-run counters (v1 can zero them; v2 keeps a baseline to subtract)."""
        if not self.v2:
            self._put(self.dirs["cpuacct"] / "cpuacct.usage", 0)
            self._put(self.dirs["memory"] / "memory.max_usage_in_bytes", 0)
        else:
            try:
                _write(self.dirs[""] / "memory.peak", 0)  # resettable since Linux 6.12
            except OSError:
                pass
        self._base = self._raw_stats()

    def cpu_seconds(self) -> float:
        """CPU seconds the slot's processes spent since begin()."""
        if self.v2:
            used = _read_kv(self.dirs[""] / "cpu.stat").get("usage_usec", 0) * 1000
            return (used - (self._base.cpu_ns if self._base else 0)) / 1e9
        return int(self._get(self.dirs["cpuacct"] / "cpuacct.usage")) / 1e9

    def end(self) -> SlotStats:
        """Counters of the run. Peak memory is above the slot's usage at the start (page cache that earlier
        runs left charged to the slot is not the program's)."""
        now = self._raw_stats()
        base = self._base or SlotStats(0, 0, 0)
        cpu = now.cpu_ns - (base.cpu_ns if self.v2 else 0)
        return SlotStats(cpu, max(0, now.peak_memory_bytes - base.peak_memory_bytes), now.oom_kills - base.oom_kills)

    def foreign_pids(self) -> list[int]:
        """Processes in the slot other than the service itself (whose worker thread lives here on v1)."""
        d = self.dirs["" if self.v2 else "pids"]
        me = os.getpid()
        try:
            # Opened afresh: v1 caches the pid list of an open cgroup.procs for a second.
            return [p for p in map(int, (d / "cgroup.procs").read_text().split()) if p != me]
        except OSError:
            return []

    def drain(self, timeout_s: float = 5.0) -> bool:
        """Wait until no container process is left in the slot, SIGKILLing stragglers. True if empty."""
        deadline = time.monotonic() + timeout_s
        delay = 0.0005
        killed = False
        current = self.dirs["" if self.v2 else "pids"] / "pids.current"
        own = 0 if self.v2 else 1  # on v1 the worker thread itself is counted
        while True:
            if int(self._get(current)) <= own:
                return True
            pids = self.foreign_pids()
            if not pids:
                return True
            if time.monotonic() > deadline:
                return False
            if killed or delay > 0.02:
                for p in pids:
                    try:
                        os.kill(p, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                killed = True
            time.sleep(delay)
            delay = min(delay * 2, 0.05)


def _rmdir_cgroup(d: Path, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            for f in ("cgroup.procs",):
                try:
                    for p in map(int, (d / f).read_text().split()):
                        if p != os.getpid():
                            os.kill(p, signal.SIGKILL)
                except (OSError, ValueError):
                    pass
            time.sleep(0.01)


class CgroupPool:
    """Creates `size` slots as <own cgroup or parent>/tide-sandbox-<service pid>-slot<i> in every hierarchy.

    Slots are direct children of the parent, with no pool group between: in the cpu hierarchy each slot
    then weighs exactly what one ordinary process beside the service weighs. Under a shared pool group all
    containers together would weigh as much as one process (slow under load), and raising the group's
    weight would hand a lone container the weight of the whole pool.
    """

    def __init__(self, layout: CgroupLayout, size: int, parent: str | None = None):
        self.layout = layout
        self.size = size
        self.parent = parent
        self.slots: list[Slot] = []

    def bases(self) -> dict[str, Path]:
        """controller -> the cgroup directory the slots are created in (v2: key "")."""
        out: dict[str, Path] = {}
        if self.layout.mode is CgroupMode.V2:
            rel = self.parent or self.layout.own_paths.get("", "/")
            out[""] = Path(self.layout.v2_mount or "/sys/fs/cgroup", rel.lstrip("/"))
        else:
            for c, mnt in self.layout.v1_mounts.items():
                rel = self.parent or self.layout.own_paths.get(c, "/")
                out[c] = Path(mnt, rel.lstrip("/"))
        return out

    @staticmethod
    def slot_name(pid: int, index: int) -> str:
        return f"{POOL_DIR}-{pid}-slot{index}"

    def owned_by(self, pid: int) -> list[Path]:
        """Slot cgroups of the service with this pid, across hierarchies."""
        return sorted({d for base in self.bases().values() for d in base.glob(f"{POOL_DIR}-{pid}-slot*")})

    def cleanup_leftovers(self) -> int:
        """Remove slots whose owning service is gone (a crash). Returns how many cgroups were removed."""
        removed = 0
        for base in set(self.bases().values()):
            for d in base.glob(f"{POOL_DIR}-*-slot*"):
                pid = d.name[len(POOL_DIR) + 1:].split("-", 1)[0]
                if not pid.isdigit() or (int(pid) != os.getpid() and pid_alive(int(pid))):
                    continue
                _rmdir_cgroup(d)
                removed += 1
        return removed

    def create(self) -> list[Slot]:
        bases = self.bases()
        if self.layout.mode is CgroupMode.V2:
            self._enable_v2_controllers(bases[""])
        for i in range(self.size):
            self.add_slot(i)
        return self.slots

    def add_slot(self, index: int) -> Slot:
        """One more slot (the run pool's at create; sessions' seats later), removed with the others by destroy."""
        dirs: dict[str, Path] = {}
        for c, base in self.bases().items():
            d = base / self.slot_name(os.getpid(), index)
            d.mkdir(exist_ok=True)
            dirs[c] = d
        slot = Slot(self.layout, dirs, index)
        slot.open_counters()
        self.slots.append(slot)
        return slot

    def _enable_v2_controllers(self, base: Path) -> None:
        """Enable memory/pids/cpu for the slots. The service's cgroup must be a delegated subtree."""
        try:
            _write(base / "cgroup.subtree_control", "+memory +pids +cpu")
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise RuntimeError(f"cannot enable cgroup v2 controllers in {base}: {exc}; "
                                   "give the service a delegated subtree (--cgroup-parent)") from exc
            # "no internal processes": move the service into a leaf so its cgroup can delegate.
            leaf = base / f"{POOL_DIR}-service"
            leaf.mkdir(exist_ok=True)
            _write(leaf / "cgroup.procs", os.getpid())
            _write(base / "cgroup.subtree_control", "+memory +pids +cpu")

    def destroy(self) -> None:
        for slot in self.slots:
            slot.drain(timeout_s=2.0)
            slot.close()
            for d in set(slot.dirs.values()):
                _rmdir_cgroup(d)
        self.slots = []
