"""A session whose local raylet has died stops without asking Ray anything (each call would wait out its timeout):
the engine and trainer processes status.json names are SIGKILLed when they are Ray workers (a pid reused by
anything else is left alone), the shared memory is removed, the rest of the cluster abandoned, and the stops
that need no Ray (the sandbox's, the reward functions') still run. The whole path, a job's SIGTERM reaching the
raylet: tests/integration/test_job_stop.py."""
from __future__ import annotations

import subprocess
from contextlib import ExitStack
from types import SimpleNamespace

from orchestrator.rundir import RunDir
from orchestrator.session import Session


def test_a_session_whose_raylet_died_ends_its_workers_by_pid_and_asks_ray_nothing(tmp_path):
    worker = subprocess.Popen(["bash", "-c", 'exec -a "ray::RolloutEngine.generate" sleep 60'])
    bystander = subprocess.Popen(["sleep", "60"])  # a recorded pid reused by a process that is no Ray worker
    try:
        run = RunDir(tmp_path / "run")
        run.set_status(engine_pids=[worker.pid], trainer_pids=[bystander.pid])
        done: list[str] = []
        teardown = ExitStack()
        teardown.callback(done.append, "sandbox stopped")
        ray_side = teardown.enter_context(ExitStack())
        ray_side.callback(done.append, "asked Ray")
        session = Session(cfg=None, run=run, task=None, tokenizer=None, trainer=None, probe=[],
                          weights=SimpleNamespace(release_local=lambda: done.append("shared memory removed")))
        session._teardown, session._ray_side = teardown, ray_side
        session._cluster = SimpleNamespace(head_lost=lambda: True, abandon=lambda: done.append("cluster abandoned"))
        session.close()
        assert done == ["shared memory removed", "cluster abandoned", "sandbox stopped"]
        assert worker.wait(timeout=10) == -9
        assert bystander.poll() is None
    finally:
        for p in (worker, bystander):
            p.kill()
            p.wait()
