"""Ray: start a local cluster (the embedded default) or join one (`ray.address`)."""
from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass

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

    def shutdown(self) -> None:
        import ray

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
    else:
        ray.init(num_cpus=num_cpus or os.cpu_count(), **kwargs)
    if threading.current_thread() is threading.main_thread() and handler is not None:
        # ray.init installs a native failure handler that turns SIGTERM into an abort (exit 134, no cleanup):
        # give the process back the handler it had (the CLI's: unwind like Ctrl-C).
        signal.signal(signal.SIGTERM, handler)
    return Cluster(connected_here=True)
