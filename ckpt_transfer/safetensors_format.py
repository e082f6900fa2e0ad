"""The safetensors file prefix, read and written in one place: a little-endian u64 header length, then a JSON
header mapping each tensor name to its dtype tag, shape and byte range. The writer builds it (it writes the
tensor bytes itself, into recycled pages); the verifier and the engine read it back without loading any
tensor. Importing this module imports neither torch nor safetensors."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Mapping, Sequence

MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit; a larger length means a corrupt file

# dtype tag -> the names a manifest may use for it (torch's or safetensors' spelling)
DTYPE_ALIASES = {
    "F32": {"F32", "float32", "torch.float32", "float"},
    "F16": {"F16", "float16", "torch.float16", "half"},
    "BF16": {"BF16", "bfloat16", "torch.bfloat16"},
    "F64": {"F64", "float64", "torch.float64"},
    "I64": {"I64", "int64", "torch.int64"},
    "I32": {"I32", "int32", "torch.int32"},
    "I8": {"I8", "int8", "torch.int8"},
    "U8": {"U8", "uint8", "torch.uint8"},
    "BOOL": {"BOOL", "bool", "torch.bool"},
}
_TAG_OF = {alias: tag for tag, aliases in DTYPE_ALIASES.items() for alias in aliases}


class SafetensorsHeaderError(ValueError):
    """A file whose safetensors header cannot be read; the message names the file."""


def dtype_tag(dtype: Any) -> str:
    """The safetensors tag ("F32", "BF16", ...) of a torch dtype or a dtype name."""
    try:
        return _TAG_OF[str(dtype)]
    except KeyError:
        raise ValueError(f"no safetensors dtype for {dtype!r}") from None


def same_dtype(tag: str, name: str) -> bool:
    return name in DTYPE_ALIASES.get(tag, {tag})


def encode_header(tensors: Sequence[tuple[str, Any]], metadata: Mapping[str, str],
                  shapes: Mapping[str, tuple[int, ...]] | None = None) -> bytes:
    """The prefix for `tensors` (name, torch tensor) laid out in the given order: length, then the JSON header
    padded with spaces to 8 bytes so tensor data starts aligned; `shapes` overrides a tensor's shape (same
    elements, same order)."""
    header: dict = {"__metadata__": dict(metadata)}
    offset = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        shape = list((shapes or {}).get(name, t.shape))
        header[name] = {"dtype": dtype_tag(t.dtype), "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % 8)
    return struct.pack("<Q", len(text)) + text


def read_header(path: str | os.PathLike[str]) -> dict[str, dict]:
    """name -> {"dtype", "shape", "data_offsets"} of every tensor in a safetensors file (metadata dropped)."""
    path = Path(path)
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise SafetensorsHeaderError(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES:
            raise SafetensorsHeaderError(f"{path}: safetensors header length {n} is implausible (corrupt file?)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsHeaderError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsHeaderError(f"{path}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    return header
