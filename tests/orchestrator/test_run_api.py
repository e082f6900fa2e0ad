"""tide from Python (orchestrator/run/api.py): what `tide run` and `tide resume` refuse with exit 2 is raised, and a
refused or finished run lets its directory go for the next run of the same process."""
from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.records.rundir import RunDir
from orchestrator.records.run_lock import hold_run_dir
from orchestrator.run import api


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text("name: api\niterations: 1\n")
    return path


def test_a_directory_holding_a_run_is_refused_and_let_go(tmp_path):
    run = RunDir(tmp_path / "run")
    with run.writing_checkpoint(1, {"iteration": 1}):
        pass
    with pytest.raises(api.UsageError, match=r"already holds a run with checkpoints: `tide resume"):
        api.run(_config(tmp_path), run_dir=tmp_path / "run")
    hold_run_dir(tmp_path / "run")  # free again: raises RunDirBusy while this process still holds it


def test_resume_refuses_what_is_not_a_run_or_already_done(tmp_path):
    with pytest.raises(api.UsageError, match=r"is not a run directory \(no config.yaml\)"):
        api.resume(tmp_path)
    run = RunDir(tmp_path / "run")
    (run.path / "config.yaml").write_text("name: api\niterations: 2\n")
    with run.writing_checkpoint(2, {"iteration": 2}):
        pass
    with pytest.raises(api.UsageError, match=r"--iterations 2: .* already has a checkpoint at iteration 2"):
        api.resume(run.path, iterations=2)


def test_pools_need_the_processs_ray_connection(tmp_path, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(api.UsageError, match=r"ray.init\(\) \(or ray.init\(address\) to join a cluster\)"):
        api.run(_config(tmp_path), run_dir=tmp_path / "run", pools=object())
    hold_run_dir(tmp_path / "run")  # let go


def test_a_finished_run_lets_its_directory_go(tmp_path, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # the pools' connection (not used: drive is replaced)
    ran, pools = [], object()
    monkeypatch.setattr(api, "drive", lambda cfg, run, resume, pools=None: ran.append((cfg.iterations, resume, pools)))
    run = api.run(_config(tmp_path), ["iterations=3"], run_dir=tmp_path / "run", pools=pools)
    assert ran == [(3, False, pools)] and run.lock_fd is None
    assert run.status()["state"] == "finished"
    (run.path / "config.yaml").write_text("name: api\niterations: 1\n")  # what a run records (Session.open)
    resumed = api.resume(tmp_path / "run", pools=pools)  # taken again by this process, and let go again
    assert ran[-1] == (1, True, pools) and resumed.lock_fd is None
