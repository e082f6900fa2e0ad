"""Two runs of one config at once, in two run directories, as a user starts them. One scores with a reward function
that returns 0 for everything (the way TRL's accuracy_reward scores plain numbers) and then raises: its console and
status.json name the function in a no-learning-signal warning, and its error ends it at once with the function's
own traceback on the console and in RUN_DIR/error.log, exit 2, never retried under --max-restarts, its warm start
kept in a checkpoint (tests/integration/test_loop.py resumes from one). The other goes on to its end, its engines
serving its own weights all along (the float32 log-prob gap of every iteration, not the distance between two
policies), although both publish under one config name and one ends early. A third start on a live run's
directory is refused; nothing is left in the publish root, nor a `vllm_dist_*` rendezvous file in /tmp."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.integration.run_helpers import ROOT, TIDE, tide

pytestmark = pytest.mark.slow

FP32_GAP = 1e-5  # what engine and trainer log-probs of the same float32 weights are apart (test_loop.py)

# `flat_then_broken` scores 0 until the second iteration's batch, which it fails on; `by_length` learns something
REWARDS = '''
def flat_then_broken(completions, trainer_state, **kwargs):
    if trainer_state.global_step >= 1:  # one optimizer step per iteration: the second iteration
        return parse_the_answer(completions)
    return [0.0 for _ in completions]


def parse_the_answer(completions):
    raise ValueError("the user's own bug: cannot parse " + repr(completions[0]))


def by_length(completions, **kwargs):
    return [float(len(c) % 2) for c in completions]
'''


def test_two_runs_of_one_config_one_failing_on_the_users_code(tmp_path, address):
    shm = f"/dev/shm/tide-test-two-{os.getpid()}"
    cfg = {
        "name": "twins", "deterministic": True, "iterations": 3, "save_every": 10,
        "ray": {"address": address},
        "model": {"tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                           "intermediate_size": 128}},
        "task": {"name": "addition", "max_digits": 1},
        "trainer": {"lr": 5e-3, "updates_per_iteration": 1, "warmup_sft_steps": 1, "warmup_sft_batch": 8,
                    "warmup_sft_lr": 3e-3},
        "rollout": {"prompts_per_iteration": 2, "n_samples": 2, "max_new_tokens": 4, "kv_cache_gb": 0.125,
                    "probe_prompts": 2},
        "rewards": [{"fn": "rewards.py:by_length"}],
        "logging": {"no_signal_after": 1},
        "publish": {"shm_root": shm},
    }
    (tmp_path / "rewards.py").write_text(REWARDS)
    config = tmp_path / "twins.yaml"
    config.write_text(yaml.safe_dump(cfg))
    leftovers = set(glob.glob(f"{tempfile.gettempdir()}/vllm_dist_*"))
    good, bad = tmp_path / "good", tmp_path / "bad"
    # different seeds and rewards: different weights from the first step on, so serving the other's would show
    argv = {good: ["seed=1"], bad: ["seed=2", "rewards.0.fn=rewards.py:flat_then_broken", "--max-restarts", "1",
                                    "--restart-backoff", "0"]}
    procs = {run: subprocess.Popen([*TIDE, "run", config, *args, "--run-dir", run], cwd=ROOT, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE) for run, args in argv.items()}
    try:
        _wait_for(lambda: (good / "run_id").is_file(), procs[good])
        busy = tide("run", config, "--run-dir", good, timeout=120)
        assert busy.returncode == 2, busy.stderr[-2000:]
        assert f"{good} is in use by a live run (pid {procs[good].pid})" in busy.stderr
        outs = {run: p.communicate(timeout=900) for run, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()

    assert procs[good].returncode == 0, outs[good][1][-4000:]
    metrics = [json.loads(line) for line in (good / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [1, 2, 3]
    assert all(0 < m["logprob_gap"] <= FP32_GAP for m in metrics), metrics
    assert (good / "run_id").read_text() != (bad / "run_id").read_text()

    err = outs[bad][1]
    assert procs[bad].returncode == 2, err[-4000:]
    # the reason first, then the user's own traceback, then where the whole one is
    tail = err[err.index("error: RewardFunctionError"):]
    assert "reward 'flat_then_broken'" in tail.splitlines()[0] and "the user's own bug" in tail.splitlines()[0]
    assert tail.index("in flat_then_broken") < tail.index("in parse_the_answer") < tail.index("error.log")
    log = (bad / "error.log").read_text()
    assert "rewards.py" in log and "in parse_the_answer" in log and "RewardFunctionError" in log
    assert not (bad / "restarts.jsonl").exists()  # not retried
    status = json.loads((bad / "status.json").read_text())
    assert status["state"] == "failed" and "the user's own bug" in status["error"]
    # iteration 1 scored 0 everywhere: the warning names the function and shows a sample's columns
    assert status["warning"].startswith("iteration 1: ") and "columns {answer: " in status["warning"]
    assert "reward 'flat_then_broken' returned 0 for every sample" in status["warning"], status
    assert "reward 'flat_then_broken' returned 0 for every sample" in " ".join(err.split())  # wrapped
    bad_metrics = [json.loads(line) for line in (bad / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in bad_metrics] == [1] and bad_metrics[0]["zero_std_groups"] == 1.0
    assert sorted(p.name for p in (bad / "checkpoints").iterdir()) == ["iter_0000000"]  # the warm start, kept

    assert not Path(shm).exists()  # each removed its own weights, and the root once empty
    assert set(glob.glob(f"{tempfile.gettempdir()}/vllm_dist_*")) <= leftovers


def _wait_for(ready, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        assert time.monotonic() < deadline, "the run never took its directory"
        time.sleep(0.05)
