"""The short soak (scripts/soak.py --quick): the quickstart job under `tide run --max-restarts`, an engine SIGKILLed
mid-rollout (absorbed: replaced on its iteration) and a trainer rank SIGKILLed mid-train (the driver fails, the
run restarts from its checkpoint); it ends with the parameters and metrics of an uninterrupted run and leaves
nothing behind. The 1000-iteration soak with five kinds of fault: docs/training.md#long-runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_quick_soak_restarts_through_faults_and_ends_as_an_uninterrupted_run(tmp_path, worker_pools):
    # the quickstart job with an eighth of its rollout: the suite's time goes to the restarts
    job = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    job["rollout"] |= {"prompts_per_iteration": 16, "n_samples": 4}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    out, work = tmp_path / "soak.json", tmp_path / "work"
    # the uninterrupted run it must end as (soak.py --quick's settings), in this process on the session's pooled
    # ranks and engine: the soak's own processes are the faulted run's
    from tests.integration.run_helpers import run_here

    reference = run_here(worker_pools, tmp_path / "job.yaml", "iterations=16", "save_every=4",
                         "rollout.engine_call_timeout_s=20.0",
                         f"publish.shm_root=/dev/shm/tide-test-soak-{os.getpid()}", run_dir=tmp_path / "reference")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--quick", "--config",
                           str(tmp_path / "job.yaml"), "--work-dir", str(work), "--out", str(out),
                           "--restart-backoff", "0", "--reference", str(reference)], capture_output=True, text=True,
                          timeout=1200, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert {g["name"]: g["met"] for g in doc["goals"]} == {g["name"]: True for g in doc["goals"]}
    assert {f["kind"] for f in doc["faults"]} == {"engine_kill", "trainer_kill"}
    effects = {f["kind"]: f["effect"] for f in doc["faults"]}
    assert effects["engine_kill"] == "absorbed: no restart", effects
    assert effects["trainer_kill"].startswith("restart 1 ") and "ActorDiedError" in effects["trainer_kill"], effects

    run_dir = work / "soak"
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "finished" and status["restarts"] == 1
    # the failed attempt's traceback is in the run directory (its terminal showed the one-line reason)
    assert "ActorDiedError" in (run_dir / "error.log").read_text()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # RL moved the weights on both sides of the restart: equal digests are no accident of a run that never steps
    first_restart = doc["restarts"][0]["from_iteration"]
    assert sum(m["optimizer_steps"] for m in metrics[:first_restart]) > 0
    assert sum(m["optimizer_steps"] for m in metrics[first_restart:]) > 0
    first = doc["restarts"][0]["from_iteration"]
    assert all("restarts" not in m for m in metrics[:first]) and metrics[-1]["restarts"] == 1
    shown = subprocess.run([sys.executable, "-m", "orchestrator.run.cli", "inspect", str(run_dir), "--no-plot"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "status: finished" in shown.stdout and f"restart 1: from iteration {first} after exit 1" in shown.stdout


def test_shm_full_fills_what_is_free_when_the_run_writes_meanwhile(tmp_path, monkeypatch):
    """status.json lags the run, so a publish can be writing into the root while the soak fills it: a fill sized
    before that write no longer fits (ENOSPC) and is retried with what is free then, from an empty file."""
    import errno
    import os
    from collections import namedtuple

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    monkeypatch.delitem(sys.modules, "soak", raising=False)
    import soak
    usage = namedtuple("usage", "total used free")
    seen_free = iter([1000, 600])  # the run writes 400 bytes between the first look and the fill
    calls = []

    def fallocate(fd, offset, size):
        calls.append((size, os.fstat(fd).st_size))
        if size > 600:
            os.ftruncate(fd, 300)  # a failed fallocate can leave what it allocated
            raise OSError(errno.ENOSPC, "No space left on device")
        os.ftruncate(fd, size)

    monkeypatch.setattr(soak.shutil, "disk_usage", lambda path: usage(1000, 0, next(seen_free)))
    monkeypatch.setattr(soak.os, "posix_fallocate", fallocate)
    runner = soak.Soak(None, tmp_path / "c.yaml", [], tmp_path / "run", tmp_path, [])
    assert runner._fill_shm() == 600
    assert calls == [(1000, 0), (600, 0)]  # the second try from an empty file
    assert (tmp_path / ".soak-filler").stat().st_size == 600
