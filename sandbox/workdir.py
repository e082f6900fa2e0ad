"""The files of a run's /work, seen from the host side of its overlay: written in under relative names only and
owned by the sandbox user, replaced between steps, and fetched out without following links, bounded per response."""
from __future__ import annotations

import base64
import os
import shutil
import stat
from pathlib import Path, PurePosixPath

from .errors import BadRequest
from .images import SANDBOX_GID, SANDBOX_UID


def clean_path(name: str) -> str:
    p = PurePosixPath(name)
    if p.is_absolute() or not p.parts or any(part in ("..", ".", "") for part in p.parts) or "\x00" in name:
        raise BadRequest(f"bad file name {name!r}: must be a relative path without '..'")
    return str(p)


def write_files(work: Path, files: dict[str, str] | dict[str, bytes]) -> None:
    for name, content in files.items():
        rel = clean_path(name)
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


def write_late_files(work: Path, files: dict[str, str | bytes]) -> None:
    """Files written between steps: whatever the earlier step left under those names goes first (a link
    there must not redirect the write)."""
    for name in files:
        path = work / clean_path(name)
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.exists():
            shutil.rmtree(path)
    write_files(work, files)


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
            parts = PurePosixPath(clean_path(name)).parts
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
