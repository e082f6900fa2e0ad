"""A scheduler stopping a job (SLURM's scancel or time limit, `kill -TERM -- -PGID`) signals every process of it,
the local Ray cluster's raylet included, and sends SIGKILL after a grace period (SLURM's KillWait: 30 s by
default). A run with a cluster of its own must be done within it: exit 130, status.json `failed` (interrupted),
its engines and trainer ranks gone, nothing left in /dev/shm."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.workers.cluster import workers_of
from rollout.engine_proc import pids_alive

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
GRACE_S = 30.0


@pytest.mark.parametrize("when", ["iteration 3", "start-up"])
def test_sigterm_to_every_process_of_the_job_ends_the_run_in_order_within_the_grace(tmp_path, when):
    """Before the driver checked for its raylet, every Ray call of its teardown waited out its timeout (61 s
    measured) and ray.shutdown could end the process before status.json said how the run ended. `start-up`: the
    signal comes once the run's first engine actor exists (the engines start while the trainer does), before
    any iteration; before the start-up's own stops checked for the raylet, that took 60-70 s and left
    status.json `running`."""
    shm = Path(f"/dev/shm/tide-test-stop-{os.getpid()}-{tmp_path.name}")  # a failed case's leftovers are its own
    cfg = {
        "name": "stop", "seed": 3, "deterministic": True, "iterations": 200, "save_every": 50,
        "model": {"tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                           "intermediate_size": 128}},
        "task": {"name": "addition", "max_digits": 1},
        "trainer": {"loss": "kimi", "lr": 2e-3},
        "rollout": {"prompts_per_iteration": 8, "n_samples": 4, "max_new_tokens": 4, "sync_mode": "reload",
                    "kv_cache_gb": 0.125},
        "publish": {"shm_root": str(shm)},
    }  # no ray.address: the run starts its own cluster, whose raylet the job's SIGTERM reaches too
    (tmp_path / "stop.yaml").write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    with open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.run.cli", "run", str(tmp_path / "stop.yaml"),
                                 "--run-dir", str(run_dir)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr,
                                start_new_session=True)
    try:
        deadline, status, engines = time.monotonic() + 600, {}, []
        while status.get("iteration", 0) < 3 if when == "iteration 3" else not engines:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()[-4000:]
            try:
                status = json.loads((run_dir / "status.json").read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                pass
            if when == "start-up":  # the process scan can take seconds under load, long enough to miss iteration 3
                raylets = [str(p) for p in _group(proc.pid) if _comm(p) == "raylet"]
                engines = [p for p in workers_of(set(raylets), "") if _comm(p).startswith("ray::RolloutEn")]
            time.sleep(0.01)
        assert status.get("iteration", 0) == (0 if when == "start-up" else 3), status
        raylets = [p for p in _group(proc.pid) if _comm(p) == "raylet"]
        assert raylets, "the run's own raylet shares its process group"
        started = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=300)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = (tmp_path / "stderr").read_text()
    assert proc.returncode == 130 and "interrupted; `tide resume` continues" in err, err[-4000:]
    assert took < GRACE_S, f"the run took {took:.1f} s to stop"
    final = json.loads((run_dir / "status.json").read_text())
    assert (final["state"], final["error"]) == ("failed", "interrupted (Ctrl-C or SIGTERM)")
    assert pids_alive(status.get("engine_pids", []) + status.get("trainer_pids", []) + raylets) == []
    assert workers_of({str(p) for p in raylets}, "") == []  # every worker its raylet started, agents aside
    assert not shm.exists()


def _group(pgid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid:
                    out.append(int(entry))
            except ProcessLookupError:
                pass
    return out


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
