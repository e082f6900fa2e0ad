"""One attempt at pulling files from peers' transfer engines into verified local files.

Each file is allocated as `<file>.partial` in the destination, registered with the engine and read in buckets
(`bucket_bytes`, `concurrency` reads in flight across files and peers); each bucket is checksummed as soon as the
bytes before it have landed, on one of `verify_threads` lanes, and the file takes its final name only once the whole
of it verified. The attempt's reads share one deadline, `timeout_s + bytes / min_bytes_per_s`; reads abandoned at
it keep their buffers mapped (EngineMemory.orphan). What failed is handed back with its error for the caller
(MooncakeTransport.pull_items) to retry."""
from __future__ import annotations

import mmap
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .checksum import IncrementalChecksum, algorithm_of
from .config import TransferConfig
from .engine_memory import EngineMemory, MappedFile
from .file_table import TableEntries
from .transfer_errors import (ChecksumMismatchError, PeerUnavailableError, ShardNotServedError, TransferError,
                              TransferTimeoutError)

PARTIAL_SUFFIX = ".partial"


@dataclass
class PullStats:
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    attempts: int = 0
    failures: list[str] = field(default_factory=list)  # errors that a retry recovered from

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class PullItem:
    """One file to fetch: `key` in the peer's table, `name` relative to the destination directory.
    nbytes/checksum None means: take them from the peer's table (aux files such as config.json)."""

    key: str
    name: str
    peer: str
    nbytes: int | None = None
    checksum: str | None = None
    optional: bool = False  # skip silently when the peer does not serve it


FaultHook = Callable[[str, int, mmap.mmap, int, int], None]  # (name, attempt, buffer, offset, length)
ProgressHook = Callable[[int], None]  # bytes landed so far in this pull


@dataclass
class PullJob:
    """A file of the attempt: where it is read from and into, what has landed and been checksummed."""

    item: PullItem
    remote: int
    nbytes: int
    checksum: str
    partial: Path
    final: Path
    buf: MappedFile | None = None
    crc: IncrementalChecksum | None = None
    landed: dict[int, int] = field(default_factory=dict)
    verified_upto: int = 0
    inflight: int = 0
    error: TransferError | None = None
    last_crc: Future | None = None
    zombies: list[int] = field(default_factory=list)  # reads the engine reported timed out (not freed)
    lane: ThreadPoolExecutor | None = None  # the checksum thread this file is fed to


