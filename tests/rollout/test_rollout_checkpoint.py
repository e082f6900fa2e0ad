"""Verification of a published iteration before the engine loads it (no engine needed)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from rollout_helpers import WEIGHTS, publish_like

from ckpt_transfer.manifest import Manifest, ShardRecord, TensorRecord
from ckpt_transfer.verify import CheckpointError, engine_checkpoint_dir, layout_difference, tensor_layout, verify_manifest


@pytest.fixture()
def published(tiny_model_dir, tmp_path) -> Manifest:
    return publish_like(tiny_model_dir, tmp_path / "1", 1)


def test_good_iteration_verifies(published):
    assert verify_manifest(published) == published.nbytes > 0
    assert str(engine_checkpoint_dir(published, "scratch")) == published.directory


def _flip_byte(path, offset_from_end: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / WEIGHTS).unlink(), "shard listed in the manifest is missing"),
    (lambda d: (d / "config.json").unlink(), "config.json: missing"),
    (lambda d: (d / WEIGHTS).write_bytes((d / WEIGHTS).read_bytes()[:-4]), "bytes on disk, manifest says"),
    (lambda d: _flip_byte(d / WEIGHTS), "checksum"),
    (lambda d: (d / WEIGHTS).write_bytes(b"\xff" * 8 + (d / WEIGHTS).read_bytes()[8:]), "header"),
])
def test_damaged_iteration_is_refused_naming_the_problem(published, damage, message):
    from pathlib import Path

    damage(Path(published.directory))
    with pytest.raises(CheckpointError, match=message):
        verify_manifest(published)


def test_manifest_disagreeing_with_the_file_is_refused(published):
    shard = published.shards[0]
    t0 = shard.tensors[0]
    wrong = dataclasses.replace(t0, shape=tuple(s + 1 for s in t0.shape))
    bad = dataclasses.replace(published, shards=[dataclasses.replace(shard, tensors=(wrong, *shard.tensors[1:]))])
    with pytest.raises(CheckpointError, match=f"tensor '{t0.name}' has shape"):
        verify_manifest(bad)
    ghost = TensorRecord("model.not_there.weight", "float32", (2, 2))
    bad = dataclasses.replace(published, shards=[dataclasses.replace(shard, tensors=(*shard.tensors, ghost))])
    with pytest.raises(CheckpointError, match="missing from the file"):
        verify_manifest(bad)


def test_tp_sharded_iteration_is_merged_for_the_engine(published, tmp_path):
    """Two TP shards of every matrix (split on dim 0) come back whole, in a scratch dir inside the iteration."""
    from safetensors.torch import load_file, save_file

    from ckpt_transfer.checksum import checksum_file

    src = load_file(f"{published.directory}/{WEIGHTS}")
    d = tmp_path / "tp2"
    d.mkdir()
    for name in published.aux_files:
        (d / name).write_bytes((tmp_path / "1" / name).read_bytes())
    shards = []
    for rank in range(2):
        part = {n: (t.chunk(2, 0)[rank].contiguous() if t.dim() == 2 else t) for n, t in src.items()}
        f = f"model-tp{rank}.safetensors"
        save_file(part, str(d / f))
        recs = tuple(TensorRecord(n, "float32", tuple(t.shape), rank, 2, 0 if src[n].dim() == 2 else None)
                     for n, t in part.items() if src[n].dim() == 2 or rank == 0)
        shards.append(ShardRecord(f, "local", (d / f).stat().st_size, checksum_file(d / f), recs))
    manifest = Manifest("test", 1, str(d), shards, published.aux_files, tp_size=2)
    verify_manifest(manifest)
    out = engine_checkpoint_dir(manifest, "engine-whole")
    assert out == d / "engine-whole"
    merged = load_file(str(out / WEIGHTS))
    assert merged.keys() == src.keys()
    assert all(torch.equal(merged[n], src[n]) for n in src)
    assert (out / "config.json").is_file()


def test_layout_difference_names_what_cannot_be_loaded_in_place(published, tiny_model_dir, tmp_path):
    base = tensor_layout(tiny_model_dir)
    assert base and layout_difference(tensor_layout(published.directory), base) is None
    name = sorted(base)[0]
    assert name in layout_difference({k: v for k, v in base.items() if k != name}, base)
    assert "unknown to the running model" in layout_difference({**base, "extra.weight": ("F32", (1,))}, base)
    assert name in layout_difference({**base, name: ("F32", (3, 3))}, base)
