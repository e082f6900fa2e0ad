"""Compile the seccomp profile to BPF once, with libseccomp through ctypes.

crun accepts a precompiled filter in the `run.oci.seccomp_bpf_data` annotation (base64), which spares
every container start from resolving syscall names and compiling the profile again.
"""
from __future__ import annotations

import base64
import ctypes
import ctypes.util
import tempfile
from typing import Any

SCMP_ACT_ALLOW = 0x7FFF0000
_ERRNO = 0x00050000


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def _lib() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    return lib


_OPS = {"SCMP_CMP_NE": 1, "SCMP_CMP_EQ": 4, "SCMP_CMP_MASKED_EQ": 7}
SCMP_FLTATR_CTL_OPTIMIZE = 8  # 2: a binary tree over syscall numbers instead of a linear scan


def _action(kind: str, errno: int | None) -> int | None:
    if kind == "SCMP_ACT_ALLOW":
        return SCMP_ACT_ALLOW
    if kind == "SCMP_ACT_ERRNO":
        return _ERRNO | (int(1 if errno is None else errno) & 0xFFFF)
    return None


def compile_profile(profile: dict[str, Any]) -> bytes | None:
    """BPF of an OCI seccomp profile made of ALLOW and ERRNO actions with NE/EQ/MASKED_EQ argument checks
    (what oci.py builds); None if libseccomp is unavailable or the profile uses anything else."""
    lib = _lib()
    default = _action(profile.get("defaultAction", ""), profile.get("defaultErrnoRet"))
    if lib is None or default is None:
        return None
    ctx = lib.seccomp_init(default)
    if not ctx:
        return None
    try:
        lib.seccomp_attr_set(ctx, SCMP_FLTATR_CTL_OPTIMIZE, 2)  # libseccomp < 2.5 has no tree: linear then
        for rule in profile["syscalls"]:
            action = _action(rule["action"], rule.get("errnoRet"))
            args = rule.get("args") or []
            if action is None or any(a["op"] not in _OPS for a in args):
                return None
            if action == default and not args:
                continue  # libseccomp refuses rules that repeat the default action
            cmps = (_ArgCmp * max(1, len(args)))(*[_ArgCmp(a["index"], _OPS[a["op"]], a["value"],
                                                           a.get("valueTwo", 0)) for a in args])
            for name in rule["names"]:
                nr = lib.seccomp_syscall_resolve_name(name.encode())
                if nr < 0:  # not on this architecture
                    continue
                if lib.seccomp_rule_add_array(ctx, action, nr, len(args), cmps) != 0:
                    return None
        with tempfile.TemporaryFile() as f:
            if lib.seccomp_export_bpf(ctx, f.fileno()) != 0:
                return None
            f.seek(0)
            return f.read()
    finally:
        lib.seccomp_release(ctx)


def annotation(profile: dict[str, Any]) -> dict[str, str]:
    bpf = compile_profile(profile)
    return {"run.oci.seccomp_bpf_data": base64.b64encode(bpf).decode()} if bpf else {}

