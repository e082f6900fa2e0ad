"""Server configuration: pool size, default and maximum limits, paths."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field

from .models import Limits


class SandboxConfig(BaseModel):
    state_dir: Path = Path("/run/tide-sandbox")
    pool_size: int = Field(default_factory=lambda: max(4, 2 * (os.cpu_count() or 1)))
    max_queue: int = 64  # requests waiting for a slot beyond the pool; more get 503
    # live sessions, each on a slot of its own beside the run pool: an idle session costs a waiting interpreter
    # (about 10 MB), not a slot runs need
    max_sessions: int = Field(512, ge=1)
    max_session_s: float = Field(3600.0, gt=0)  # a session's longest life, however busy
    crun: str = "crun"
    cgroup_parent: str | None = None  # default: the service's own cgroup in each hierarchy
    cpu_per_slot: float = 1.0  # CFS quota of one slot, in cores
    # crun --no-pivot: chroot instead of pivot_root, which skips detaching the old root (an RCU grace period,
    # up to ~20 ms under load). Escaping a chroot needs chroot/mount/pivot_root, which the containers lack
    # (no capabilities, seccomp denies them), but pivot_root is the conservative default.
    no_pivot: bool = False
    # limits.timeout_s of a run, a compile step and a judge case is CPU time: one that has spent less when its wall
    # time reaches the limit (it waited for a core) runs on, up to this many times the limit in wall time (it
    # sleeps or blocks). Sessions' and Jupyter cells' timeouts stay wall time.
    wall_time_factor: float = Field(3.0, ge=1.0)
    default_limits: Limits = Limits(timeout_s=10, memory_mb=512, output_kb=1024, pids=64, disk_mb=64)
    max_limits: Limits = Limits(timeout_s=60, memory_mb=4096, output_kb=16384, pids=512, disk_mb=1024)
    compile_limits: Limits = Limits(timeout_s=30, memory_mb=1024, output_kb=64, pids=64)
    default_image: str = "host"
    rootfs_images: dict[str, Path] = Field(default_factory=dict)  # name -> directory
    max_files: int = 64
    max_request_bytes: int = 16 * 1024 * 1024
    max_fetch_mb: int = Field(64, gt=0)  # one response's fetch_files together (also at most the run's disk_mb)
    token: str | None = None

    def effective(self, req: Limits) -> "Resolved":
        """Request limits filled with defaults and capped by the maxima."""
        out = {}
        for k in Limits.model_fields:
            v = getattr(req, k)
            if v is None:
                v = getattr(self.default_limits, k)
            cap = getattr(self.max_limits, k)
            out[k] = min(v, cap) if cap is not None else v
        return Resolved(**out)

    def compile_step(self, run: "Resolved", timeout_s: float | None = None) -> "Resolved":
        """Limits of a compile step: the compile limits, never tighter than the run's; a request's
        `timeout_s` can only shorten the compile limit's."""
        c = self.compile_limits
        cap = c.timeout_s or 30
        return Resolved(timeout_s=min(timeout_s, cap) if timeout_s else cap, memory_mb=max(c.memory_mb or 0, run.memory_mb),
                        output_kb=c.output_kb or 64, pids=max(c.pids or 0, run.pids), disk_mb=run.disk_mb)


@dataclass(frozen=True)
class Resolved:
    """Limits of one step, every field set."""

    timeout_s: float
    memory_mb: int
    output_kb: int
    pids: int
    disk_mb: int
