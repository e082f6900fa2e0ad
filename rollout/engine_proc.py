"""Engine process bookkeeping that vLLM does not do for us: which processes form one engine, which shared
memory segments they created, and noticing that the engine core died while the client waits on it."""
from __future__ import annotations

import gc
import os
import shutil
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from multiprocessing import shared_memory
from multiprocessing.connection import wait
from pathlib import Path

# vLLM's shared-memory broadcast queues (Python SharedMemory) and torch file stores. Only segments that
# processes of one engine have mapped or opened are attributed to it.
_SEGMENT_PREFIXES = ("psm_", "vllm_dist_")


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic collector off for a process's start-up (importing vLLM, torch, Megatron, transformers):
    the thousands of modules allocate enough to trigger hundreds of collections that find almost nothing to free,
    measured as 15-20% of the import's CPU time here. Back on (if it was) when the block ends; what the start
    left cyclic is freed by the next collection."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def freeze_heap() -> None:
    """Collect once, then move every object left into the collector's permanent generation, out of the walk of
    every later full collection (`gc.unfreeze` makes them collectable again). Also before starting a library that
    runs full collections of its own: vLLM's model loader runs two and its engine core three while an engine
    starts, each walking the whole heap its import left (~0.5 s here); frozen first, its LLM() took 1.4-1.9 CPU-s
    instead of 6.8-7.2, for the 1.0-1.1 s of this one collection."""
    gc.collect()
    gc.freeze()


# (pid, the gloo devices every process group of that process shares)
_gloo_devices: tuple[int, list] | None = None


def share_gloo_device() -> None:
    """Every gloo process group created in this process from now on shares one gloo device (one per interface in
    GLOO_SOCKET_IFNAME, as torch picks them) instead of a new one each. A gloo TCP device runs a loop thread that
    wakes every 10 ms with nothing to do (gloo/transport/tcp/loop.cc: epoll_wait with a 10 ms timeout), and torch
    gives each group its own: a Megatron rank held 24 of them and an inline vLLM engine 13 (a group per parallel
    dimension, and vLLM's CPU groups beside its device groups), ~0.2% of a core each, all the time: 7% of a core
    per rank and engine pair on a 2-core machine. The groups' traffic is the same over the shared device; its one
    loop thread handles their sockets' events in turn. On GPUs this touches only the gloo groups (Megatron's and
    vLLM's CPU-side groups), never NCCL's. Idempotent."""
    import torch.distributed.distributed_c10d as c10d

    if getattr(c10d.ProcessGroupGloo, "_tide_shared_device", False):
        return
    base = c10d.ProcessGroupGloo

    class SharedDeviceGloo(base):  # type: ignore[misc, valid-type]
        _tide_shared_device = True

        def __init__(self, store, rank, size, *args, **kwargs) -> None:
            if args and isinstance(args[0], base._Options):  # the caller chose its devices
                super().__init__(store, rank, size, *args, **kwargs)
                return
            options = base._Options()
            timeout = args[0] if args else kwargs.pop("timeout", None)
            if timeout is not None:
                options._timeout = timeout
            options._devices = _process_gloo_devices(base)
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = SharedDeviceGloo


def _process_gloo_devices(pg_gloo) -> list:
    global _gloo_devices
    pid = os.getpid()  # a forked child must not use its parent's device, whose loop thread it lacks
    if _gloo_devices is None or _gloo_devices[0] != pid:
        names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
        _gloo_devices = (pid, [pg_gloo.create_device(interface=n) for n in names] or
                         [pg_gloo.create_default_device()])
    return _gloo_devices[1]


def pin_threads(cpus: Iterable[int], pid: int | str = "self") -> None:
    """Bind every thread of process `pid` (this one by default) to `cpus`; the threads and processes it starts
    later inherit that."""
    cpus = set(cpus)
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:  # the process is gone
        return
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def process_tree(pid: int) -> list[int]:
    """pid and all its live descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return out


def _segments_of(pid: int) -> set[str]:
    found: set[str] = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                if "/dev/shm/" not in line or line.rstrip().endswith("(deleted)"):
                    continue
                found.add(line.split()[-1])
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/dev/shm/") and not target.endswith("(deleted)"):
                found.add(target)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return {p for p in found if Path(p).name.startswith(_SEGMENT_PREFIXES)}


def engine_segments(pids: list[int]) -> set[str]:
    """Shared-memory segment paths currently mapped or open in any of `pids`."""
    out: set[str] = set()
    for p in pids:
        out |= _segments_of(p)
    return out


def sweep_private_dirs(root: Path) -> list[Path]:
    """Remove engines' private temporary directories (`<root>/<pid>-<start>`) whose process is gone: an engine
    killed outside our control (SIGKILL, OOM) cannot remove its own."""
    removed = []
    for d in root.glob("*-*") if root.is_dir() else []:
        pid = d.name.split("-", 1)[0]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def remove_segments(paths: set[str], private_tmp: Path | None = None) -> list[str]:
    """Unlink segments left behind by a dead engine (each path was attributed to it while it ran)."""
    removed = []
    for path in sorted(paths):
        name = Path(path).name
        if not Path(path).exists():
            continue
        try:
            if name.startswith("psm_"):
                # Unlinking through SharedMemory also drops it from this process's resource tracker.
                seg = shared_memory.SharedMemory(name=name)
                seg.close()
                seg.unlink()
            else:
                os.unlink(path)
            removed.append(path)
        except (FileNotFoundError, OSError):
            pass
    if private_tmp is not None and private_tmp.is_dir():
        for p in private_tmp.iterdir():
            try:
                p.unlink()
                removed.append(str(p))
            except OSError:
                pass
        try:
            private_tmp.rmdir()
        except OSError:
            pass
    return removed


def pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                alive.append(p)
        except (FileNotFoundError, ProcessLookupError):
            pass
    return alive


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Poll until none of `pids` is alive or `timeout_s` has passed; returns those still alive."""
    deadline = time.monotonic() + timeout_s
    alive = pids_alive(pids)
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = pids_alive(alive)
    return alive


class DeathWatch:
    """Waits on the engine core's process sentinel. When the process exits while nobody asked it to, calls
    `on_death` so that a client blocked on the engine wakes up (vLLM's own monitor shuts the client down
    without waking a blocked `get_output`)."""

    def __init__(self, sentinel: int, on_death) -> None:
        self.expected = False
        self.dead = threading.Event()
        self._on_death = on_death
        self._thread = threading.Thread(target=self._run, args=(sentinel,), daemon=True, name="engine-deathwatch")
        self._thread.start()

    def _run(self, sentinel: int) -> None:
        try:
            wait([sentinel])
        except OSError:
            pass
        self.dead.set()
        if not self.expected:
            self._on_death()
