"""Two nodes in two network namespaces joined by a veth pair: the shard bytes cross a real link."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from ckpt_helpers import REPO

from ckpt_transfer.checksum import verify_shard
from ckpt_transfer.manifest import MANIFEST_FILE, Manifest

pytestmark = pytest.mark.root


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces and veth pairs"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    return None


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_netns() -> Iterator[dict]:
    why = _why_not()
    if why:
        pytest.skip(why)
    tag = uuid.uuid4().hex[:6]
    a, b = f"tide_a_{tag}", f"tide_b_{tag}"
    va, vb = f"vta{tag}", f"vtb{tag}"  # interface names stay under 15 characters
    made: list[str] = []
    try:
        for ns in (a, b):
            r = _ip("netns", "add", ns)
            if r.returncode != 0:
                pytest.skip(f"`ip netns add` failed here: {r.stderr.strip()}")
            made.append(ns)
        steps = [
            ("link", "add", va, "type", "veth", "peer", "name", vb),
            ("link", "set", va, "netns", a),
            ("link", "set", vb, "netns", b),
            ("-n", a, "addr", "add", "10.231.7.1/24", "dev", va),
            ("-n", b, "addr", "add", "10.231.7.2/24", "dev", vb),
            ("-n", a, "link", "set", va, "up"),
            ("-n", b, "link", "set", vb, "up"),
            ("-n", a, "link", "set", "lo", "up"),
            ("-n", b, "link", "set", "lo", "up"),
        ]
        for step in steps:
            r = _ip(*step)
            if r.returncode != 0:
                pytest.skip(f"`ip {' '.join(step)}` failed here: {r.stderr.strip()}")
        yield {"a": a, "b": b, "va": va, "vb": vb, "ip_a": "10.231.7.1", "ip_b": "10.231.7.2"}
    finally:
        _ip("link", "del", va)  # only if it never moved into a namespace
        for ns in made:  # deleting a namespace deletes the veth end inside it, and with it the pair
            _ip("netns", "del", ns)


def _rx_bytes(ns: str, dev: str) -> int:
    out = subprocess.run(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/rx_bytes"],
                         capture_output=True, text=True, timeout=30, check=True)
    return int(out.stdout)


def test_pull_across_veth(two_netns, tmp_shm, make_iteration_fn, start_source) -> None:
    ns = two_netns
    m = make_iteration_fn(tmp_shm / "trainer", "run", 1, "trainer0", [6 << 20, 3 << 20])
    src = start_source(m, "trainer0", tmp_shm / "trainer_root", netns=ns["a"], host=ns["ip_a"])
    assert src.address.startswith(ns["ip_a"] + ":")
    rx_before = _rx_bytes(ns["b"], ns["vb"])
    dest_root = tmp_shm / "rollout_b"
    cmd = ["ip", "netns", "exec", ns["b"], sys.executable, "-m", "ckpt_transfer.node_agent", "sync",
           "--node", "rollout_b", "--root", str(dest_root), "--host", ns["ip_b"],
           "--manifest", str(Path(m.directory) / MANIFEST_FILE), "--peer", f"trainer0={src.address}",
           "--config", json.dumps({"bucket_bytes": 1 << 20})]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    local = Path(res["directory"])
    assert (local / MANIFEST_FILE).exists() and Manifest.load(local).shards == m.shards
    for s in m.shards:
        verify_shard(local / s.file, s)
    assert _rx_bytes(ns["b"], ns["vb"]) - rx_before >= m.nbytes  # the bytes came over the veth link

    src.kill()  # and a dead peer across the link is reported, naming it
    out = subprocess.run(cmd[:-2] + ["--root", str(tmp_shm / "rollout_b2"), "--config",
                                     json.dumps({"retries": 1, "retry_backoff_s": 0.05, "timeout_s": 10})],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr[-3000:]
    err = json.loads(out.stdout.strip().splitlines()[-1])
    assert err["peer"] == src.address and err["error"] == "PeerUnavailableError"
    assert not list((tmp_shm / "rollout_b2").rglob("*.partial"))
