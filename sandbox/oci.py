"""The OCI runtime spec (config.json) of one sandboxed process."""
from __future__ import annotations

import platform
from typing import Any

from .images import SANDBOX_GID, SANDBOX_UID, Image
from .seccomp_bpf import annotation as seccomp_annotation
from .syscalls import ALLOWED, ALLOWED_IF_FIRST_ARG, CLONE_NAMESPACE_FLAGS, DENIED, SOCKET_FAMILY_DENIED

_ARCH = {"x86_64": "SCMP_ARCH_X86_64", "aarch64": "SCMP_ARCH_AARCH64"}
EPERM, ENOSYS = 1, 38


def seccomp_profile() -> dict[str, Any]:
    """An allow list (sandbox/syscalls.py): unknown syscalls get ENOSYS, the known-dangerous EPERM."""
    ns_mask = sum(CLONE_NAMESPACE_FLAGS)
    rules: list[dict[str, Any]] = [
        {"names": sorted(ALLOWED), "action": "SCMP_ACT_ALLOW"},
        {"names": ["clone"], "action": "SCMP_ACT_ALLOW",
         "args": [{"index": 0, "value": ns_mask, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}]},
        {"names": ["socket"], "action": "SCMP_ACT_ALLOW",
         "args": [{"index": 0, "value": SOCKET_FAMILY_DENIED, "op": "SCMP_CMP_NE"}]},
        {"names": ["socket"], "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM,
         "args": [{"index": 0, "value": SOCKET_FAMILY_DENIED, "op": "SCMP_CMP_EQ"}]},
        *({"names": [name], "action": "SCMP_ACT_ALLOW", "args": [{"index": 0, "value": v, "op": "SCMP_CMP_EQ"}]}
          for name, values in ALLOWED_IF_FIRST_ARG.items() for v in values),
        {"names": list(DENIED), "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM},
    ]  # clone3 is not listed: its ENOSYS (the default) makes glibc fall back to clone(), whose flags are checked
    for flag in CLONE_NAMESPACE_FLAGS:
        rules.append({"names": ["clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM,
                      "args": [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}]})
    # Only the native ABI is listed: calls through another ABI (int 0x80, x32) hit libseccomp's bad-arch kill.
    return {"defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": ENOSYS,
            "architectures": [_ARCH.get(platform.machine(), "SCMP_ARCH_X86_64")], "syscalls": rules}


_SECCOMP = seccomp_profile()
# crun loads this precompiled filter instead of compiling linux.seccomp again on every start (which
# runtimes without the annotation still do).
_ANNOTATIONS = seccomp_annotation(_SECCOMP)


def runtime_spec(*, rootfs: str, image: Image, args: list[str], env: list[str], netns: str | None,
                 shm_mb: int, nofile: int = 1024) -> dict[str, Any]:
    mounts: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "noexec", "strictatime", "mode=755", "size=64k"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", f"size={shm_mb}m"]},
    ]
    for src, dst in image.binds:
        mounts.append({"destination": dst, "type": "bind", "source": src,
                       "options": ["bind", "ro", "nosuid", "nodev"]})
    namespaces: list[dict[str, str]] = [{"type": t} for t in ("pid", "mount", "ipc", "uts", "cgroup")]
    namespaces.append({"type": "network", "path": netns} if netns else {"type": "network"})
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": SANDBOX_UID, "gid": SANDBOX_GID, "additionalGids": []},
            "args": args,
            "env": env,
            "cwd": "/work",
            "capabilities": {"bounding": [], "effective": [], "inheritable": [], "permitted": [], "ambient": []},
            "rlimits": [
                {"type": "RLIMIT_NOFILE", "hard": nofile, "soft": nofile},
                {"type": "RLIMIT_CORE", "hard": 0, "soft": 0},
                {"type": "RLIMIT_MEMLOCK", "hard": 65536, "soft": 65536},
                {"type": "RLIMIT_RTPRIO", "hard": 0, "soft": 0},
            ],
            "noNewPrivileges": True,
            "oomScoreAdj": 1000,
        },
        "annotations": dict(_ANNOTATIONS),
        "root": {"path": rootfs, "readonly": False},
        "hostname": "sandbox",
        "mounts": mounts,
        "linux": {
            "namespaces": namespaces,
            "seccomp": _SECCOMP,
            "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug"],
            "readonlyPaths": ["/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus"],
        },
    }
