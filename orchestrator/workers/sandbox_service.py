"""Start the code sandbox service for a run (`sandbox.start: true`) or use a running one (`sandbox.url`)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class SandboxService:
    url: str
    process: subprocess.Popen | None = None

    @classmethod
    def start(cls, log_dir: Path, state_dir: str, timeout_s: float = 120.0) -> "SandboxService":
        from sandbox.client import SandboxClient

        if os.geteuid() != 0:
            raise RuntimeError("sandbox.start needs root (crun, cgroups, overlayfs); set sandbox.url to a running "
                               "service instead")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = open(log_dir / "sandbox.log", "ab")
        # its own session: a Ctrl-C to the run's process group reaches the run, which stops the service in
        # order; --parent-pid: it stops itself if the run dies without doing so
        proc = subprocess.Popen([sys.executable, "-m", "sandbox.cli", "serve", "--host", "127.0.0.1", "--port",
                                 str(port), "--state-dir", state_dir, "--parent-pid", str(os.getpid())],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        service = cls(f"http://127.0.0.1:{port}", proc)
        try:
            with SandboxClient(service.url) as client:
                client.wait_ready(timeout_s)
        except Exception as e:
            service.stop()
            raise RuntimeError(f"sandbox service did not become ready ({e}); see {log_dir / 'sandbox.log'}") from None
        return service

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)  # the service removes its containers, mounts and cgroups
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)
