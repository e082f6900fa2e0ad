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

This module is the transport's door. Below it: the file table's format (file_table.py), the engine's registered
memory (engine_memory.py), one pull attempt (pull_attempt.py) and the errors (transfer_errors.py); the settings
are `TransferConfig` (config.py).
"""
from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from ckpt_transfer.checksum import checksum_file
from ckpt_transfer.manifest import Manifest, ShardRecord

from .config import P2P_HANDSHAKE, TransferConfig
from .engine_memory import AnonBuffer, EngineMemory, MappedFile
from .file_table import (FIRST_READ_BYTES, BODY_OFFSET, ServedFile, TableEntries, read_entries, read_header,
                         served_key, write_table)
from .pull_attempt import PARTIAL_SUFFIX, FaultHook, ProgressHook, PullAttempt, PullItem, PullStats
from .transfer_errors import (ChecksumMismatchError, PeerUnavailableError, ShardNotServedError, TransferError,
                              TransferTimeoutError)

__all__ = ["MooncakeTransport", "TransferConfig", "P2P_HANDSHAKE", "PARTIAL_SUFFIX", "OPTIONAL_FILES", "ServedFile",
           "served_key", "PullItem", "PullStats", "FaultHook", "ProgressHook", "TransferError", "PeerUnavailableError",
           "ShardNotServedError", "ChecksumMismatchError", "TransferTimeoutError"]

log = logging.getLogger(__name__)

# Served with an iteration when present, pulled when served, although not listed in `aux_files`.
OPTIONAL_FILES = ("model.safetensors.index.json",)


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
        self._memory = EngineMemory(self._te)
        self._lock = threading.Lock()
        self._served: dict[str, tuple[ServedFile, MappedFile]] = {}
        self._generation = 0
        # The table must be the engine's first registered buffer: peers find it by that.
        self._table = AnonBuffer(cfg.table_bytes)
        self._memory.register(self._table, "file table")
        self._scratch = AnonBuffer(cfg.table_bytes)
        self._memory.register(self._scratch, "table scratch")
        self._retired: list[tuple[float, MappedFile]] = []  # unserved mappings waiting out unmap_grace_s
        self._write_table()
        self._closed = False

    # ------------------------------------------------------------------ common
    @property
    def address(self) -> str:
        """What peers pass as `remote_address`."""
        if self.config.handshake == P2P_HANDSHAKE:
            return f"{self.config.local_host}:{self._te.get_rpc_port()}"
        return self.config.local_host

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._memory.reap_orphans(block_s=1.0)
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
            buf = MappedFile(Path(path), 0, create=False)
            try:
                self._memory.register(buf, str(path))
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
                self._memory.unregister(buf)
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
        mm = self._table.mm
        assert mm is not None
        write_table(mm, self._generation + 1, self.served())
        self._generation += 1

    # ------------------------------------------------------------------ receiving side
    def fetch_table(self, peer: str, attempts: int = 20) -> TableEntries:
        """Read a peer's file table: key -> (address, nbytes, checksum). Bounded by `timeout_s`."""
        base = self._first_buffer(peer)
        for _ in range(attempts):
            mm = self._read_small(peer, base, FIRST_READ_BYTES)
            n, crc = read_header(mm, peer, self.config.table_bytes)
            if BODY_OFFSET + n > FIRST_READ_BYTES:
                mm = self._read_small(peer, base, BODY_OFFSET + n)
            if (entries := read_entries(mm, n, crc)) is not None:  # else: read while the peer rewrote it; read again
                return entries
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
                self._memory.orphan([bid], scratch)
                self._scratch = AnonBuffer(self.config.table_bytes)
                self._memory.register(self._scratch, "table scratch")
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
        self._memory.reap_orphans()
        for attempt in range(1 + self.config.retries):
            stats.attempts = attempt + 1
            done, failed = PullAttempt(self._te, self._memory, self.config, self.fetch_table, attempt, on_progress,
                                       fault_hook).run(todo, dest)
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

