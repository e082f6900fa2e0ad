"""Memory the Mooncake transfer engine reads from and writes into: files and anonymous buffers mapped at a fixed
address (`MappedFile`, `AnonBuffer`), their registration with the engine, and the buffers kept mapped for reads
that were abandoned at a deadline but may still land (`EngineMemory.orphan`) until the engine says they resolved."""
from __future__ import annotations

import ctypes
import mmap
import os
import time
from pathlib import Path
from typing import Any

from .transfer_errors import TransferError


class MappedFile:
    """A file mapped read-write with its address; close() releases the export before unmapping."""

    def __init__(self, path: Path, nbytes: int, create: bool, populate: bool = False) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
        fd = os.open(path, flags, 0o644)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            else:
                nbytes = os.fstat(fd).st_size
            self.nbytes = nbytes
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            self.mm: mmap.mmap | None = mmap.mmap(fd, nbytes, flags=flags) if nbytes else None
        finally:
            os.close(fd)
        self._anchor = ctypes.c_char.from_buffer(self.mm) if self.mm is not None else None
        self.address = ctypes.addressof(self._anchor) if self._anchor is not None else 0

    def close(self) -> None:
        self._anchor = None
        if self.mm is not None:
            self.mm.close()
            self.mm = None


class AnonBuffer(MappedFile):
    """Anonymous memory of `nbytes`, mapped like a file (the file table, the scratch a table is read into)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.mm = mmap.mmap(-1, nbytes)
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.address = ctypes.addressof(self._anchor)


class EngineMemory:
    """The buffers registered with one transfer engine, and the orphans: buffers of reads abandoned at a deadline,
    kept mapped (the engine may still write into them) until each of their reads has resolved."""

    def __init__(self, engine: Any) -> None:
        self._te = engine
        self._orphans: list[tuple[list[int], MappedFile]] = []

    def register(self, buf: MappedFile, what: str) -> None:
        if buf.nbytes and self._te.register_memory(buf.address, buf.nbytes) != 0:
            raise TransferError(f"register_memory failed for {what} ({buf.nbytes} bytes)", shard=what)

    def unregister(self, buf: MappedFile) -> None:
        if buf.nbytes:
            self._te.unregister_memory(buf.address)

    def orphan(self, batch_ids: list[int], buf: MappedFile) -> None:
        """Keep `buf` mapped and registered until the reads `batch_ids` into it have resolved."""
        self._orphans.append((batch_ids, buf))

    def reap_orphans(self, block_s: float = 0.0) -> None:
        """Unregister and unmap the orphans whose reads have all resolved, waiting up to `block_s` for them."""
        end = time.monotonic() + block_s
        while self._orphans:
            keep = []
            for bids, buf in self._orphans:
                bids = [b for b in bids if self._te.transfer_check_status(b) in (0, -2)]
                if bids:
                    keep.append((bids, buf))
                else:
                    self.unregister(buf)
                    buf.close()
            self._orphans = keep
            if not keep or time.monotonic() >= end:
                break
            time.sleep(0.01)
