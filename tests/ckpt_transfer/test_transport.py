"""Transport and node agent over TCP on loopback: round trip between two processes, faults, GC."""
from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ckpt_transfer import gc
from ckpt_transfer.checksum import (
    ALGORITHM,
    ShardVerificationError,
    checksum_buffer,
    checksum_file,
    shard_ok,
    verify_shard,
)
from ckpt_transfer.manifest import MANIFEST_FILE, Manifest, ShardRecord
from ckpt_transfer.node_agent import NodeAgent
from ckpt_transfer.transport import (
    ChecksumMismatchError,
    PeerUnavailableError,
    ShardNotServedError,
    TransferConfig,
    TransferTimeoutError,
)

FAST_RETRY = dict(retries=2, retry_backoff_s=0.05, timeout_s=20)


def _no_partials(root: Path) -> bool:
    return not list(root.rglob("*.partial"))


def test_checksum_catches_one_flipped_byte(tmp_shm: Path) -> None:
    data = bytearray(os.urandom(3 << 20))
    before = checksum_buffer(data)
    assert before.startswith(f"{ALGORITHM}:")
    data[1_234_567] ^= 0x01
    assert checksum_buffer(data) != before
    p = tmp_shm / "f.bin"
    p.write_bytes(data)
    rec = ShardRecord(file="f.bin", node="n", nbytes=len(data), checksum=before, tensors=())
    with pytest.raises(ShardVerificationError, match="checksum"):
        verify_shard(p, rec)
    assert shard_ok(p, replace(rec, checksum=checksum_file(p)))
    assert checksum_file(p, "sha256").startswith("sha256:")
    verify_shard(p, replace(rec, checksum=checksum_file(p, "sha256")))
    with pytest.raises(ShardVerificationError, match="size"):
        verify_shard(p, replace(rec, nbytes=5))


@pytest.fixture(scope="module")
def puller_root(shm_base: Path) -> Path:
    d = shm_base / "puller"
    d.mkdir()
    return d


def test_round_trip_between_processes(tmp_shm, make_iteration_fn, start_source, shm_base) -> None:
    from safetensors.numpy import load_file

    m = make_iteration_fn(tmp_shm / "trainer", "run", 3, "trainer0", [3 << 20, 1 << 20, 5 << 20, 100])
    src = start_source(m, "trainer0", tmp_shm / "trainer_root")
    agent = NodeAgent("rollout0", tmp_shm / "rollout0", TransferConfig(bucket_bytes=1 << 20, concurrency=4))
    try:
        res = agent.sync(m, addresses={"trainer0": src.address})
        local = Path(res.directory)
        assert local == tmp_shm / "rollout0" / "run" / "0000003"
        assert res.pulled_files == len(m.shards) + 1 and res.pulled_bytes >= m.nbytes
        for s in m.shards:
            a, b = load_file(str(Path(m.directory) / s.file)), load_file(str(local / s.file))
            assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
        assert (local / "config.json").read_text() == (Path(m.directory) / "config.json").read_text()
        got = Manifest.load(local)
        assert got.directory == str(local) and got.shards == m.shards
        assert _no_partials(tmp_shm)
        again = agent.sync(m, addresses={"trainer0": src.address})  # complete already: no transfer
        assert again.pulled_files == 0 and again.reused_files == len(m.shards) + 1
    finally:
        agent.close()


def test_source_killed_mid_transfer(tmp_shm, make_iteration_fn, start_source) -> None:
    m = make_iteration_fn(tmp_shm / "trainer", "run", 1, "trainer0", [48 << 20, 2 << 20])
    src = start_source(m, "trainer0", tmp_shm / "trainer_root")
    agent = NodeAgent("rollout0", tmp_shm / "rollout0",
                      TransferConfig(bucket_bytes=1 << 20, concurrency=1, **FAST_RETRY))
    killed_at: list[int] = []

    def kill_after_first_bucket(landed: int) -> None:
        if not killed_at:
            killed_at.append(landed)
            src.kill()  # returns once the process is gone

    try:
        t0 = time.monotonic()
        with pytest.raises(PeerUnavailableError) as ei:
            agent.sync(m, addresses={"trainer0": src.address}, on_progress=kill_after_first_bucket)
        assert time.monotonic() - t0 < 15
        assert killed_at and killed_at[0] < m.nbytes
        msg = str(ei.value)
        assert src.address in msg and "model-00000.safetensors" in msg and "3 attempts" in msg
        assert ei.value.peer == src.address
        local = agent.local_dir("run", 1)
        assert not (local / MANIFEST_FILE).exists()
        assert not (local / "model-00000.safetensors").exists()
        assert _no_partials(tmp_shm / "rollout0")
    finally:
        agent.close()


