"""Checks a published iteration before an engine loads it, and gives the HF directory the engine reads.

No vLLM, torch or Ray imports on the checking path: only the manifest, file sizes, safetensors headers and
checksums are read (torch only when TP shards must be merged into whole tensors)."""
from __future__ import annotations

from pathlib import Path

from .checksum import ShardVerificationError, verify_shard
from .manifest import Manifest, ShardRecord
from .safetensors_format import SafetensorsHeaderError, read_header, same_dtype


class CheckpointError(RuntimeError):
    """A published iteration that must not be loaded; the message names the file and the problem."""


def _header(path: Path) -> dict:
    try:
        return read_header(path)
    except SafetensorsHeaderError as e:
        raise CheckpointError(str(e)) from None


def _check_tensors(path: Path, shard: ShardRecord) -> None:
    header = _header(path)
    for t in shard.tensors:
        entry = header.get(t.name)
        if entry is None:
            raise CheckpointError(f"{path}: tensor {t.name!r} listed in the manifest is missing from the file")
        if tuple(entry["shape"]) != tuple(t.shape):
            raise CheckpointError(
                f"{path}: tensor {t.name!r} has shape {tuple(entry['shape'])}, manifest says {tuple(t.shape)}"
            )
        if not same_dtype(entry["dtype"], t.dtype):
            raise CheckpointError(f"{path}: tensor {t.name!r} has dtype {entry['dtype']}, manifest says {t.dtype}")


def verify_manifest(manifest: Manifest) -> int:
    """Raise CheckpointError unless every file of the iteration is present and has the size, tensors and
    checksum the manifest records (and a model's config.json; an adapter's manifest has none). Returns the number
    of shard bytes checked."""
    directory = Path(manifest.directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    if not manifest.shards:
        raise CheckpointError(f"manifest of {manifest.run}/{manifest.iteration} lists no shards")
    for name in [*([] if manifest.is_adapter else ["config.json"]), *manifest.aux_files]:
        if not (directory / name).is_file():
            raise CheckpointError(f"{directory / name}: missing (listed in the manifest or required by HF)")
    for shard in manifest.shards:
        path = directory / shard.file
        if not path.is_file():
            raise CheckpointError(f"{path}: shard listed in the manifest is missing")
        size = path.stat().st_size
        if size != shard.nbytes:
            raise CheckpointError(f"{path}: {size} bytes on disk, manifest says {shard.nbytes}")
        _check_tensors(path, shard)
        try:
            verify_shard(path, shard)
        except (ShardVerificationError, ValueError, ImportError) as e:
            raise CheckpointError(f"{path}: checksum verification failed: {e}") from None
    return manifest.nbytes


def tensor_layout(directory: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) over every safetensors file of an HF directory (headers only)."""
    layout: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        for name, entry in _header(path).items():
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
            return (f"tensor {name!r} is {new[name][0]}{list(new[name][1])}, "
                    f"the running model has {old[name][0]}{list(old[name][1])}")
    return None


def engine_checkpoint_dir(manifest: Manifest, scratch_name: str) -> Path:
    """The HF directory the engine loads for this iteration: the published directory when every tensor is
    whole; otherwise TP shards are merged into whole tensors in `<directory>/<scratch_name>` (vLLM's loader
    slices whole tensors for the engine's own TP degree), removed with the iteration."""
    if manifest.is_whole:
        return Path(manifest.directory)
    from .reslice import materialize_whole

    try:
        return materialize_whole(manifest, Path(manifest.directory) / scratch_name)
    except Exception as e:
        raise CheckpointError(f"merging the TP shards of {manifest.directory} failed: {type(e).__name__}: {e}") from e
