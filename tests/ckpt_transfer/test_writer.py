"""The shard writer: hand-written safetensors files that the library reads back bit for bit, files written
by several threads, and the recycle pool that lets a publish overwrite the pages of a collected iteration."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from ckpt_transfer import gc
from ckpt_transfer.checksum import checksum_file
from ckpt_transfer.convert.common import HFTensor
from ckpt_transfer.recycle import RECYCLE_DIR, take_recycled
from ckpt_transfer.writer import split_in_order, write_safetensors, write_shards, writer_process_env


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(33, 17, generator=g)),
        ("b.bias", torch.randn(5, generator=g).to(torch.bfloat16)),
        ("c.scalar", torch.tensor(3.5)),
        ("d.empty", torch.empty(0, 4)),
        ("e.half", torch.randn(7, 3, generator=g).to(torch.float16)),
    ]


def _read(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_written_file_reads_back_with_safetensors(tmp_path):
    tensors = _tensors()
    nbytes, checksum = write_safetensors(tmp_path / "x.safetensors", tensors, {"format": "pt"})
    path = tmp_path / "x.safetensors"
    assert nbytes == path.stat().st_size
    assert checksum == checksum_file(path)
    back = _read(path)
    assert set(back) == {n for n, _ in tensors}
    for name, t in tensors:
        assert back[name].dtype == t.dtype and back[name].shape == t.shape
        assert torch.equal(back[name], t), name
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize("piece", [1 << 20, 24])  # whole tensors per copy; pieces that cut rows and elements
@pytest.mark.parametrize("pool_file_bytes", [10, 1 << 20])  # smaller and larger than the shard
def test_recycled_file_is_resized_and_fully_overwritten(tmp_path, pool_file_bytes, piece, monkeypatch):
    monkeypatch.setattr("ckpt_transfer.writer.COPY_PIECE", piece)
    pool = tmp_path / RECYCLE_DIR
    pool.mkdir()
    (pool / "old.safetensors").write_bytes(b"\xff" * pool_file_bytes)
    tensors = _tensors()
    nbytes, checksum = write_safetensors(tmp_path / "x.safetensors", tensors, {"format": "pt"}, recycle_pool=pool)
    assert not list(pool.iterdir()), "the pool file was not taken"
    path = tmp_path / "x.safetensors"
    assert path.stat().st_size == nbytes and checksum == checksum_file(path)
    for name, t in tensors:
        assert torch.equal(_read(path)[name], t)


def test_take_recycled_prefers_the_smallest_file_that_fits(tmp_path):
    pool = tmp_path / "pool"
    pool.mkdir()
    for name, size in (("s", 10), ("m", 100), ("l", 1000)):
        (pool / name).write_bytes(b"\0" * size)
    assert take_recycled(pool, 50, tmp_path / "x") and (tmp_path / "x").stat().st_size == 100
    assert take_recycled(pool, 5000, tmp_path / "y") and (tmp_path / "y").stat().st_size == 1000
    assert take_recycled(pool, 1, tmp_path / "z") and (tmp_path / "z").stat().st_size == 10
    assert not take_recycled(pool, 1, tmp_path / "w")
    assert not take_recycled(tmp_path / "missing", 1, tmp_path / "w")


def _publish(root, iteration: int, tensors, shard_bytes=1 << 30) -> list:
    out = root / f"{iteration:07d}"
    stream = (HFTensor(n, t, 0, 1, None) for n, t in tensors)
    records = write_shards(stream, out, node="n0", prefix="model", shard_bytes=shard_bytes)
    (out / "manifest.json").write_text("{}")
    return records


def test_gc_recycles_collected_shards_into_a_bounded_pool(tmp_path):
    root = tmp_path / "run"
    tensors = [("w", torch.randn(256, 256))]
    for it in (1, 2, 3):
        _publish(root, it, [(n, t + it) for n, t in tensors], shard_bytes=100_000)
    shard_files = sorted(p.name for p in (root / "0000001").glob("*.safetensors"))
    assert len(shard_files) == 1
    assert gc.gc_iterations(root, keep_last=1, recycle=True) == [1, 2]
    pool = sorted((root / RECYCLE_DIR).iterdir())
    # two iterations' shards were collected; the pool keeps one iteration's bytes
    assert len(pool) == 1
    assert [it for it, _ in gc.iteration_dirs(root)] == [3], "the pool must not look like an iteration"
    records = _publish(root, 4, [(n, t + 4) for n, t in tensors])
    assert not list((root / RECYCLE_DIR).iterdir()), "the next publish did not reuse the pool file"
    assert torch.equal(_read(root / "0000004" / records[0].file)["w"], tensors[0][1] + 4)


def test_gc_without_recycle_deletes(tmp_path):
    root = tmp_path / "run"
    for it in (1, 2):
        _publish(root, it, [("w", torch.ones(4))])
    assert gc.gc_iterations(root, keep_last=1) == [1]
    assert not (root / RECYCLE_DIR).exists() and not (root / "0000001").exists()


@pytest.mark.parametrize("threads", [1, 3])
def test_threads_spread_the_stream_over_files_in_order(tmp_path, threads, monkeypatch):
    monkeypatch.setattr("ckpt_transfer.writer.MIN_SPLIT_BYTES", 1000)
    tensors = [(f"t{i}", torch.full((100,), float(i))) for i in range(12)]  # 400 bytes each
    stream = (HFTensor(n, t, 0, 1, None) for n, t in tensors)
    records = write_shards(stream, tmp_path, node="n0", prefix="m", shard_bytes=1 << 20, threads=threads)
    # one file under the shard size when written alone; else the 4800 bytes over `threads` files
    assert len(records) == (1 if threads == 1 else 3)
    assert [t.name for r in records for t in r.tensors] == [n for n, _ in tensors]
    for r in records:
        assert checksum_file(tmp_path / r.file) == r.checksum and (tmp_path / r.file).stat().st_size == r.nbytes
        back = _read(tmp_path / r.file)
        for t in r.tensors:
            assert torch.equal(back[t.name], dict(tensors)[t.name])


@pytest.mark.parametrize("piece", [1 << 20, 40])  # whole views per copy; a few rows per copy
def test_reshaping_views_are_written_in_their_hf_shape_new_and_recycled(tmp_path, piece, monkeypatch):
    """q/k/v come out of the fused QKV as strided views with an HF shape; fresh and recycled files alike
    must hold the materialised tensor."""
    monkeypatch.setattr("ckpt_transfer.writer.COPY_PIECE", piece)
    fused = torch.arange(6 * 10 * 8, dtype=torch.float32).reshape(6, 10, 8)  # 6 groups of 10 rows
    q = fused[:, :6]  # [6, 6, 8], not contiguous; HF shape [36, 8]
    root = tmp_path / "run"
    for it in (1, 2, 3, 4):
        stream = [HFTensor("q", q + it, 0, 1, None, shape=(36, 8)), HFTensor("b", fused[:, 7, 0] + it)]
        records = write_shards(iter(stream), root / f"{it:07d}", node="n0", prefix="m", shard_bytes=1 << 20)
        assert records[0].tensors[0].shape == (36, 8)
        back = _read(root / f"{it:07d}" / records[0].file)
        assert torch.equal(back["q"], (q + it).reshape(36, 8)) and torch.equal(back["b"], fused[:, 7, 0] + it)
        (root / f"{it:07d}" / "manifest.json").write_text("{}")
        gc.gc_iterations(root, keep_last=1, recycle=True)


def test_split_in_order_balances_parts_and_respects_the_cap():
    assert split_in_order([400] * 12, 3, 1 << 20) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    # files filled greedily up to total/parts bytes (5) would need a third file here
    assert split_in_order([3, 3, 3, 1], 2, 1 << 20) == [[0, 1], [2, 3]]
    groups = split_in_order([400] * 12, 1, 1000)
    assert sum(groups, []) == list(range(12)) and all(len(g) * 400 <= 1000 for g in groups)
    assert split_in_order([5000, 10], 2, 1000) == [[0], [1]]  # an item over the cap gets a file of its own
    assert split_in_order([], 2, 1000) == []


def test_writer_process_env_keeps_existing_glibc_tunables():
    own = writer_process_env({})["GLIBC_TUNABLES"]
    assert own.startswith("glibc.cpu.x86_non_temporal_threshold=")
    assert writer_process_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})["GLIBC_TUNABLES"] == \
        f"glibc.malloc.arena_max=2:{own}"


def test_finalize_accepts_shards_along_a_dimension_and_refuses_a_tensor_published_twice(tmp_path):
    """A tensor is published whole once, or as shards each index once: TP shards, or an expert-parallel rank's block
    of a stacked expert tensor (gpt_oss) in a tp-1 manifest, which then gets no HF index (the engines' directory
    merges the shards first). The same shard index twice, or a whole copy beside shards, is refused."""
    from ckpt_transfer.manifest import Manifest, ShardRecord, TensorRecord
    from ckpt_transfer.writer import INDEX_FILE, finalize_manifest

    def manifest(*records: TensorRecord) -> Manifest:
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        shards = [ShardRecord(file=f"s{k}.safetensors", node="n", nbytes=1, checksum="c", tensors=(r,))
                  for k, r in enumerate(records)]
        return Manifest(run="r", iteration=1, directory=str(d), shards=shards, tp_size=1)

    block = [TensorRecord("experts.down_proj", "float32", (2, 4, 4), k, 2, 0) for k in range(2)]
    split = manifest(*block, TensorRecord("norm.weight", "float32", (4,)))
    finalize_manifest(split)
    assert not (tmp_path / split.directory / INDEX_FILE).exists()
    whole = manifest(TensorRecord("norm.weight", "float32", (4,)))
    finalize_manifest(whole)
    assert (tmp_path / whole.directory / INDEX_FILE).exists()
    for twice in ([block[0], block[0]], [block[0], TensorRecord("experts.down_proj", "float32", (4, 4, 4))],
                  [TensorRecord("norm.weight", "float32", (4,))] * 2):
        with pytest.raises(ValueError, match="tensor names published twice: \\['(experts.down_proj|norm.weight)'\\]"):
            finalize_manifest(manifest(*twice))
