"""Ray: start a local cluster (the embedded default) or join one (`ray.address`)."""
from __future__ import annotations

import os
import shutil
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.engine_proc import engine_segments, process_tree, remove_segments, wait_gone

# Local single-user clusters: no token auth, no usage stats. Set before Ray is imported anywhere. The GCS keeps the
# events of the last task_events_max_num_task_in_gcs tasks (Ray's default 100,000): over 1,000 quickstart iterations
# its memory grew linearly, 1.6 MB per 100; capped at 1,000 it stopped growing after ~250 iterations (measured with
# scripts/soak.py, docs/training.md#long-runs); at 2,000 after ~500 (50.5 -> 55.6 MB, then flat to iteration 1000),
# keeping the last few hundred iterations' tasks for the dashboard. The environment may set another.
_RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "1",
            "RAY_task_events_max_num_task_in_gcs": "2000"}


@dataclass
class Cluster:
    """How this driver came to Ray: `connected_here` when `connect` called `ray.init` (starting a local
    cluster or joining `ray.address`); False when Ray was already initialised in this process by someone
    else, whose connection (and cluster) `shutdown` leaves alone."""

    connected_here: bool
    node: Any = None  # Ray's Node of a local cluster started here: its raylet and GCS are this process's children

    def head_lost(self) -> bool:
        """True when the local cluster started here has lost its raylet: killed with the run's process group
        (a scheduler's SIGTERM reaches every process of the job, Ray's too) or by the OOM killer. Every Ray call
        then waits out its timeout, and ray.shutdown may end this process on the spot (the core worker exits when
        its raylet is unreachable; seen once: exit 1, before status.json was written)."""
        if self.node is None:
            return False
        return any(info.process.poll() is not None for info in self.node.all_processes.get("raylet", []))

    def ends_without_ray(self, interrupted: bool) -> bool:
        """Whether a stop should end this cluster's processes by pid instead of asking Ray: its raylet is dead,
        or the run was interrupted (Ctrl-C, SIGTERM) on a local cluster started here, whose raylet the signal
        may be ending too (a job's SIGTERM reaches it; measured: still alive 3 s later on a loaded machine, and
        a Ray call made meanwhile hung until the core worker gave up on the GCS, 60 s, exit 1). Everything of a
        local cluster ends with the run either way."""
        return self.head_lost() or (interrupted and self.node is not None)

    def abandon(self) -> None:
        """End what is left of a local cluster whose raylet died, by pid, without asking Ray: its worker
        processes (actors still starting or stopping included) and its own processes. The driver's own
        disconnect is left to Ray's exit hook, after everything else (see head_lost)."""
        raylets = {str(info.process.pid) for info in self.node.all_processes.get("raylet", [])}
        kill_workers(workers_of(raylets, self.node.node_id))
        self.node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
        self.node, self.connected_here = None, False

    def shutdown(self) -> None:
        import ray

        if self.head_lost():  # died while the run was stopping: ray.shutdown could end this process
            self.abandon()
        # Disconnecting from a joined cluster leaves it running; a cluster started here stops with it.
        if self.connected_here and ray.is_initialized():
            ray.shutdown()


def connect(address: str | None, namespace: str, num_cpus: int | None = None, log_to_driver: bool = False) -> Cluster:
    for k, v in _RAY_ENV.items():
        os.environ.setdefault(k, v)
    import ray

    if ray.is_initialized():
        return Cluster(connected_here=False)
    kwargs = dict(namespace=namespace, include_dashboard=False, log_to_driver=log_to_driver,
                  runtime_env={"env_vars": {k: os.environ[k] for k in _RAY_ENV}})
    handler = signal.getsignal(signal.SIGTERM)
    if address:
        ray.init(address=address, **kwargs)
    else:  # "local": a cluster of its own, never one that `ray start` (or a simulated cluster) left on the host
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), **kwargs)
    if threading.current_thread() is threading.main_thread() and handler is not None:
        # ray.init installs a native failure handler that turns SIGTERM into an abort (exit 134, no cleanup):
        # give the process back the handler it had (the CLI's: unwind like Ctrl-C).
        signal.signal(signal.SIGTERM, handler)
    return Cluster(connected_here=True, node=None if address else ray._private.worker._global_node)


def workers_of(raylet_pids: set[str], node_id: str) -> list[int]:
    """The Ray worker processes (`ray::...`) a raylet of `raylet_pids` started (their environment names it), and
    the node's agents (named by `node_id`; "": none), found in /proc: other clusters' on the host are left alone."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if not (entry / "cmdline").read_bytes().startswith(b"ray::"):
                continue
            env = dict(line.split(b"=", 1) for line in (entry / "environ").read_bytes().split(b"\0") if b"=" in line)
        except OSError:  # gone, or not ours to read
            continue
        node = env.get(b"RAY_NODE_ID", b"").decode()
        if env.get(b"RAY_RAYLET_PID", b"").decode() in raylet_pids or (node_id and node == node_id):
            found.append(int(entry.name))
    return found


def kill_workers(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    """SIGKILL those of `pids` that are Ray worker processes (`ray::...`; a pid recorded earlier may have been
    reused since) and their children; those still alive after `timeout_s`."""
    targets = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # gone already
            continue
        if cmdline.startswith(b"ray::"):
            targets += process_tree(pid)
    segments = engine_segments(targets)  # what a vLLM engine among them has in /dev/shm, which SIGKILL leaves
    for pid in targets:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    alive = wait_gone(targets, timeout_s)
    if not alive:
        remove_segments(segments)
    return alive


SESSION_MARK = "tide_run"  # in a Ray session directory of a local cluster tide started: the run directory's path


def keep_session_logs(cluster: Cluster, run_dir: Path, keep: int) -> Path | None:
    """For a local cluster started here: link RUN_DIR/ray_session to its Ray session directory (Ray's logs: the
    actors', vLLM's and Megatron's output), mark it as tide's, and remove the oldest session directories of
    earlier tide runs whose cluster is gone, beyond the newest `keep`. The session directory; None for a joined
    cluster, whose sessions belong to whoever started it."""
    if cluster.node is None:
        return None
    session = Path(cluster.node.get_session_dir_path())
    (session / SESSION_MARK).write_text(str(Path(run_dir).resolve()))
    link = Path(run_dir) / "ray_session"
    link.unlink(missing_ok=True)
    link.symlink_to(session, target_is_directory=True)
    prune_sessions(session.parent, keep, spare=session)
    return session


def prune_sessions(root: Path, keep: int, spare: Path | None = None) -> list[Path]:
    """Remove tide's ended Ray sessions under `root` (marked, their starting process gone) but the newest `keep`
    of them; the removed. Ray names a session `session_<date>_<time>_<pid of the process that started it>`."""
    ended = []
    for session in root.glob("session_*"):
        if session.is_symlink() or session == spare or not (session / SESSION_MARK).is_file():
            continue
        pid = session.name.rsplit("_", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            ended.append(session)
    ended.sort(key=lambda p: p.name)  # the date and time in the name: oldest first
    removed = ended[:max(len(ended) - keep, 0)]
    for session in removed:
        shutil.rmtree(session, ignore_errors=True)
    return removed
