"""`tide run/resume --max-restarts N`: the run's driver in a child process, restarted from the run's newest complete
checkpoint (as `tide resume` does: data cursor, metrics and parameters exact) when it dies of a fault.

A fault is an exit 1 (a trainer rank, an engine that could not be replaced or the Ray head died; any runtime
error) or a death by a signal other than SIGINT/SIGTERM (the driver SIGKILLed, out of memory). A finished run
(0), an input error (2: a config or data error is never retried) and an interrupted one (130, or SIGINT/SIGTERM to
this process, which is passed on to the driver once) end the supervision with the driver's exit code. Before each
restart: a line in RUN_DIR/restarts.jsonl and status.json `restarting` with the count, then a backoff doubling
from `backoff_s` (capped at MAX_BACKOFF_S).

The driver runs in a session of its own, so that a terminal's Ctrl-C reaches it once, through this process.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from orchestrator.records.run_lock import INHERITED_ENV
from orchestrator.records.rundir import RunDir

MAX_BACKOFF_S = 600.0


@dataclass(frozen=True)
class Restart:
    """One line of RUN_DIR/restarts.jsonl."""

    restart: int  # 1, 2, ...
    time: float
    exit_code: int  # negative: killed by that signal
    error: str  # what the failed attempt's status.json said
    from_iteration: int  # the checkpoint the next attempt resumes from (0: none yet, the run starts over)
    backoff_s: float


def retried(exit_code: int) -> bool:
    return exit_code == 1 or (exit_code < 0 and -exit_code not in (signal.SIGINT, signal.SIGTERM))


class Supervisor:
    def __init__(self, run_dir: Path, max_restarts: int, backoff_s: float,
                 driver: tuple[str, ...] = (sys.executable, "-m", "orchestrator.run.cli"), lock_fd: int | None = None):
        """`driver`: the command the attempts' arguments follow (`tide` itself); `lock_fd`: the run directory's
        lock, held here and handed to each attempt (orchestrator/records/run_lock.py)."""
        self.run_dir, self.max_restarts, self.backoff_s = Path(run_dir), max_restarts, backoff_s
        self.lock_fd = lock_fd
        self.driver = list(driver)
        self._child: subprocess.Popen | None = None
        self._stop = threading.Event()

    def _on_signal(self, signum, _frame) -> None:
        first = not self._stop.is_set()
        self._stop.set()
        if first and self._child is not None and self._child.poll() is None:
            self._child.send_signal(signum)  # the driver unwinds as on Ctrl-C and cleans up after itself

    def run(self, first_argv: list[str]) -> int:
        """Drive `tide <first_argv>` (a run or resume without --max-restarts) to its end, restarting it with
        `tide resume RUN_DIR` after each fault while restarts remain; the last attempt's exit code."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        argv, here = first_argv, 0  # restarts by this supervisor; the run's count includes earlier ones
        while True:
            held = {} if self.lock_fd is None else {
                "pass_fds": (self.lock_fd,), "env": {**os.environ, INHERITED_ENV: str(self.lock_fd)}}
            self._child = subprocess.Popen([*self.driver, *argv], start_new_session=True, **held)
            code = self._child.wait()
            self._child = None
            if self._stop.is_set():
                return code if code >= 0 else 130
            if not retried(code):
                return code
            if here >= self.max_restarts:
                print(f"tide: the run failed (exit {code}) and --max-restarts {self.max_restarts} is spent",
                      file=sys.stderr)
                return code if code > 0 else 1
            here += 1
            run = RunDir(self.run_dir)
            restarts = run.restart_count() + 1
            ckpt = run.latest_checkpoint()
            status = run.status()
            wait = min(self.backoff_s * 2 ** (here - 1), MAX_BACKOFF_S)
            record = Restart(restarts, time.time(), code, str(status.get("error") or f"exit {code}"),
                             RunDir.read_run_state(ckpt)["iteration"] if ckpt else 0, wait)
            run.record_restart(asdict(record))
            run.set_status(**{**status, "state": "restarting", "restarts": restarts, "error": record.error,
                              "next_attempt_at": time.time() + wait})
            print(f"tide: the run failed ({record.error}); restart {here} of {self.max_restarts} in {wait:.0f} s, "
                  f"from iteration {record.from_iteration}", file=sys.stderr)
            if self._stop.wait(wait):
                run.set_status(**{**run.status(), "state": "failed", "error": "interrupted (Ctrl-C or SIGTERM) "
                                  "while waiting to restart"})
                return 130
            argv = ["resume", str(self.run_dir)]
