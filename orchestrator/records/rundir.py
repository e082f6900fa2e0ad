"""The run directory: resolved config, per-phase timings, per-iteration metrics, checkpoints.

Layout:
    RUN_DIR/config.yaml        resolved config (what `tide resume` reads back)
    RUN_DIR/timings.jsonl      one record per phase per iteration: iteration, phase, start, seconds[, bytes]
    RUN_DIR/metrics.jsonl      one record per iteration: iteration, reward_mean, logprob_gap, ...
    RUN_DIR/samples.jsonl      a few completions per iteration (prompt, completion, reward, length, finish reason)
    RUN_DIR/status.json        live state (iteration, phase, pids), then how the run ended: state finished or
                               failed (with the error); `restarting` (with the count) between a fault and the
                               restart of a run under --max-restarts
    RUN_DIR/restarts.jsonl     one record per automatic restart (orchestrator/run/supervisor.py)
    RUN_DIR/checkpoints/iter_NNNNNNN/   complete checkpoints only (written as *.tmp, then renamed)
    RUN_DIR/final.json         the last iteration and the trainer's parameter digests (LLM runs)
    RUN_DIR/tb/                TensorBoard event files: the metrics and `time/<phase>` per iteration
    RUN_DIR/error.log          the traceback of each attempt that failed (orchestrator/run/failures.py)
    RUN_DIR/run_id             the run's id: its weights in shared memory live under <shm_root>/<name>-<run_id>
    RUN_DIR/lock               held by the live run (orchestrator/records/run_lock.py): one run per directory
    RUN_DIR/ray_session        a link to the Ray session directory (its logs) of the run's last local cluster
"""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ckpt_transfer.owners import pid_alive
from orchestrator.records.tensorboard_log import TensorBoardLog

CKPT_PREFIX = "iter_"
RUN_STATE_FILE = "run_state.json"


def _append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line torn by SIGKILL mid-write: everything after it is dropped
            break
    return out


@dataclass
class PhaseRecord:
    iteration: int
    phase: str
    start: float
    seconds: float
    bytes: int | None = None
    parts: dict[str, float] | None = None  # where the phase's time went (an agent's rollout: generate, tools)

    def as_dict(self) -> dict:
        d = {"iteration": self.iteration, "phase": self.phase, "start": self.start, "seconds": self.seconds}
        if self.bytes is not None:
            d["bytes"] = self.bytes
        if self.parts:
            d["parts"] = self.parts
        return d


