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
SCMP_CMP_MASKED_EQ = 7
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
    return lib


def compile_profile(profile: dict[str, Any]) -> bytes | None:
    """BPF of an OCI seccomp profile with ALLOW default and ERRNO rules (what oci.py builds); None if
    libseccomp is unavailable or the profile uses anything else."""
    lib = _lib()
    if lib is None or profile.get("defaultAction") != "SCMP_ACT_ALLOW":
        return None
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        return None
    try:
        for rule in profile["syscalls"]:
            if rule["action"] != "SCMP_ACT_ERRNO":
                return None
            action = _ERRNO | (int(rule.get("errnoRet", 1)) & 0xFFFF)
            args = rule.get("args") or []
            if any(a["op"] != "SCMP_CMP_MASKED_EQ" for a in args):
                return None
            cmps = (_ArgCmp * max(1, len(args)))(*[_ArgCmp(a["index"], SCMP_CMP_MASKED_EQ, a["value"],
                                                           a["valueTwo"]) for a in args])
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

