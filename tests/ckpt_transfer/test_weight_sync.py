"""The orchestrator's door to weight hand-over, shared-memory implementation (the Mooncake one runs in
tests/integration/test_loop.py::test_two_rollout_nodes_pull_weights_through_mooncake): staging directories
never reuse half-written shards, verification refuses a damaged copy, gc keeps `keep_last` iterations and
recycles the rest, close removes the run's shared memory."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from ckpt_transfer import CheckpointError, PublishConfig, SharedMemorySync, WeightTransferConfig, open_weight_sync
from ckpt_transfer.checksum import checksum_file
from ckpt_transfer.manifest import Manifest, ShardRecord, TensorRecord
from ckpt_transfer.owners import OWNER_FILE
from ckpt_transfer.recycle import RECYCLE_DIR
from ckpt_transfer.safetensors_format import SafetensorsHeaderError, read_header


def _publish(sync: SharedMemorySync, iteration: int) -> Manifest:
    """What the trainer ranks and TrainerGroup.publish do: shards and config into the staging directory,
    then the manifest, last."""
    d = sync.staging_dir(iteration)
    d.mkdir(parents=True)
    w = torch.full((4, 8), float(iteration))
    save_file({"w": w}, str(d / "model-00000.safetensors"))
    (d / "config.json").write_text(json.dumps({"model_type": "toy"}))
    f = d / "model-00000.safetensors"
    shard = ShardRecord(f.name, "local", f.stat().st_size, checksum_file(f), (TensorRecord("w", "float32", (4, 8)),))
    manifest = Manifest("toy", iteration, str(d), [shard], aux_files=[])
    manifest.save()
    sync.publish(manifest)
    return manifest


@pytest.fixture()
def sync(tmp_path):
    s = open_weight_sync("toy", PublishConfig(shm_root=str(tmp_path / "shm"), keep_last=2), WeightTransferConfig(),
                         engines=2, trainer_nodes="local", namespace="unused")
    assert isinstance(s, SharedMemorySync)
    yield s
    s.close()


def test_pull_gives_every_engine_the_verified_publish(sync):
    m = _publish(sync, 1)
    delivery = sync.pull(m)
    assert [d.directory for d in delivery.manifests] == [m.directory, m.directory]
    assert sync.verify(m) == m.nbytes
    assert sync.engine_dirs(m) == [m.directory, m.directory]


def test_staging_dir_discards_what_a_killed_run_left(sync):
    d = sync.staging_dir(3)
    d.mkdir(parents=True)
    (d / "model-00000.safetensors.partial").write_bytes(b"half")
    assert not sync.staging_dir(3).exists()


def test_damaged_copy_is_refused_by_name(sync):
    m = _publish(sync, 1)
    shard = sync.root / f"{1:07d}" / "model-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model-00000.safetensors: checksum"):
        sync.engine_dirs(m)


def test_gc_keeps_the_newest_and_recycles_the_rest(sync):
    for it in (1, 2, 3):
        _publish(sync, it)
        sync.gc(it)
    kept = sorted(p.name for p in sync.root.iterdir() if p.name not in (RECYCLE_DIR, OWNER_FILE))
    assert kept == [f"{2:07d}", f"{3:07d}"]
    assert any((sync.root / RECYCLE_DIR).iterdir()), "collected shard files go to the recycle pool"
    sync.close()
    assert not sync.root.exists()


def test_header_reader_reads_library_files_and_names_corrupt_ones(tmp_path):
    save_file({"a": torch.zeros(2, 3), "b": torch.ones(5, dtype=torch.bfloat16)}, str(tmp_path / "x.safetensors"))
    header = read_header(tmp_path / "x.safetensors")
    assert {k: (v["dtype"], v["shape"]) for k, v in header.items()} == {"a": ("F32", [2, 3]), "b": ("BF16", [5])}
    (tmp_path / "short.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(SafetensorsHeaderError, match="short.safetensors: too short"):
        read_header(tmp_path / "short.safetensors")
    (tmp_path / "huge.safetensors").write_bytes((2**40).to_bytes(8, "little") + b"{}")
    with pytest.raises(SafetensorsHeaderError, match="huge.safetensors: .*implausible"):
        read_header(tmp_path / "huge.safetensors")
