"""`tide-sandbox`: serve the HTTP API, run one program locally, or clean up after a crash."""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import typer

from .config import SandboxConfig

app = typer.Typer(add_completion=False, help="tide code sandbox (crun)")


def _config(state_dir: Path, pool_size: Optional[int], max_queue: int, rootfs: list[str],
            default_image: str, token: Optional[str]) -> SandboxConfig:
    images = {}
    for item in rootfs:
        name, _, path = item.partition("=")
        if not path:
            raise typer.BadParameter(f"--rootfs wants NAME=DIR, got {item!r}")
        images[name] = Path(path)
    cfg = SandboxConfig(state_dir=state_dir, max_queue=max_queue, rootfs_images=images,
                        default_image=default_image, token=token)
    if pool_size:
        cfg.pool_size = pool_size
    return cfg


@app.command()
def serve(host: str = "127.0.0.1", port: int = 8600,
          pool_size: Optional[int] = typer.Option(None, help="concurrent executions (default 2 x cores, min 4)"),
          max_queue: int = typer.Option(64, help="accepted executions waiting for a slot; more get 503"),
          state_dir: Path = Path("/run/tide-sandbox"),
          rootfs: list[str] = typer.Option([], help="extra image NAME=DIR (a root filesystem)"),
          default_image: str = "host",
          no_pivot: bool = typer.Option(False, help="crun --no-pivot: chroot instead of pivot_root (faster "
                                        "under load; see README)"),
          token: Optional[str] = typer.Option(None, envvar="TIDE_SANDBOX_TOKEN", help="required bearer token"),
          max_sessions: int = typer.Option(512, help="live sessions at once (each in a container and cgroup slot "
                                           "of its own, beside the run pool)"),
          max_session_s: float = typer.Option(3600.0, help="a session's longest life"),
          parent_pid: Optional[int] = typer.Option(None, help="the pid of the process starting the service: shut "
                                                   "down (as on SIGTERM) once it is gone"),
          log_level: str = "info") -> None:
    """Start the HTTP service (needs root, or delegated cgroups plus overlayfs)."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = _config(state_dir, pool_size, max_queue, rootfs, default_image, token)
    cfg.no_pivot = no_pivot
    cfg.max_sessions, cfg.max_session_s = max_sessions, max_session_s
    from .runtime import SandboxRuntime  # noqa: E402  (start before uvicorn spawns any thread)

    runtime = SandboxRuntime(cfg).start(private_namespace=True)
    try:
        import uvicorn

        from .client import SERVER_KEEPALIVE_S
        from .service import create_app

        web = create_app(runtime, token=cfg.token, max_request_bytes=cfg.max_request_bytes)
        server = uvicorn.Server(uvicorn.Config(
            web, host=host, port=port, log_level=log_level, access_log=False,
            limit_concurrency=4 * (cfg.pool_size + cfg.max_queue) + 64, timeout_graceful_shutdown=30,
            timeout_keep_alive=SERVER_KEEPALIVE_S))  # longer than clients keep idle connections
        if parent_pid is not None:
            threading.Thread(target=_stop_when_orphaned, args=(server, parent_pid), daemon=True,
                             name="parent-watch").start()
        server.run()
    finally:
        runtime.close()


def _stop_when_orphaned(server, parent: int, poll_s: float = 0.5) -> None:
    """A run's own service (orchestrator/workers/sandbox_service.py) lives in a session of its own, so a signal to the
    run's process group does not reach it. When the run dies without stopping it (SIGKILL, a crash in its
    teardown), the service is re-parented, and shuts down as on SIGTERM: its containers, mounts and cgroups go
    with it."""
    while os.getppid() == parent:
        time.sleep(poll_s)
    logging.getLogger("sandbox").warning("the process that started the service (pid %d) is gone: shutting down",
                                         parent)
    server.should_exit = True


@app.command()
def run(file: Path, language: str = typer.Option(..., "--language", "-l"),
        stdin: Optional[Path] = None, timeout_s: Optional[float] = None,
        state_dir: Path = Path("/run/tide-sandbox")) -> None:
    """Run one source file in a fresh sandbox and print the result as JSON."""
    from .models import Limits, RunRequest
    from .runtime import SandboxRuntime

    rt = SandboxRuntime(SandboxConfig(state_dir=state_dir, pool_size=1)).start()
    try:
        req = RunRequest(language=language, code=file.read_text(), stdin=stdin.read_text() if stdin else "",
                         limits=Limits(timeout_s=timeout_s))
        res = rt.run(req)
    finally:
        rt.close()
    print(json.dumps(res.model_dump(mode="json"), indent=2))
    sys.exit(0 if res.status.value == "ok" else 1)


@app.command()
def cleanup(state_dir: Path = Path("/run/tide-sandbox")) -> None:
    """Remove what crashed services left behind (cgroup pools, crun state, run directories)."""
    from .cgroups import CgroupPool, detect
    from .runtime import SandboxRuntime

    SandboxRuntime(SandboxConfig(state_dir=state_dir)).cleanup_leftovers()
    n = CgroupPool(detect(), 0).cleanup_leftovers()
    left = len(os.listdir(state_dir)) if state_dir.exists() else 0
    print(f"removed {n} stale slot cgroups; {state_dir} holds {left} entries (live services)")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