@dataclass
class RunDir:
    path: Path

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self.config_file = self.path / "config.yaml"  # the resolved config
        self.metrics_file, self.timings_file = self.path / "metrics.jsonl", self.path / "timings.jsonl"
        self.samples_file, self.status_file = self.path / "samples.jsonl", self.path / "status.json"
        self.restarts_file, self.checkpoints = self.path / "restarts.jsonl", self.path / "checkpoints"
        self.created = not self.path.exists()  # made by this process: removed again if nothing ran
        self.path.mkdir(parents=True, exist_ok=True)
        self.checkpoints.mkdir(exist_ok=True)
        self._tb: TensorBoardLog | None = None
        self._tb_purge_step: int | None = None
        self._sinks: list = []  # more scalar loggers beside TensorBoard (orchestrator/records/wandb_log.py)
        self.lock_fd: int | None = None  # RUN_DIR/lock's descriptor once `hold` took the directory
        self.restarts = self.restart_count()  # carried in status.json and, once nonzero, in each metrics record
        self._status: dict[str, Any] = {"restarts": self.restarts} if self.restarts else {}

    @property
    def tensorboard(self) -> TensorBoardLog:
        """Opened on first use, so that reading a run directory (inspect, tests) writes nothing."""
        if self._tb is None:
            self._tb = TensorBoardLog(self.path / "tb", purge_step=self._tb_purge_step)
        return self._tb

    def attach(self, sink) -> None:
        """Another logger of the run's scalars, with TensorBoardLog's `scalars`, `flush` and `close`."""
        self._sinks.append(sink)

    def _loggers(self) -> list:
        return [self.tensorboard, *self._sinks]

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        while self._sinks:
            self._sinks.pop().close()

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def run_id(self) -> str:
        """The run's id, made by its first attempt and kept by every resume (what its weights in shared memory
        are keyed by, so that two runs of one config never share them)."""
        path = self.path / "run_id"
        if not path.is_file():
            tmp = path.with_suffix(".tmp")
            tmp.write_text(uuid.uuid4().hex[:12] + "\n")
            tmp.replace(path)
        return path.read_text().strip()

    def hold(self) -> None:
        """Take the directory for this process's run (RunDirBusy while another live run has it), keeping the
        lock's descriptor in `lock_fd`."""
        from orchestrator.records.run_lock import hold_run_dir

        self.lock_fd = hold_run_dir(self.path)

    def let_go(self) -> None:
        """Release the directory `hold` took, for another run of this process (orchestrator/run/api.py)."""
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None

    # ---- timings and metrics -------------------------------------------------------------------
    def restart_count(self) -> int:
        return len(read_jsonl(self.restarts_file))

    def record_restart(self, record: dict) -> None:
        _append_jsonl(self.restarts_file, record)
        self.restarts = self.restart_count()

    def set_status(self, **fields: Any) -> None:
        """Live state for people and tools watching a run (current iteration and phase, pids)."""
        self._status = {**self._status, "state": "running", **fields, "driver_pid": os.getpid(),
                        "time": time.time()}
        tmp = self.status_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._status, indent=1))
        tmp.replace(self.status_file)

    def end_status(self, error: BaseException | None = None) -> None:
        """How the run ended: `finished`, or `failed` with the error (the phase it failed in stays recorded)."""
        if error is None:
            self.set_status(state="finished", phase="finished", error=None)
        elif isinstance(error, KeyboardInterrupt):
            self.set_status(state="failed", error="interrupted (Ctrl-C or SIGTERM)")
        else:
            self.set_status(state="failed", error=f"{type(error).__name__}: {error}")

    def status(self) -> dict:
        """status.json as last written; a run whose driver died without saying so (SIGKILL, a lost node) reads
        `failed` with that reason."""
        try:
            status = json.loads(self.status_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}
        if status.get("state", "running") in ("running", "restarting") and not _alive(status.get("driver_pid")):
            status |= {"state": "failed", "error": f"the driver (pid {status.get('driver_pid')}) ended without "
                                                   f"recording how: killed, or its machine went away"}
        return status

    @contextmanager
    def phase(self, iteration: int, name: str) -> Iterator[dict]:
        """Time a phase. The body may set `rec["bytes"] = n` and `rec["parts"] = {part: seconds}` on the yielded
        dict."""
        extra: dict[str, Any] = {}
        self.set_status(iteration=iteration, phase=name)
        start = time.time()
        t0 = time.perf_counter()
        yield extra
        self.record_phase(PhaseRecord(iteration, name, start, time.perf_counter() - t0, extra.get("bytes"),
                                      extra.get("parts")))

    def record_phase(self, rec: PhaseRecord) -> None:
        """A phase timed elsewhere (start-up, measured before the run directory was truncated for a resume)."""
        _append_jsonl(self.timings_file, rec.as_dict())
        for log in self._loggers():
            log.scalars(rec.iteration, {rec.phase: rec.seconds, **{f"{rec.phase}/{k}": v for k, v in
                                                                    (rec.parts or {}).items()}}, prefix="time/")

    def log_metrics(self, record: dict) -> None:
        assert "iteration" in record
        if self.restarts:
            record = {**record, "restarts": self.restarts}
        _append_jsonl(self.metrics_file, record)
        for log in self._loggers():
            log.scalars(record["iteration"], record)
            log.flush()

    def log_samples(self, iteration: int, records: list[dict]) -> None:
        """A few completions of the iteration, for people to read (samples.jsonl; TensorBoard text)."""
        if not records:
            return
        with open(self.samples_file, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))
        for log in self._loggers():
            if hasattr(log, "samples"):
                log.samples(iteration, records)

    def metrics(self) -> list[dict]:
        return read_jsonl(self.metrics_file)

    def samples(self) -> list[dict]:
        return read_jsonl(self.samples_file)

    def timings(self) -> list[dict]:
        return read_jsonl(self.timings_file)

    def truncate_after(self, iteration: int) -> None:
        """Drop records of iterations > `iteration` (work done after the checkpoint a resume starts from),
        so that no iteration is recorded twice (TensorBoard: events from iteration + 1 on are purged)."""
        self._tb_purge_step = iteration + 1
        for f in (self.metrics_file, self.timings_file, self.samples_file):
            kept = [r for r in read_jsonl(f) if r["iteration"] <= iteration]
            tmp = f.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            tmp.replace(f)

    # ---- checkpoints ---------------------------------------------------------------------------
    def checkpoint_dir(self, iteration: int) -> Path:
        return self.checkpoints / f"{CKPT_PREFIX}{iteration:07d}"

    @contextmanager
    def writing_checkpoint(self, iteration: int, run_state: dict) -> Iterator[Path]:
        """Yield a temporary directory to fill; on success write the run state into it and rename it
        into place atomically. A checkpoint without run_state.json is never considered complete."""
        final = self.checkpoint_dir(iteration)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        yield tmp
        state_tmp = tmp / (RUN_STATE_FILE + ".tmp")
        state_tmp.write_text(json.dumps(run_state))
        state_tmp.replace(tmp / RUN_STATE_FILE)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _fsync_dir(self.checkpoints)

    def latest_checkpoint(self) -> Path | None:
        complete = [
            p for p in self.checkpoints.glob(f"{CKPT_PREFIX}*")
            if not p.name.endswith(".tmp") and (p / RUN_STATE_FILE).exists()
        ]
        return max(complete, key=lambda p: p.name) if complete else None

    def prune_checkpoints(self, keep: int) -> None:
        for p in self.checkpoints.glob(f"{CKPT_PREFIX}*.tmp"):
            shutil.rmtree(p, ignore_errors=True)
        complete = sorted(p for p in self.checkpoints.glob(f"{CKPT_PREFIX}*") if not p.name.endswith(".tmp"))
        for p in complete[:-keep] if keep > 0 else []:
            shutil.rmtree(p, ignore_errors=True)

    @staticmethod
    def read_run_state(ckpt: Path) -> dict:
        return json.loads((ckpt / RUN_STATE_FILE).read_text())

    def write_final(self, iteration: int, parameter_digests: list[str]) -> None:
        """`final.json`: the last iteration and a digest of every trainer rank's parameters (equal digests,
        equal weights: what an uninterrupted and a resumed run are compared by)."""
        (self.path / "final.json").write_text(json.dumps(
            {"iteration": iteration, "parameter_digests": parameter_digests}, indent=1))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _alive(pid: Any) -> bool:
    return isinstance(pid, int) and pid_alive(pid)
