"""Thin wrappers over Linux syscalls that Python 3.11's os module lacks (mount, umount2, unshare)."""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import threading

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MNT_DETACH = 0x2
CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000


def _b(s: str | None) -> bytes | None:
    return None if s is None else os.fsencode(s)


def mount(source: str | None, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    if _libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {fstype} on {target}: {os.strerror(e)}")


def umount(target: str, flags: int = 0) -> None:
    if _libc.umount2(_b(target), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"umount {target}: {os.strerror(e)}")


def umount_quiet(target: str) -> bool:
    """Unmount if mounted; falls back to a lazy detach when busy. True if something was unmounted."""
    try:
        umount(target)
        return True
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.ENOENT):
            return False
        if exc.errno == errno.EBUSY:
            umount(target, MNT_DETACH)
            return True
        raise


def unshare(flags: int) -> None:
    if _libc.unshare(flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"unshare({flags:#x}): {os.strerror(e)}")


def mounts_under(prefix: str, mountinfo: str = "/proc/self/mountinfo") -> list[str]:
    """Mount points at or below prefix, deepest first (the order to unmount them)."""
    prefix = prefix.rstrip("/")
    found = []
    with open(mountinfo) as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if point == prefix or point.startswith(prefix + "/"):
                found.append(point)
    return sorted(set(found), key=lambda p: p.count("/"), reverse=True)


def enter_private_mount_namespace() -> None:
    """Give this process its own mount namespace whose mounts never propagate back to the host.

    Must run before any thread is started (unshare(CLONE_NEWNS) fails with EINVAL in a threaded process).
    """
    if threading.active_count() > 1:
        raise RuntimeError("enter_private_mount_namespace() must be called before threads are started")
    unshare(CLONE_NEWNS)
    mount(None, "/", None, MS_REC | MS_PRIVATE)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists: signal 0 reaches it, or is refused because another user owns it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
