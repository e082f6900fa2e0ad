"""The file table: which files a node's transfer engine serves, where in its memory, of what size and checksum.
It lives in the first buffer the engine registers, so that a peer needs nothing but the engine's address.

Layout: a header (magic, generation, body length, crc32 of the body) at 0 and the body, JSON key -> [address,
nbytes, checksum], at BODY_OFFSET. The owner rewrites the body, then the header; a reader whose body does not match
the header's crc32 read it while it was rewritten, and reads again."""
from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .transfer_errors import PeerUnavailableError, TransferError

TABLE_MAGIC = b"TIDECKT1"
HEADER = struct.Struct("<8sQQI")  # magic, generation, body length, crc32 of body
BODY_OFFSET = 64
FIRST_READ_BYTES = 4096  # a reader's first read: the header, and the whole body of a small table

TableEntries = dict[str, tuple[int, int, str]]  # key -> (address, nbytes, checksum)


@dataclass(frozen=True)
class ServedFile:
    """A file a node serves: under `key`, mapped at `address` of its engine's memory."""

    key: str
    path: str
    address: int
    nbytes: int
    checksum: str


def served_key(run: str, iteration: int, name: str) -> str:
    """The key a file of a published iteration is served under."""
    return f"{run}/{iteration}/{name}"


def write_table(mm: Any, generation: int, served: Mapping[str, ServedFile]) -> None:
    """Write the table of `served` (key -> file) into the buffer `mm` as `generation`; TransferError when it does
    not fit."""
    body = json.dumps(
        {k: [sf.address, sf.nbytes, sf.checksum] for k, sf in served.items()},
        separators=(",", ":"),
    ).encode()
    if BODY_OFFSET + len(body) > len(mm):
        raise TransferError(f"file table overflow: {len(served)} files need {len(body)} bytes; raise table_bytes")
    mm[BODY_OFFSET : BODY_OFFSET + len(body)] = body
    mm[: HEADER.size] = HEADER.pack(TABLE_MAGIC, generation, len(body), zlib.crc32(body))


def read_header(head: Any, peer: str, table_bytes: int) -> tuple[int, int]:
    """(body length, crc32 of the body) from the start of `peer`'s table; PeerUnavailableError when its first
    buffer holds no table, or a larger one than `table_bytes`."""
    magic, _gen, n, crc = HEADER.unpack(head[: HEADER.size])
    if magic != TABLE_MAGIC:
        raise PeerUnavailableError(f"peer {peer} first buffer is not a tide file table", peer=peer)
    if BODY_OFFSET + n > table_bytes:
        raise PeerUnavailableError(f"peer {peer} file table larger than table_bytes", peer=peer)
    return n, crc


def read_entries(table: Any, n: int, crc: int) -> TableEntries | None:
    """The entries of a table read into `table` whose header gave (n, crc); None when the body does not match
    (read while the peer rewrote it)."""
    body = bytes(table[BODY_OFFSET : BODY_OFFSET + n])
    if zlib.crc32(body) != crc:
        return None
    return {k: (v[0], v[1], v[2]) for k, v in json.loads(body).items()}
