"""Shard registry as a detached named Ray actor: API, driver restart, actor restart, sync through it."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from ckpt_transfer.manifest import MANIFEST_FILE, ShardRecord
from ckpt_transfer.node_agent import NodeAgent
from ckpt_transfer.registry import ShardRegistry, get_or_create_registry, kill_registry
from ckpt_transfer.transport import TransferConfig

from ckpt_helpers import REPO, wait_until


def _rec(name: str, node: str) -> ShardRecord:
    return ShardRecord(file=name, node=node, nbytes=10, checksum="crc32:00000000", tensors=())


def test_registry_plain_api(tmp_path: Path) -> None:
    r = ShardRegistry(state_path=str(tmp_path / "state.json"))
    r.register("run", 1, "t0", "10.0.0.1:1", [_rec("a", "t0")], directory="/d/1", aux_files=["config.json"])
    r.register("run", 1, "t1", "10.0.0.2:2", [_rec("b", "t1")])
    r.register("run", 2, "t0", "10.0.0.1:1", [_rec("a", "t0")])
    found = r.lookup("run", 1)
    assert [s.file for s in found.manifest.shards] == ["a", "b"]
    assert found.addresses == {"t0": "10.0.0.1:1", "t1": "10.0.0.2:2"} and found.aux_node == "t0"
    assert found.manifest.aux_files == ["config.json"] and r.latest("run") == 2 and r.latest("other") is None
    r.register("run", 1, "t1", "10.0.0.2:2", [_rec("c", "t1")])  # a second rank of node t1: merged
    assert [s.file for s in r.lookup("run", 1).manifest.shards] == ["a", "b", "c"]
    assert r.latest("run", complete_only=True) is None and not r.lookup("run", 1).complete
    r.mark_complete("run", 1)
    assert r.latest("run", complete_only=True) == 1 and r.lookup("run", 1).complete
    found = r.lookup("run", 1)
    again = ShardRegistry(state_path=str(tmp_path / "state.json"))  # what a restarted actor sees
    assert again.lookup("run", 1) == found
    assert r.drop("run", below_iteration=2) == [1] and r.lookup("run", 1) is None and r.iterations("run") == [2]


@pytest.fixture
def registry(ray_cluster, tmp_path: Path):
    name = f"reg_{uuid.uuid4().hex[:6]}"
    client = get_or_create_registry(name, "tide_test", state_path=str(tmp_path / "registry.json"),
                                    timeout_s=20, retries=5)
    yield client
    kill_registry(name, "tide_test")


def test_registry_survives_driver_restart(ray_cluster, registry) -> None:
    script = textwrap.dedent(f"""
        import ray
        from ckpt_transfer.registry import get_or_create_registry
        from ckpt_transfer.manifest import ShardRecord
        ray.init(address={ray_cluster['address']!r}, log_to_driver=False)
        c = get_or_create_registry({registry.name!r}, {registry.namespace!r}, timeout_s=20)
        c.register("run", 7, "t9", "10.1.1.1:9", [ShardRecord("w", "t9", 1, "crc32:00000000", ())])
        print("PID", c.ping()["pid"])
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    # That driver is gone; the detached actor and its state remain.
    assert registry.latest("run") == 7
    assert registry.lookup("run", 7).addresses == {"t9": "10.1.1.1:9"}


def test_registry_actor_restart_keeps_state(ray_cluster, registry) -> None:
    import ray

    registry.register("run", 1, "t0", "10.0.0.1:1", [_rec("a", "t0")])
    pid = registry.ping()["pid"]
    ray.kill(registry.handle, no_restart=False)  # the actor process dies; Ray restarts it
    wait_until(lambda: registry.ping()["pid"] != pid, 60, "registry actor restart")
    found = registry.lookup("run", 1)
    assert found is not None and found.addresses == {"t0": "10.0.0.1:1"}
    # Killed for good: the client recreates it by name, state reloaded from its snapshot.
    ray.kill(registry.handle, no_restart=True)
    assert registry.latest("run") == 1


def test_sync_through_registry_and_stale_address(ray_cluster, registry, tmp_shm, make_iteration_fn) -> None:
    cfg = TransferConfig(retries=1, retry_backoff_s=0.05)
    m = make_iteration_fn(tmp_shm / "trainer", "run", 5, "trainer0", [2 << 20, 1 << 20])
    trainer = NodeAgent("trainer0", tmp_shm / "trainer", cfg, registry=registry)
    rollout = NodeAgent("rollout0", tmp_shm / "rollout0", cfg, registry=registry)
    trainer2 = None
    try:
        trainer.publish(m)
        res = rollout.sync(run="run", iteration=5)
        assert (Path(res.directory) / MANIFEST_FILE).exists() and res.pulled_files == 3

        # The publisher restarts with a new engine address; a caller holding the old one still succeeds
        # because the agent asks the registry again once.
        m6 = make_iteration_fn(tmp_shm / "trainer", "run", 6, "trainer0", [1 << 20])
        trainer.publish(m6)
        stale = registry.lookup("run", 6).addresses
        trainer.close()
        trainer2 = NodeAgent("trainer0", tmp_shm / "trainer", cfg, registry=registry)
        trainer2.publish(m6)
        assert registry.lookup("run", 6).addresses != stale
        res6 = rollout.sync(m6, addresses=stale)
        assert (Path(res6.directory) / MANIFEST_FILE).exists()
        assert rollout.gc("run", keep_last=1) == [5]
        assert registry.drop("run", below_iteration=6) == [5]
    finally:
        for a in (trainer, rollout, trainer2):
            if a is not None:
                a.close()


def test_rollout_nodes_as_ray_actors(ray_cluster, registry, tmp_shm, make_iteration_fn) -> None:
    """Two rollout "nodes", each a Ray actor process with its own shm root, pull one published iteration."""
    import ray

    from ckpt_transfer.node_agent import start_node_agent_actor

    cfg = TransferConfig(retries=1, retry_backoff_s=0.05)
    m = make_iteration_fn(tmp_shm / "trainer", "run", 9, "trainer0", [2 << 20, 2 << 20])
    trainer = NodeAgent("trainer0", tmp_shm / "trainer", cfg, registry=registry)
    actors = [start_node_agent_actor(f"rollout{i}", str(tmp_shm / f"rollout{i}"), cfg, registry) for i in range(2)]
    try:
        trainer.publish(m)
        results = ray.get([a.sync.remote(run="run", iteration=9) for a in actors], timeout=120)
        pids = {p["pid"] for p in ray.get([a.ping.remote() for a in actors], timeout=60)}
        assert len(pids) == 2
        for i, res in enumerate(results):
            local = Path(res.directory)
            assert local.parent.parent == tmp_shm / f"rollout{i}"
            assert (local / MANIFEST_FILE).exists() and res.pulled_bytes >= m.nbytes
        assert set(registry.addresses()) >= {"trainer0", "rollout0", "rollout1"}
    finally:
        for a in actors:
            ray.get(a.close.remote(), timeout=60)
            ray.kill(a)
        trainer.close()
