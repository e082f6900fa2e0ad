"""Root filesystems the overlay is built on.

`host` is the development image: a tiny skeleton (a few directories and /etc files, built in ~10 ms) whose
/usr is the host's /usr bound read-only, so the host's python3, gcc, g++, node, bash and java run inside.
A `rootfs` image is a full directory tree (e.g. built by scripts/build_sandbox_rootfs.sh) used as the
overlay's read-only lower layer with no host binds.
"""
from __future__ import annotations

import glob
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

SANDBOX_UID = 65534
SANDBOX_GID = 65534

# /etc entries the host image needs: dynamic linker cache and the alternatives symlinks that
# /usr/bin/java etc. resolve through; the JDK reads its config from /etc/java-*, R from /etc/R (R_HOME/etc
# links there), PHP its php.ini from /etc/php, fontconfig (matplotlib in Jupyter mode) /etc/fonts.
_HOST_ETC_BINDS = ("/etc/alternatives", *sorted(glob.glob("/etc/java-*")), "/etc/R", "/etc/php", "/etc/fonts")
_MERGED_USR = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


@dataclass(frozen=True)
class Image:
    name: str
    lower: Path
    binds: tuple[tuple[str, str], ...] = ()  # (host path, container path), always read-only
    env: tuple[str, ...] = field(default=())


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.write_text(text)
    path.chmod(mode)


def build_host_image(dest: Path) -> Image:
    """Create the skeleton lower layer for the host image under dest (idempotent)."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    binds: list[tuple[str, str]] = [("/usr", "/usr")]
    for d in ("usr", "etc", "proc", "dev", "tmp", "work", "var/tmp", "run"):
        (dest / d).mkdir(parents=True, exist_ok=True)
    for name in _MERGED_USR:
        host = Path("/") / name
        if host.is_symlink():
            (dest / name).symlink_to(os.readlink(host))
        elif host.is_dir():  # a host without merged /usr: bind the directory as well
            (dest / name).mkdir()
            binds.append((str(host), "/" + name))
    for src in _HOST_ETC_BINDS:
        if os.path.isdir(src):
            (dest / src.lstrip("/")).mkdir(parents=True, exist_ok=True)
            binds.append((src, src))
    for f in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/matplotlibrc"):  # Debian's matplotlib reads the last
        if os.path.isfile(f):
            shutil.copyfile(f, dest / f.lstrip("/"))
    etc = dest / "etc"
    _write(etc / "passwd", f"root:x:0:0:root:/root:/bin/sh\nnobody:x:{SANDBOX_UID}:{SANDBOX_GID}:nobody:/tmp:/bin/sh\n")
    _write(etc / "group", f"root:x:0:\nnogroup:x:{SANDBOX_GID}:\n")
    _write(etc / "hostname", "sandbox\n")
    _write(etc / "hosts", "127.0.0.1 localhost sandbox\n")
    _write(etc / "nsswitch.conf", "passwd: files\ngroup: files\nhosts: files\n")
    (dest / "tmp").chmod(0o1777)
    (dest / "var/tmp").chmod(0o1777)
    os.chown(dest / "work", SANDBOX_UID, SANDBOX_GID)
    return Image("host", dest, tuple(binds))


def rootfs_image(name: str, path: Path) -> Image:
    if not (path / "usr/bin").is_dir():
        raise ValueError(f"{path} does not look like a root filesystem")
    return Image(name, path)