class PullAttempt:
    """One attempt over a list of files: `run` returns the files done and those that failed, each with its error."""

    def __init__(self, engine: Any, memory: EngineMemory, config: TransferConfig,
                 fetch_table: Callable[[str], TableEntries], attempt: int,
                 on_progress: ProgressHook | None = None, fault_hook: FaultHook | None = None) -> None:
        self._te, self._memory, self.config, self._fetch_table = engine, memory, config, fetch_table
        self.attempt, self.on_progress, self.fault_hook = attempt, on_progress, fault_hook

    def run(self, items: Sequence[PullItem], dest: Path) -> tuple[list[PullJob], list[tuple[PullItem, TransferError]]]:
        failed: list[tuple[PullItem, TransferError]] = []
        jobs = self._open(items, dest, failed)
        self._read(jobs)
        return self._settle(jobs, failed)

    def _open(self, items: Sequence[PullItem], dest: Path,
              failed: list[tuple[PullItem, TransferError]]) -> list[PullJob]:
        """A job, its `.partial` file allocated and registered, for each item its peer serves as recorded; the
        others go to `failed` (an optional file the peer does not serve is skipped)."""
        cfg = self.config
        tables: dict[str, TableEntries | TransferError] = {}
        jobs: list[PullJob] = []
        for it in items:
            if it.peer not in tables:
                try:
                    tables[it.peer] = self._fetch_table(it.peer)
                except TransferError as e:
                    tables[it.peer] = e
            table = tables[it.peer]
            if isinstance(table, TransferError):
                failed.append((it, PeerUnavailableError(f"shard {it.name}: {table}", shard=it.name, peer=it.peer)))
                continue
            if it.key not in table:
                if it.optional:
                    continue
                failed.append((it, ShardNotServedError(f"shard {it.name}: peer {it.peer} does not serve {it.key!r}", shard=it.name, peer=it.peer)))
                continue
            addr, nbytes, checksum = table[it.key]
            if it.nbytes is not None and nbytes != it.nbytes:
                failed.append((it, ChecksumMismatchError(
                    f"shard {it.name}: peer {it.peer} serves {nbytes} bytes, the record says {it.nbytes}",
                    shard=it.name, peer=it.peer)))
                continue
            final = dest / it.name
            final.parent.mkdir(parents=True, exist_ok=True)
            job = PullJob(it, addr, nbytes, it.checksum or checksum, final.with_name(final.name + PARTIAL_SUFFIX), final)
            job.crc = IncrementalChecksum(algorithm_of(job.checksum))
            try:
                job.buf = MappedFile(job.partial, nbytes, create=True, populate=cfg.prefault)
                self._memory.register(job.buf, str(job.partial))
            except (OSError, TransferError) as e:
                self._discard(job)
                failed.append((it, TransferError(f"shard {it.name}: cannot allocate {job.partial}: {e}", shard=it.name, peer=it.peer)))
                continue
            jobs.append(job)
        return jobs

    def _read(self, jobs: list[PullJob]) -> None:
        """Read every job's buckets, checksumming each as it lands, until all landed, failed or the deadline
        passed."""
        cfg = self.config
        attempt, on_progress, fault_hook = self.attempt, self.on_progress, self.fault_hook
        total = sum(j.nbytes for j in jobs)
        deadline = time.monotonic() + cfg.timeout_s + total / cfg.min_bytes_per_s
        queue: deque[tuple[PullJob, int, int]] = deque(
            (j, off, min(cfg.bucket_bytes, j.nbytes - off)) for j in jobs for off in range(0, j.nbytes, cfg.bucket_bytes)
        )
        inflight: dict[int, tuple[PullJob, int, int]] = {}
        landed = 0
        # One single-thread executor per lane keeps each file's checksum pieces in order; files are spread
        # over `verify_threads` lanes (the checksum functions release the GIL).
        lanes = [ThreadPoolExecutor(1, thread_name_prefix=f"ckpt-verify{i}") for i in range(cfg.verify_threads)]
        for i, job in enumerate(jobs):
            job.lane = lanes[i % len(lanes)]
        try:
            while queue or inflight:
                while queue and len(inflight) < cfg.concurrency:
                    job, off, n = queue.popleft()
                    if job.error is not None:
                        continue
                    assert job.buf is not None
                    bid = self._te.batch_transfer_async_read(job.item.peer, [job.buf.address + off], [job.remote + off], [n])
                    if bid <= 0:
                        job.error = PeerUnavailableError(
                            f"shard {job.item.name}: submitting a read of {n} bytes at {off} to peer {job.item.peer} failed",
                            shard=job.item.name, peer=job.item.peer)
                        continue
                    job.inflight += 1
                    inflight[bid] = (job, off, n)
                progressed = False
                for bid in list(inflight):
                    st = self._te.transfer_check_status(bid)
                    if st == 0:
                        continue
                    job, off, n = inflight.pop(bid)
                    job.inflight -= 1
                    progressed = True
                    if st == 1:
                        landed += n
                        if job.error is None:
                            if fault_hook is not None and job.buf is not None and job.buf.mm is not None:
                                fault_hook(job.item.name, attempt, job.buf.mm, off, n)
                            job.landed[off] = n
                            self._feed_checksum(job)
                        if on_progress is not None:
                            on_progress(landed)
                    elif job.error is None:
                        if st == -2:
                            job.zombies.append(bid)
                        kind, cls = ("timed out", TransferTimeoutError) if st == -2 else ("failed", PeerUnavailableError)
                        job.error = cls(
                            f"shard {job.item.name}: read of {n} bytes at offset {off} from peer {job.item.peer} {kind}",
                            shard=job.item.name, peer=job.item.peer)
                if time.monotonic() > deadline:
                    for job in jobs:
                        if job.error is None and (job.inflight or any(q[0] is job for q in queue)):
                            job.error = TransferTimeoutError(
                                f"shard {job.item.name}: not complete from peer {job.item.peer} within "
                                f"{cfg.timeout_s:.0f}s + {total / cfg.min_bytes_per_s:.1f}s", shard=job.item.name, peer=job.item.peer)
                    self._orphan(inflight)
                    inflight.clear()
                    queue.clear()
                    break
                if not progressed and cfg.poll_interval_s:
                    time.sleep(cfg.poll_interval_s)
        finally:
            for lane in lanes:
                lane.shutdown(wait=True)

    def _settle(self, jobs: list[PullJob],
                failed: list[tuple[PullItem, TransferError]]) -> tuple[list[PullJob], list[tuple[PullItem, TransferError]]]:
        """Each job renamed to its final name if it verified, else removed and added to `failed`."""
        done: list[PullJob] = []
        for job in jobs:
            if job.error is None:
                assert job.crc is not None
                got = job.crc.hexdigest() if job.verified_upto == job.nbytes else None
                if got != job.checksum:
                    job.error = ChecksumMismatchError(
                        f"shard {job.item.name} from peer {job.item.peer}: checksum {got} != expected {job.checksum}",
                        shard=job.item.name, peer=job.item.peer)
            if job.error is not None:
                self._discard(job)
                failed.append((job.item, job.error))
                continue
            self._finish(job)
            done.append(job)
        return done, failed

    def _feed_checksum(self, job: PullJob) -> None:
        """Checksum the contiguous prefix that has landed (in order; crc runs with the GIL released)."""
        while job.verified_upto in job.landed:
            off = job.verified_upto
            n = job.landed.pop(off)
            assert job.lane is not None
            job.last_crc = job.lane.submit(_crc_range, job, off, n)
            job.verified_upto = off + n

    def _finish(self, job: PullJob) -> None:
        if job.buf is not None:
            self._memory.unregister(job.buf)
            job.buf.close()
            job.buf = None
        os.replace(job.partial, job.final)

    def _discard(self, job: PullJob) -> None:
        if job.buf is not None and job.zombies:  # the engine may still write into it: keep it mapped
            self._memory.orphan(job.zombies, job.buf)
            job.buf = None
        if job.buf is not None:
            self._memory.unregister(job.buf)
            job.buf.close()
            job.buf = None
        job.partial.unlink(missing_ok=True)

    def _orphan(self, inflight: dict[int, tuple[PullJob, int, int]]) -> None:
        """Reads abandoned at a deadline may still land: keep their buffers mapped until they resolve."""
        by_job: dict[int, tuple[PullJob, list[int]]] = {}
        for bid, (job, _, _) in inflight.items():
            by_job.setdefault(id(job), (job, []))[1].append(bid)
        for job, bids in by_job.values():
            if job.buf is not None:
                self._memory.orphan(bids, job.buf)
                job.buf = None
                job.inflight = 0
            job.partial.unlink(missing_ok=True)


def _crc_range(job: PullJob, off: int, n: int) -> None:
    assert job.buf is not None and job.buf.mm is not None and job.crc is not None
    with memoryview(job.buf.mm) as whole, whole[off : off + n] as part:
        job.crc.update(part)
