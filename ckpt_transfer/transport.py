"""Peer-to-peer shard transport on the Mooncake transfer engine.

Source side (the node holding the shards): `MooncakeTransport.serve(files)` maps each file from /dev/shm
and registers it with the engine. The first buffer the transport registers is a small *file table*
(key -> remote address, size, checksum), so a peer needs nothing but the engine address
(`ip:rpc_port`): it finds the table with `get_first_buffer_address`, reads it, then reads the files.

Receiving side: `MooncakeTransport.pull(shards, remote_address, dest_dir)` allocates `<file>.partial` in
its own shm root, registers it, reads it in buckets (`bucket_bytes`, `concurrency` reads in flight,
overlapping across shards), checksums each bucket as soon as the bytes before it are complete, and renames
the file to its final name only when the whole file verified. Failed files are removed and retried
(`retries`), then a `TransferError` subclass naming the shard and the peer is raised.

Every wait is bounded: the handshake and file-table read by `timeout_s`, a pull attempt by
`timeout_s + bytes / min_bytes_per_s`. Reads abandoned at a deadline keep their destination mapping alive
(the engine may still write into it) until they resolve; the `.partial` name is removed at once.

Engine facts this relies on (mooncake-transfer-engine 0.3.13): `transfer_check_status(batch)` looks at the
batch's first entry only and frees the batch when it completes, so every batch here holds exactly one
entry and `concurrency` batches are kept in flight; at most 1024 entries may be queued per peer on TCP.
The TCP server rejects addresses outside registered buffers, so a stale table entry fails cleanly.
"""
from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import struct
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ckpt_transfer.checksum import IncrementalChecksum, algorithm_of, checksum_file
from ckpt_transfer.manifest import Manifest, ShardRecord

log = logging.getLogger(__name__)

P2P_HANDSHAKE = "P2PHANDSHAKE"
PARTIAL_SUFFIX = ".partial"
_TABLE_MAGIC = b"TIDECKT1"
_HEADER = struct.Struct("<8sQQI")  # magic, generation, body length, crc32 of body
_BODY_OFFSET = 64
# Served with an iteration when present, pulled when served, although not listed in `aux_files`.
OPTIONAL_FILES = ("model.safetensors.index.json",)


class TransferConfig(BaseModel):
    """Transport settings (the YAML `transfer.mooncake:` section)."""

    model_config = ConfigDict(extra="forbid")

    protocol: Literal["tcp", "rdma"] = Field("tcp", description="How nodes exchange shards: `tcp`, or `rdma` "
                                             "(InfiniBand/RoCE; name the NICs in device_names).")
    device_names: list[str] = Field(default_factory=list, description="RDMA devices to use with protocol rdma, "
                                    "e.g. [\"mlx5_0\", \"mlx5_1\"]; ignored with tcp.")
    handshake: str = Field(P2P_HANDSHAKE, description="How peers find each other: `P2PHANDSHAKE` (directly, no "
                           "metadata server) or a metadata server such as `etcd://10.0.0.1:2379`.")
    local_host: str = Field("127.0.0.1", description="The IP address other nodes reach this node's transfer "
                            "engine on; `auto`: the address Ray knows the node by (clusters: every node agent "
                            "then uses its own node's).")
    bucket_bytes: int = Field(64 << 20, ge=4096, description="Bytes per read request: files are read in buckets "
                              "of this size.")
    concurrency: int = Field(4, ge=1, description="Read requests in flight per pull, across shards and peers; at "
                             "most max_entries_per_batch.")
    max_entries_per_batch: int = Field(1024, ge=1, le=1024, description="Most entries queued per peer (the TCP "
                                       "transport takes at most 1024).")
    retries: int = Field(2, ge=0, description="Extra attempts per file after a failed first one.")
    retry_backoff_s: float = Field(0.2, ge=0, description="Seconds to wait before retrying a failed file.")
    timeout_s: float = Field(30.0, gt=0, description="Seconds allowed for the handshake and the file-table read, "
                             "and per pull attempt plus its bytes / min_bytes_per_s.")
    min_bytes_per_s: float = Field(100e6, gt=0, description="Slowest pull rate tolerated, in bytes per second "
                                   "(sets a pull attempt's deadline with timeout_s).")
    poll_interval_s: float = Field(0.001, ge=0, description="Seconds between polls of a read's status.")
    verify_threads: int = Field(2, ge=1, description="Threads that checksum pulled files (files are spread over "
                                "them; one file is checked in order).")
    unmap_grace_s: float = Field(10.0, ge=0, description="Seconds a file no longer served stays mapped, so that "
                                 "reads already in flight complete.")
    table_bytes: int = Field(4 << 20, ge=4096, description="Size in bytes of the buffer that lists the files a "
                             "node serves.")
    log_level: str = Field("WARNING", description="Mooncake's log level (MC_LOG_LEVEL: INFO, WARNING, ERROR, ...) "
                           "unless the environment sets one.")
    # No gain measured on loopback, and the faulting is serial, before any read starts.
    prefault: bool = Field(False, description="Fault in the destination files' pages (MAP_POPULATE) before "
                           "reading into them.")

    @model_validator(mode="after")
    def _check(self) -> "TransferConfig":
        if self.concurrency > self.max_entries_per_batch:
            raise ValueError("concurrency must not exceed max_entries_per_batch (<= 1024 per peer)")
        return self


