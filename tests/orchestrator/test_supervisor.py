"""The restart policy of `--max-restarts` (orchestrator/run/supervisor.py) on drivers that end as planned: which exits
are retried, the budget, the doubling backoff, what status.json and restarts.jsonl say, an interrupt while waiting.
The real driver dying of a killed trainer rank: tests/integration/test_loop.py."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from orchestrator.records.rundir import RunDir
from orchestrator.run.supervisor import Supervisor, retried

ROOT = Path(__file__).resolve().parents[2]

# A driver that plays attempt k of a plan: records its arguments, says in status.json that it runs, then ends
# with plan[k] (negative: killed by that signal, saying nothing, as a SIGKILLed driver does).
DRIVER = r"""
import json, os, signal, sys
sys.path.insert(0, {root!r})
from orchestrator.records.rundir import RunDir
run_dir, plan = sys.argv[1], json.loads(sys.argv[2])
argv = sys.argv[3:]
log = os.path.join(run_dir, "attempts.jsonl")
k = sum(1 for _ in open(log)) if os.path.exists(log) else 0
with open(log, "a") as f:
    f.write(json.dumps(argv) + "\n")
run = RunDir(run_dir)
run.set_status(iteration=k + 1, phase="train")
code = plan[k]
if code < 0:
    os.kill(os.getpid(), -code)
if code == 1:
    run.end_status(RuntimeError(f"attempt {{k}} failed"))
elif code == 0:
    run.end_status()
sys.exit(code)
"""


def _supervisor(tmp_path: Path, plan: list[int], max_restarts: int, backoff_s: float = 0.05) -> Supervisor:
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(root=str(ROOT)))
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    return Supervisor(run_dir, max_restarts, backoff_s,
                      driver=(sys.executable, str(script), str(run_dir), json.dumps(plan)))


def _attempts(tmp_path: Path) -> list[list[str]]:
    return [json.loads(line) for line in (tmp_path / "run" / "attempts.jsonl").read_text().splitlines()]


def test_which_exits_are_retried():
    assert retried(1) and retried(-signal.SIGKILL) and retried(-signal.SIGSEGV)
    for code in (0, 2, 130, -signal.SIGTERM, -signal.SIGINT):
        assert not retried(code)


def test_faults_are_restarted_as_resumes_with_a_doubling_backoff(tmp_path):
    sup = _supervisor(tmp_path, [1, -signal.SIGKILL, 0], max_restarts=2)
    assert sup.run(["run", "cfg.yaml", "--run-dir", str(sup.run_dir)]) == 0
    run = tmp_path / "run"
    assert _attempts(tmp_path) == [["run", "cfg.yaml", "--run-dir", str(run)], ["resume", str(run)],
                                   ["resume", str(run)]]
    first, second = [json.loads(line) for line in (run / "restarts.jsonl").read_text().splitlines()]
    assert (first["restart"], first["exit_code"], first["error"]) == (1, 1, "RuntimeError: attempt 0 failed")
    assert (second["restart"], second["exit_code"]) == (2, -signal.SIGKILL)
    assert "ended without recording how" in second["error"]  # a SIGKILLed driver writes nothing
    assert (first["backoff_s"], second["backoff_s"]) == (0.05, 0.1)
    assert first["from_iteration"] == 0  # no checkpoint yet: the run starts over
    status = RunDir(run).status()
    assert status["state"] == "finished" and status["restarts"] == 2


def test_input_errors_and_interrupts_are_never_retried(tmp_path):
    for code in (2, 130):
        sup = _supervisor(tmp_path / str(code), [code, 0], max_restarts=3)
        assert sup.run(["resume", str(sup.run_dir)]) == code
        assert len(_attempts(tmp_path / str(code))) == 1
        assert not (sup.run_dir / "restarts.jsonl").exists()


def test_a_spent_budget_ends_with_the_last_failure(tmp_path):
    sup = _supervisor(tmp_path, [1, 1, 0], max_restarts=1)
    assert sup.run(["resume", str(sup.run_dir)]) == 1
    assert len(_attempts(tmp_path)) == 2
    status = RunDir(sup.run_dir).status()
    assert (status["state"], status["error"], status["restarts"]) == ("failed", "RuntimeError: attempt 1 failed", 1)
    # a later supervised resume counts on from the run's own count
    again = _supervisor(tmp_path, [1, 1, 1, 0], max_restarts=1)
    assert again.run(["resume", str(again.run_dir)]) == 0
    assert RunDir(again.run_dir).status()["restarts"] == 2


def test_sigterm_while_waiting_to_restart_ends_the_run_interrupted(tmp_path):
    sup = _supervisor(tmp_path, [1, 0], max_restarts=1, backoff_s=60)
    status_file = sup.run_dir / "status.json"

    def interrupt_when_restarting():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if json.loads(status_file.read_text()).get("state") == "restarting":
                    os.kill(os.getpid(), signal.SIGTERM)
                    return
            except (FileNotFoundError, json.JSONDecodeError):
                pass
            time.sleep(0.01)

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    watcher = threading.Thread(target=interrupt_when_restarting)
    watcher.start()
    try:
        started = time.monotonic()
        assert sup.run(["resume", str(sup.run_dir)]) == 130
        assert time.monotonic() - started < 30  # not the 60 s backoff
    finally:
        watcher.join()
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert len(_attempts(tmp_path)) == 1
    status = RunDir(sup.run_dir).status()
    assert status["state"] == "failed" and "while waiting to restart" in status["error"]


def test_restarting_status_with_a_dead_supervisor_reads_failed(tmp_path):
    run = RunDir(tmp_path / "run")
    run.set_status(state="restarting", restarts=1, error="x")
    status = json.loads(run.status_file.read_text())
    status["driver_pid"] = 2**22 + 12345  # no such process
    run.status_file.write_text(json.dumps(status))
    assert run.status()["state"] == "failed"
