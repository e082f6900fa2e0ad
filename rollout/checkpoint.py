"""Checks a published iteration before an engine loads it, and turns it into an HF directory the engine can
read. No vLLM, torch or Ray imports: only the manifest, file sizes and safetensors headers are read."""
from __future__ import annotations

import json
import struct
from pathlib import Path

from ckpt_transfer.manifest import Manifest, ShardRecord

# safetensors dtype tags -> the names the manifest may use for them (torch or safetensors spelling).
_DTYPE_ALIASES = {
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


class CheckpointError(RuntimeError):
    """A published iteration that must not be loaded; the message names the file and the problem."""


def _safetensors_header(path: Path) -> dict:
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 2**20:
            raise CheckpointError(f"{path}: safetensors header length {n} is implausible (corrupt file?)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from None
    header.pop("__metadata__", None)
    return header


def _check_tensors(path: Path, shard: ShardRecord) -> None:
    header = _safetensors_header(path)
    for t in shard.tensors:
        entry = header.get(t.name)
        if entry is None:
            raise CheckpointError(f"{path}: tensor {t.name!r} listed in the manifest is missing from the file")
        if tuple(entry["shape"]) != tuple(t.shape):
            raise CheckpointError(
                f"{path}: tensor {t.name!r} has shape {tuple(entry['shape'])}, manifest says {tuple(t.shape)}"
            )
        if t.dtype not in _DTYPE_ALIASES.get(entry["dtype"], {entry["dtype"]}):
            raise CheckpointError(f"{path}: tensor {t.name!r} has dtype {entry['dtype']}, manifest says {t.dtype}")


def _checksum_verifier():
    """`ckpt_transfer.checksum.verify_shard(path, record)` when that module exists, else None."""
    try:
        from ckpt_transfer.checksum import verify_shard
    except ImportError:
        return None
    return verify_shard


def verify_manifest(manifest: Manifest) -> int:
    """Raise CheckpointError unless every file of the iteration is present, has the size, tensors and (when
    checksums are available) the checksum the manifest records. Returns the number of shard bytes checked."""
    directory = Path(manifest.directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    if not manifest.shards:
        raise CheckpointError(f"manifest of {manifest.run}/{manifest.iteration} lists no shards")
    for name in ["config.json", *manifest.aux_files]:
        if not (directory / name).is_file():
            raise CheckpointError(f"{directory / name}: missing (listed in the manifest or required by HF)")
    verify_shard = _checksum_verifier()
    for shard in manifest.shards:
        path = directory / shard.file
        if not path.is_file():
            raise CheckpointError(f"{path}: shard listed in the manifest is missing")
        size = path.stat().st_size
        if size != shard.nbytes:
            raise CheckpointError(f"{path}: {size} bytes on disk, manifest says {shard.nbytes}")
        _check_tensors(path, shard)
        if verify_shard is not None:
            try:
                ok = verify_shard(path, shard)
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(f"{path}: checksum verification failed: {e}") from e
            if ok is False:
                raise CheckpointError(f"{path}: checksum does not match the manifest ({shard.checksum})")
    return manifest.nbytes


def tensor_layout(directory: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) over every safetensors file of an HF directory (headers only)."""
    layout: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        for name, entry in _safetensors_header(path).items():
            layout[name] = (entry["dtype"], tuple(entry["shape"]))
    return layout


def layout_difference(new: dict, old: dict) -> str | None:
    """Why weights with layout `new` cannot be loaded in place over `old` (None when they can)."""
    if missing := sorted(old.keys() - new.keys()):
        return f"{len(missing)} tensors of the running model are absent, e.g. {missing[:3]}"
    if extra := sorted(new.keys() - old.keys()):
        return f"{len(extra)} tensors unknown to the running model, e.g. {extra[:3]}"
    for name in sorted(new):
        if new[name] != old[name]:
            return f"tensor {name!r} is {new[name][0]}{list(new[name][1])}, the running model has {old[name][0]}{list(old[name][1])}"
    return None


def is_whole(manifest: Manifest) -> bool:
    return manifest.tp_size == 1 and all(t.tp_dim is None or t.tp_size == 1 for s in manifest.shards for t in s.tensors)


def engine_checkpoint_dir(manifest: Manifest, scratch_name: str) -> Path:
    """The HF directory the engine loads for this iteration: the published directory when every tensor is
    whole; otherwise TP shards are merged into whole tensors in `<directory>/<scratch_name>` (vLLM's loader
    slices whole tensors for the engine's own TP degree), removed with the iteration."""
    if is_whole(manifest):
        return Path(manifest.directory)
    from ckpt_transfer.reslice import materialize_whole

    try:
        return materialize_whole(manifest, Path(manifest.directory) / scratch_name)
    except Exception as e:
        raise CheckpointError(f"merging the TP shards of {manifest.directory} failed: {type(e).__name__}: {e}") from e