class TransferError(RuntimeError):
    """A file could not be pulled; `shard` and `peer` name what failed."""

    def __init__(self, message: str, shard: str | None = None, peer: str | None = None) -> None:
        super().__init__(message)
        self.shard = shard
        self.peer = peer


class PeerUnavailableError(TransferError):
    pass


class ShardNotServedError(TransferError):
    pass


class ChecksumMismatchError(TransferError):
    pass


class TransferTimeoutError(TransferError):
    pass


@dataclass(frozen=True)
class ServedFile:
    key: str
    path: str
    address: int
    nbytes: int
    checksum: str


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


class _Mapped:
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


class _AnonBuffer(_Mapped):
    def __init__(self, nbytes: int) -> None:  # noqa: D107 - anonymous, not a file
        self.nbytes = nbytes
        self.mm = mmap.mmap(-1, nbytes)
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.address = ctypes.addressof(self._anchor)


@dataclass
class _Job:
    item: PullItem
    remote: int
    nbytes: int
    checksum: str
    partial: Path
    final: Path
    buf: _Mapped | None = None
    crc: IncrementalChecksum | None = None
    landed: dict[int, int] = field(default_factory=dict)
    verified_upto: int = 0
    inflight: int = 0
    error: TransferError | None = None
    last_crc: Future | None = None
    zombies: list[int] = field(default_factory=list)  # reads the engine reported timed out (not freed)
    lane: ThreadPoolExecutor | None = None  # the checksum thread this file is fed to


def served_key(run: str, iteration: int, name: str) -> str:
    return f"{run}/{iteration}/{name}"


