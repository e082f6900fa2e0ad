"""`Cluster.shutdown` stops only what `connect` started or joined: a Ray connection someone else made in this
process (a test session's cluster, a user's notebook) is left alone."""
from orchestrator.workers.cluster import connect


def test_shutdown_leaves_a_connection_made_elsewhere_alone(ray_cluster):
    import ray

    cluster = connect(None, "tide_test")
    assert not cluster.connected_here
    cluster.shutdown()
    assert ray.is_initialized()
    assert ray.get(ray.put(7), timeout=30) == 7


# A cluster of its own in a child process (the test session's Ray is already initialised in this one).
LOST_RAYLET = r"""
import json, os, signal, sys, time
sys.path.insert(0, {root!r})
from orchestrator.workers.cluster import connect
from rollout.engine_proc import pids_alive
import subprocess
cluster = connect(None, "tide_test_lost", 1)
procs = cluster.node.all_processes
raylet, gcs = procs["raylet"][0].process.pid, procs["gcs_server"][0].process.pid
# stand-ins for worker processes that outlive their raylet (an actor still starting): one this raylet started,
# one of another cluster on the host
fake = 'exec -a "ray::RolloutEngine" sleep 60'
ours = subprocess.Popen(["bash", "-c", fake], env={{**os.environ, "RAY_RAYLET_PID": str(raylet)}})
theirs = subprocess.Popen(["bash", "-c", fake], env={{**os.environ, "RAY_RAYLET_PID": "1"}})
time.sleep(0.5)  # exec'd
before = cluster.head_lost()
os.kill(raylet, signal.SIGKILL)
deadline = time.monotonic() + 30
while not cluster.head_lost() and time.monotonic() < deadline:
    time.sleep(0.05)
after = cluster.head_lost()
cluster.shutdown()
ours.poll()
left = pids_alive([raylet, gcs, ours.pid])
spared = theirs.poll() is None
theirs.kill()
print(json.dumps({{"before": before, "after": after, "left": left, "other_cluster_spared": spared}}))
"""


def test_a_local_cluster_that_lost_its_raylet_is_ended_by_pid_its_workers_too(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "lost.py"
    script.write_text(LOST_RAYLET.format(root=str(root)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"before": False, "after": True, "left": [],
                                                                "other_cluster_spared": True}


def test_only_tides_ended_ray_sessions_beyond_the_newest_are_removed(tmp_path):
    import os
    import subprocess
    import sys

    from orchestrator.workers.cluster import SESSION_MARK, prune_sessions

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = [f"session_2026-12-0{d}_10-00-00_000000_{dead.pid}" for d in range(1, 5)]
    for name in names:
        (tmp_path / name / "logs").mkdir(parents=True)
        (tmp_path / name / SESSION_MARK).write_text("/runs/x")
    alive = tmp_path / f"session_2026-12-01_09-00-00_000000_{os.getpid()}"  # its cluster's starter still runs
    foreign = tmp_path / f"session_2026-11-01_09-00-00_000000_{dead.pid}"  # not started by tide
    for d in (alive, foreign):
        d.mkdir()
    (alive / SESSION_MARK).write_text("/runs/y")
    (tmp_path / "session_latest").symlink_to(tmp_path / names[-1])
    removed = prune_sessions(tmp_path, keep=2)
    assert [p.name for p in removed] == names[:2]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*names[2:], alive.name, foreign.name,
                                                                 "session_latest"])