def test_corrupted_byte_in_flight_is_retried(tmp_shm, make_iteration_fn, start_source) -> None:
    m = make_iteration_fn(tmp_shm / "trainer", "run", 1, "trainer0", [4 << 20, 1 << 20])
    src = start_source(m, "trainer0", tmp_shm / "trainer_root")
    agent = NodeAgent("rollout0", tmp_shm / "rollout0", TransferConfig(bucket_bytes=1 << 20, **FAST_RETRY))
    flips = []

    def flip_once(name, attempt, buf, off, n) -> None:
        if name == "model-00000.safetensors" and attempt == 0 and off == 2 << 20:
            buf[off + 17] ^= 0x40
            flips.append(off)

    try:
        stats = agent.transport.pull_manifest(m, src.address, agent.local_dir("run", 1), fault_hook=flip_once)
        assert flips and stats.attempts == 2
        assert any("model-00000.safetensors" in f and "checksum" in f for f in stats.failures)
        for s in m.shards:
            verify_shard(agent.local_dir("run", 1) / s.file, s)
    finally:
        agent.close()


def test_corrupted_source_gives_clear_error(tmp_shm, make_iteration_fn, start_source) -> None:
    m = make_iteration_fn(tmp_shm / "trainer", "run", 2, "trainer0", [2 << 20, 1 << 20])
    bad = Path(m.directory) / m.shards[0].file
    with open(bad, "r+b") as f:  # one byte flipped after the checksum was recorded
        f.seek(1 << 20)
        b = f.read(1)
        f.seek(1 << 20)
        f.write(bytes([b[0] ^ 0xFF]))
    src = start_source(m, "trainer0", tmp_shm / "trainer_root")
    agent = NodeAgent("rollout0", tmp_shm / "rollout0", TransferConfig(**FAST_RETRY))
    try:
        with pytest.raises(ChecksumMismatchError) as ei:
            agent.sync(m, addresses={"trainer0": src.address})
        assert ei.value.shard == m.shards[0].file and ei.value.peer == src.address
        assert "3 attempts" in str(ei.value)
        local = agent.local_dir("run", 2)
        assert not (local / m.shards[0].file).exists() and not (local / MANIFEST_FILE).exists()
        assert (local / m.shards[1].file).exists()  # the good shard is kept, verified
        assert _no_partials(tmp_shm / "rollout0")
    finally:
        agent.close()


def test_missing_shard(tmp_shm, make_iteration_fn, start_source) -> None:
    m = make_iteration_fn(tmp_shm / "trainer", "run", 4, "trainer0", [1 << 20])
    src = start_source(m, "trainer0", tmp_shm / "trainer_root")
    ghost = replace(m.shards[0], file="model-00009.safetensors")
    wanted = replace(m, shards=[*m.shards, ghost])
    agent = NodeAgent("rollout0", tmp_shm / "rollout0", TransferConfig(**FAST_RETRY))
    try:
        with pytest.raises(ShardNotServedError) as ei:
            agent.sync(wanted, addresses={"trainer0": src.address})
        assert ei.value.shard == ghost.file and src.address in str(ei.value)
        local = agent.local_dir("run", 4)
        assert not (local / ghost.file).exists() and not (local / MANIFEST_FILE).exists()
        assert _no_partials(tmp_shm / "rollout0")
    finally:
        agent.close()