class MooncakeTransport:
    """One Mooncake engine per process; serves local files and pulls peers' files."""

    def __init__(self, config: TransferConfig | None = None) -> None:
        self.config = config or TransferConfig()
        os.environ.setdefault("MC_LOG_LEVEL", self.config.log_level)
        from mooncake.engine import TransferEngine  # imported here: the module stays importable without it

        self._te = TransferEngine()
        cfg = self.config
        rc = self._te.initialize(cfg.local_host, cfg.handshake, cfg.protocol, ",".join(cfg.device_names))
        if rc != 0:
            raise TransferError(
                f"Mooncake initialize({cfg.local_host!r}, {cfg.handshake!r}, {cfg.protocol!r}, "
                f"{cfg.device_names}) returned {rc}; see the engine log on stderr"
            )
        self._lock = threading.Lock()
        self._served: dict[str, tuple[ServedFile, _Mapped]] = {}
        self._generation = 0
        # The table must be the engine's first registered buffer: peers find it by that.
        self._table = _AnonBuffer(cfg.table_bytes)
        self._register(self._table, "file table")
        self._scratch = _AnonBuffer(cfg.table_bytes)
        self._register(self._scratch, "table scratch")
        self._orphans: list[tuple[list[int], _Mapped]] = []
        self._retired: list[tuple[float, _Mapped]] = []  # unserved mappings waiting out unmap_grace_s
        self._write_table()
        self._closed = False

    # ------------------------------------------------------------------ common
    @property
    def address(self) -> str:
        """What peers pass as `remote_address`."""
        if self.config.handshake == P2P_HANDSHAKE:
            return f"{self.config.local_host}:{self._te.get_rpc_port()}"
        return self.config.local_host

    def _register(self, buf: _Mapped, what: str) -> None:
        if buf.nbytes and self._te.register_memory(buf.address, buf.nbytes) != 0:
            raise TransferError(f"register_memory failed for {what} ({buf.nbytes} bytes)", shard=what)

    def _unregister(self, buf: _Mapped) -> None:
        if buf.nbytes:
            self._te.unregister_memory(buf.address)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._reap_orphans(block_s=1.0)
        self.unserve(list(self._served))
        self._unmap_retired(time.monotonic(), force=True)
        # The table and scratch buffers stay mapped: the engine object may outlive us and still read them.

    # ------------------------------------------------------------------ source side
    def serve(self, files: Mapping[str, str | os.PathLike[str]], checksums: Mapping[str, str] | None = None) -> dict[str, ServedFile]:
        """Map and register files under keys peers ask for. Checksums not given are computed."""
        self._unmap_retired(time.monotonic())
        added: dict[str, ServedFile] = {}
        for key, path in files.items():
            if key in self._served:
                self._drop(key)
            buf = _Mapped(Path(path), 0, create=False)
            try:
                self._register(buf, str(path))
            except Exception:
                buf.close()
                raise
            checksum = (checksums or {}).get(key) or checksum_file(path)
            sf = ServedFile(key=key, path=str(path), address=buf.address, nbytes=buf.nbytes, checksum=checksum)
            self._served[key] = (sf, buf)
            added[key] = sf
        self._write_table()
        return added

    def serve_manifest(self, manifest: Manifest, node: str | None = None) -> dict[str, ServedFile]:
        """Serve a published iteration: its shards (those of `node` when given) and its aux files."""
        d = Path(manifest.directory)
        files: dict[str, Path] = {}
        sums: dict[str, str] = {}
        for s in manifest.shards:
            if node is None or s.node == node:
                k = served_key(manifest.run, manifest.iteration, s.file)
                files[k] = d / s.file
                sums[k] = s.checksum
        for a in [*manifest.aux_files, *OPTIONAL_FILES]:
            if (d / a).exists():
                files[served_key(manifest.run, manifest.iteration, a)] = d / a
        return self.serve(files, sums)

    def unserve(self, keys: Iterable[str] | None = None, prefix: str | None = None) -> list[str]:
        """Stop serving the given keys (or every key starting with `prefix`)."""
        chosen = set(keys or ())
        if prefix is not None:
            chosen |= {k for k in self._served if k.startswith(prefix)}
        dropped = [k for k in chosen if k in self._served]
        with self._lock:
            now = time.monotonic()
            for k in dropped:
                sf, buf = self._served.pop(k)
                self._unregister(buf)
                # A peer's read may still be copying out of it: unmap only after a grace period.
                self._retired.append((now + self.config.unmap_grace_s, buf))
            self._write_table_locked()
            self._unmap_retired(now)
        return dropped

    def _unmap_retired(self, now: float, force: bool = False) -> None:
        keep = []
        for due, buf in self._retired:
            if force or now >= due:
                buf.close()
            else:
                keep.append((due, buf))
        self._retired = keep

    def served(self) -> dict[str, ServedFile]:
        return {k: sf for k, (sf, _) in self._served.items()}

    def _drop(self, key: str) -> None:
        self.unserve([key])

    def _write_table(self) -> None:
        with self._lock:
            self._write_table_locked()

    def _write_table_locked(self) -> None:
        body = json.dumps(
            {k: [sf.address, sf.nbytes, sf.checksum] for k, (sf, _) in self._served.items()},
            separators=(",", ":"),
        ).encode()
        if _BODY_OFFSET + len(body) > self._table.nbytes:
            raise TransferError(f"file table overflow: {len(self._served)} files need {len(body)} bytes; raise table_bytes")
        self._generation += 1
        mm = self._table.mm
        assert mm is not None
        mm[_BODY_OFFSET : _BODY_OFFSET + len(body)] = body
        mm[: _HEADER.size] = _HEADER.pack(_TABLE_MAGIC, self._generation, len(body), zlib.crc32(body))

    # ------------------------------------------------------------------ receiving side
    def fetch_table(self, peer: str, attempts: int = 20) -> dict[str, tuple[int, int, str]]:
        """Read a peer's file table: key -> (address, nbytes, checksum). Bounded by `timeout_s`."""
        base = self._first_buffer(peer)
        for _ in range(attempts):
            mm = self._read_small(peer, base, 4096)
            magic, _gen, n, crc = _HEADER.unpack(mm[: _HEADER.size])
            if magic != _TABLE_MAGIC:
                raise PeerUnavailableError(f"peer {peer} first buffer is not a tide file table", peer=peer)
            if _BODY_OFFSET + n > self.config.table_bytes:
                raise PeerUnavailableError(f"peer {peer} file table larger than table_bytes", peer=peer)
            if _BODY_OFFSET + n > 4096:
                mm = self._read_small(peer, base, _BODY_OFFSET + n)
            body = bytes(mm[_BODY_OFFSET : _BODY_OFFSET + n])
            if zlib.crc32(body) == crc:  # else: read while the peer rewrote it; read again
                return {k: (v[0], v[1], v[2]) for k, v in json.loads(body).items()}
        raise PeerUnavailableError(f"file table of peer {peer} kept changing while read", peer=peer)

    def _first_buffer(self, peer: str) -> int:
        """The peer's first registered buffer (its file table). The handshake runs in a helper thread so
        a peer that accepts connections but never answers (stopped, wedged) cannot block us past
        `timeout_s`."""
        box: list[int] = []
        th = threading.Thread(target=lambda: box.append(self._te.get_first_buffer_address(peer)), daemon=True,
                              name="ckpt-handshake")
        th.start()
        th.join(self.config.timeout_s)
        if not box:
            raise PeerUnavailableError(f"handshake with peer {peer} timed out after {self.config.timeout_s:.0f}s", peer=peer)
        if not box[0] or box[0] < 0:
            raise PeerUnavailableError(f"peer {peer} unreachable (handshake failed)", peer=peer)
        return box[0]

    def _read_small(self, peer: str, remote: int, n: int) -> mmap.mmap:
        """Read n bytes of the peer's memory into the scratch buffer, polled against `timeout_s`. A read
        abandoned at the deadline keeps its buffer (orphaned); a fresh scratch buffer replaces it."""
        scratch = self._scratch
        assert scratch.mm is not None
        bid = self._te.batch_transfer_async_read(peer, [scratch.address], [remote], [n])
        if bid <= 0:
            raise PeerUnavailableError(f"reading the file table of peer {peer} failed (submit)", peer=peer)
        deadline = time.monotonic() + self.config.timeout_s
        while (st := self._te.transfer_check_status(bid)) == 0:
            if time.monotonic() > deadline:
                self._orphans.append(([bid], scratch))
                self._scratch = _AnonBuffer(self.config.table_bytes)
                self._register(self._scratch, "table scratch")
                raise PeerUnavailableError(
                    f"reading the file table of peer {peer} timed out after {self.config.timeout_s:.0f}s", peer=peer)
            time.sleep(self.config.poll_interval_s)
        if st != 1:
            raise PeerUnavailableError(f"reading the file table of peer {peer} failed", peer=peer)
        return scratch.mm

    def pull(
        self,
        shards: Sequence[ShardRecord],
        remote_address: str | Mapping[str, str],
        dest_dir: str | os.PathLike[str],
        *,
        key_prefix: str = "",
        aux_files: Sequence[str] = (),
        on_progress: ProgressHook | None = None,
        fault_hook: FaultHook | None = None,
    ) -> PullStats:
        """Fetch `shards` (and `aux_files`) into `dest_dir`, each verified before it gets its final name.

        `remote_address` is one engine address, or a mapping node -> address (by `ShardRecord.node`; aux
        files come from the first shard's peer). Peers serve the files under `key_prefix + file`.
        """

        def peer_of(node: str) -> str:
            if isinstance(remote_address, str):
                return remote_address
            try:
                return remote_address[node]
            except KeyError:
                raise PeerUnavailableError(f"no transfer-engine address known for node {node!r}") from None

        items = [
            PullItem(key_prefix + s.file, s.file, peer_of(s.node), s.nbytes, s.checksum) for s in shards
        ]
        if aux_files:
            aux_peer = items[0].peer if items else peer_of("")
            items += [PullItem(key_prefix + a, a, aux_peer) for a in aux_files]
        return self.pull_items(items, dest_dir, on_progress=on_progress, fault_hook=fault_hook)

    def pull_manifest(self, manifest: Manifest, remote_address: str | Mapping[str, str], dest_dir: str | os.PathLike[str], **kw) -> PullStats:
        """Pull everything of a manifest served with `serve_manifest` into `dest_dir`."""
        return self.pull(
            manifest.shards, remote_address, dest_dir,
            key_prefix=served_key(manifest.run, manifest.iteration, ""), aux_files=manifest.aux_files, **kw,
        )

    def pull_items(
        self,
        items: Sequence[PullItem],
        dest_dir: str | os.PathLike[str],
        *,
        on_progress: ProgressHook | None = None,
        fault_hook: FaultHook | None = None,
    ) -> PullStats:
        dest = Path(dest_dir)
        dest.mkdir(parents=True, exist_ok=True)
        stats = PullStats()
        t0 = time.perf_counter()
        todo = list(items)
        last: list[TransferError] = []
        self._reap_orphans()
        for attempt in range(1 + self.config.retries):
            stats.attempts = attempt + 1
            done, failed = self._attempt(todo, dest, attempt, on_progress, fault_hook)
            for job in done:
                stats.files += 1
                stats.bytes += job.nbytes
            if not failed:
                stats.seconds = time.perf_counter() - t0
                return stats
            last = [e for _, e in failed]
            stats.failures += [str(e) for e in last]
            for e in last:
                log.warning("pull attempt %d/%d: %s", attempt + 1, 1 + self.config.retries, e)
            todo = [it for it, _ in failed]
            if attempt < self.config.retries:
                time.sleep(self.config.retry_backoff_s * (2**attempt))
        first = last[0]
        more = f" (and {len(last) - 1} more: " + "; ".join(str(e) for e in last[1:]) + ")" if len(last) > 1 else ""
        raise type(first)(
            f"giving up after {1 + self.config.retries} attempts: {first}{more}", shard=first.shard, peer=first.peer
        )

    # One attempt over `items`; returns (jobs done, [(item, error)]).
    def _attempt(
        self,
        items: Sequence[PullItem],
        dest: Path,
        attempt: int,
        on_progress: ProgressHook | None,
        fault_hook: FaultHook | None,
    ) -> tuple[list[_Job], list[tuple[PullItem, TransferError]]]:
        cfg = self.config
        failed: list[tuple[PullItem, TransferError]] = []
        tables: dict[str, dict[str, tuple[int, int, str]] | TransferError] = {}
        jobs: list[_Job] = []
        for it in items:
            if it.peer not in tables:
                try:
                    tables[it.peer] = self.fetch_table(it.peer)
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
            job = _Job(it, addr, nbytes, it.checksum or checksum, final.with_name(final.name + PARTIAL_SUFFIX), final)
            job.crc = IncrementalChecksum(algorithm_of(job.checksum))
            try:
                job.buf = _Mapped(job.partial, nbytes, create=True, populate=cfg.prefault)
                self._register(job.buf, str(job.partial))
            except (OSError, TransferError) as e:
                self._discard(job)
                failed.append((it, TransferError(f"shard {it.name}: cannot allocate {job.partial}: {e}", shard=it.name, peer=it.peer)))
                continue
            jobs.append(job)

        total = sum(j.nbytes for j in jobs)
        deadline = time.monotonic() + cfg.timeout_s + total / cfg.min_bytes_per_s
        queue: deque[tuple[_Job, int, int]] = deque(
            (j, off, min(cfg.bucket_bytes, j.nbytes - off)) for j in jobs for off in range(0, j.nbytes, cfg.bucket_bytes)
        )
        inflight: dict[int, tuple[_Job, int, int]] = {}
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

        done: list[_Job] = []
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

    def _feed_checksum(self, job: _Job) -> None:
        """Checksum the contiguous prefix that has landed (in order; crc runs with the GIL released)."""
        while job.verified_upto in job.landed:
            off = job.verified_upto
            n = job.landed.pop(off)
            assert job.lane is not None
            job.last_crc = job.lane.submit(_crc_range, job, off, n)
            job.verified_upto = off + n

    def _finish(self, job: _Job) -> None:
        if job.buf is not None:
            self._unregister(job.buf)
            job.buf.close()
            job.buf = None
        os.replace(job.partial, job.final)

    def _discard(self, job: _Job) -> None:
        if job.buf is not None and job.zombies:  # the engine may still write into it: keep it mapped
            self._orphans.append((job.zombies, job.buf))
            job.buf = None
        if job.buf is not None:
            self._unregister(job.buf)
            job.buf.close()
            job.buf = None
        job.partial.unlink(missing_ok=True)

    def _orphan(self, inflight: dict[int, tuple[_Job, int, int]]) -> None:
        """Reads abandoned at a deadline may still land: keep their buffers mapped until they resolve."""
        by_job: dict[int, tuple[_Job, list[int]]] = {}
        for bid, (job, _, _) in inflight.items():
            by_job.setdefault(id(job), (job, []))[1].append(bid)
        for job, bids in by_job.values():
            if job.buf is not None:
                self._orphans.append((bids, job.buf))
                job.buf = None
                job.inflight = 0
            job.partial.unlink(missing_ok=True)

    def _reap_orphans(self, block_s: float = 0.0) -> None:
        end = time.monotonic() + block_s
        while self._orphans:
            keep = []
            for bids, buf in self._orphans:
                bids = [b for b in bids if self._te.transfer_check_status(b) in (0, -2)]
                if bids:
                    keep.append((bids, buf))
                else:
                    self._unregister(buf)
                    buf.close()
            self._orphans = keep
            if not keep or time.monotonic() >= end:
                break
            time.sleep(0.01)


def _crc_range(job: _Job, off: int, n: int) -> None:
    assert job.buf is not None and job.buf.mm is not None and job.crc is not None
    with memoryview(job.buf.mm) as whole, whole[off : off + n] as part:
        job.crc.update(part)