def test_unknown_peer_fails_fast(tmp_shm, make_iteration_fn) -> None:
    m = make_iteration_fn(tmp_shm / "trainer", "run", 1, "trainer0", [1 << 20])
    agent = NodeAgent("rollout0", tmp_shm / "rollout0", TransferConfig(retries=1, retry_backoff_s=0.01))
    try:
        with pytest.raises(PeerUnavailableError, match="127.0.0.1:1"):
            agent.sync(m, addresses={"trainer0": "127.0.0.1:1"})
        assert _no_partials(tmp_shm)
    finally:
        agent.close()


def test_gc_keep_last_n(tmp_shm, make_iteration_fn) -> None:
    root = tmp_shm / "node"
    for it in range(1, 6):
        make_iteration_fn(root, "run", it, "n", [1000])
    (root / "run" / "0000002" / "model-00000.safetensors.partial").write_bytes(b"x")
    before = gc.shm_usage(root)
    assert gc.complete_iterations(root / "run") == [1, 2, 3, 4, 5]
    assert gc.gc_iterations(root / "run", keep_last=2, protect=[1]) == [2, 3]
    assert [it for it, _ in gc.iteration_dirs(root / "run")] == [1, 4, 5]
    assert gc.shm_usage(root) < before
    assert gc.gc_iterations(root / "run", keep_last=2) == [1]
    with pytest.raises(ValueError):
        gc.gc_iterations(root / "run", keep_last=0)


def test_crc32c_when_installed() -> None:
    pytest.importorskip("crc32c", reason="optional crc32c package not installed (zlib crc32 is used)")
    data = bytearray(b"123456789")
    assert checksum_buffer(data, "crc32c") == "crc32c:e3069283"  # the standard check value
    data[3] ^= 0x10
    assert checksum_buffer(data, "crc32c") != "crc32c:e3069283"


def test_stalled_source_hits_the_deadline(tmp_shm, make_iteration_fn, start_source) -> None:
    """A peer that stops answering (SIGSTOP) mid-transfer: the pull gives up at its deadline, within the
    retry bound, with a timeout error naming shard and peer, and leaves nothing partial behind."""
    m = make_iteration_fn(tmp_shm / "trainer", "run", 1, "trainer0", [24 << 20])
    src = start_source(m, "trainer0", tmp_shm / "trainer_root")
    cfg = TransferConfig(bucket_bytes=1 << 20, concurrency=2, retries=1, retry_backoff_s=0.01,
                         timeout_s=1.0, min_bytes_per_s=1e12)
    agent = NodeAgent("rollout0", tmp_shm / "rollout0", cfg)
    stopped: list[int] = []

    def stop_after_first_bucket(landed: int) -> None:
        if not stopped:
            stopped.append(landed)
            os.kill(src.pid, 19)  # SIGSTOP

    try:
        t0 = time.monotonic()
        with pytest.raises((TransferTimeoutError, PeerUnavailableError)) as ei:
            agent.sync(m, addresses={"trainer0": src.address}, on_progress=stop_after_first_bucket)
        elapsed = time.monotonic() - t0
        assert elapsed < 10, elapsed
        assert ei.value.peer == src.address and "timed out" in str(ei.value)
        assert not (agent.local_dir("run", 1) / m.shards[0].file).exists()
        assert _no_partials(tmp_shm / "rollout0")
    finally:
        os.kill(src.pid, 18)  # SIGCONT, then the fixture stops it
        agent.close()


def test_retired_iteration_is_no_longer_served(tmp_shm, make_iteration_fn) -> None:
    """Publisher and puller in one process (two engines): after `retire` (GC on the publishing node) a
    pull names the shard that is no longer served; the unserved mapping is released after its grace."""
    m = make_iteration_fn(tmp_shm / "trainer", "run", 2, "trainer0", [1 << 20])
    cfg = TransferConfig(retries=0, unmap_grace_s=0)
    trainer = NodeAgent("trainer0", tmp_shm / "trainer", cfg)
    rollout = NodeAgent("rollout0", tmp_shm / "rollout0", cfg)
    try:
        served = trainer.publish(m)
        assert {k.split("/")[-1] for k in served} == {m.shards[0].file, "config.json"}
        rollout.sync(m, addresses={"trainer0": trainer.address})
        assert sorted(trainer.retire("run", 2)) == sorted(served)
        assert trainer.transport.served() == {} and trainer.transport._retired == []
        with pytest.raises(ShardNotServedError, match=m.shards[0].file):
            rollout.transport.pull_manifest(m, trainer.address, tmp_shm / "elsewhere")
        assert trainer.gc("run", keep_last=1) == []
    finally:
        trainer.close()
        rollout.close()


def _two_node_iteration(tmp_shm: Path, make_iteration_fn, iteration: int) -> tuple[Manifest, Path, Path]:
    """An iteration whose shards two trainer nodes hold apart (a pipeline stage or a data-parallel share each, in
    directories of their own), the aux files with trainer0; the manifest of the whole saved in both."""
    a = make_iteration_fn(tmp_shm / "node0", "run", iteration, "trainer0", [2 << 20])
    b = make_iteration_fn(tmp_shm / "node1", "run", iteration, "trainer1", [48 << 20, 1 << 20], seed=7)
    renamed = []
    for s in b.shards:  # files of their own, as ranks' prefixes make them
        (Path(b.directory) / s.file).rename(Path(b.directory) / s.file.replace("model-", "model-n1-"))
        renamed.append(replace(s, file=s.file.replace("model-", "model-n1-")))
    (Path(b.directory) / "config.json").unlink()
    whole = replace(a, shards=[*a.shards, *renamed])
    whole.save()
    replace(whole, directory=b.directory).save()
    return whole, Path(a.directory), Path(b.directory)


def test_two_trainer_nodes_each_serve_their_part_and_a_dead_one_is_named(tmp_shm, make_iteration_fn,
                                                                         start_source) -> None:
    """A rollout node pulls each shard from the trainer node that holds it, no trainer node holding all; with
    one of them SIGKILLed mid-transfer the pull fails naming that node, its address and the shard, and leaves
    nothing partial or complete-looking behind."""
    whole, dir0, dir1 = _two_node_iteration(tmp_shm, make_iteration_fn, 1)
    assert {p.name for p in dir0.glob("*.safetensors")} != {s.file for s in whole.shards}  # apart
    src0 = start_source(whole, "trainer0", tmp_shm / "root0")
    src1 = start_source(replace(whole, directory=str(dir1)), "trainer1", tmp_shm / "root1")
    agent = NodeAgent("rollout0", tmp_shm / "rollout0", TransferConfig(bucket_bytes=1 << 20, concurrency=1,
                                                                        **FAST_RETRY))
    try:
        res = agent.sync(whole, addresses={"trainer0": src0.address, "trainer1": src1.address})
        local = Path(res.directory)
        assert res.pulled_files == 4 and (local / MANIFEST_FILE).exists() and (local / "config.json").exists()
        for s in whole.shards:
            verify_shard(local / s.file, s)

        whole2, _, dir1b = _two_node_iteration(tmp_shm, make_iteration_fn, 2)
        src0b = start_source(whole2, "trainer0", tmp_shm / "root0b")
        src1b = start_source(replace(whole2, directory=str(dir1b)), "trainer1", tmp_shm / "root1b")

        def kill_node1_after_first_bucket(landed: int) -> None:
            if landed > 2 << 20 and src1b.proc.poll() is None:  # into node 1's 48 MB shard
                src1b.kill()

        with pytest.raises(PeerUnavailableError) as ei:
            agent.sync(whole2, addresses={"trainer0": src0b.address, "trainer1": src1b.address},
                       on_progress=kill_node1_after_first_bucket)
        msg = str(ei.value)
        assert "node 'trainer1'" in msg and src1b.address in msg and "model-n1-00000.safetensors" in msg, msg
        local2 = agent.local_dir("run", 2)
        assert not (local2 / MANIFEST_FILE).exists() and not (local2 / "model-n1-00000.safetensors").exists()
        assert _no_partials(tmp_shm / "rollout0")
    finally:
        agent.close()
