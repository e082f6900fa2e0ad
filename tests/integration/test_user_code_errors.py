"""A user's reward function through a whole run, as a user meets it: one that scores nothing is named in a warning
(console and status.json) while the run goes on, and one that raises ends the run at once with its traceback on the
console and in RUN_DIR/error.log, exit 2, never retried under --max-restarts; the warm start before it is kept in a
checkpoint, from which the run resumes once the function is fixed."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from tests.integration.run_helpers import tide

pytestmark = pytest.mark.slow

# Scores 0 on everything (the way TRL's accuracy_reward scores plain numbers) until the second iteration's batch,
# which it fails on; `fixed` scores the completions by length instead.
REWARD = '''
def flat_then_broken(completions, trainer_state, **kwargs):
    if trainer_state.global_step >= 1:  # one optimizer step per iteration: the second iteration
        return parse_the_answer(completions)
    return [0.0 for _ in completions]


def parse_the_answer(completions):
    raise ValueError("the user's own bug: cannot parse " + repr(completions[0]))


def fixed(completions, **kwargs):
    return [float(len(c) % 2) for c in completions]
'''


def _config(tmp: Path, address: str, fn: str) -> Path:
    cfg = {
        "name": "user-code", "seed": 5, "deterministic": True, "iterations": 2, "save_every": 10,
        "ray": {"address": address},
        "model": {"tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                           "intermediate_size": 128}},
        "task": {"name": "addition", "max_digits": 1},
        "trainer": {"lr": 2e-3, "updates_per_iteration": 1, "warmup_sft_steps": 1, "warmup_sft_batch": 8, "warmup_sft_lr": 3e-3},
        "rollout": {"prompts_per_iteration": 2, "n_samples": 2, "max_new_tokens": 4, "kv_cache_gb": 0.125,
                    "probe_prompts": 2},
        "rewards": [{"fn": f"rewards.py:{fn}"}],
        "logging": {"no_signal_after": 1},
        "publish": {"shm_root": f"/dev/shm/tide-test-{os.getpid()}"},
    }
    path = tmp / "user_code.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_flat_reward_is_named_and_a_raising_one_stops_the_run_without_a_retry(tmp_path, address):
    (tmp_path / "rewards.py").write_text(REWARD)
    run_dir = tmp_path / "run"
    proc = tide("run", _config(tmp_path, address, "flat_then_broken"), "--run-dir", run_dir, "--max-restarts", "1",
                "--restart-backoff", "0")
    assert proc.returncode == 2, proc.stderr[-4000:]
    # the reason first, then the user's own traceback, then where the whole one is
    tail = proc.stderr[proc.stderr.index("error: RewardFunctionError"):]
    assert "reward 'flat_then_broken'" in tail.splitlines()[0] and "the user's own bug" in tail.splitlines()[0]
    assert tail.index("in flat_then_broken") < tail.index("in parse_the_answer") < tail.index("error.log")
    log = (run_dir / "error.log").read_text()
    assert "rewards.py" in log and "in parse_the_answer" in log and "RewardFunctionError" in log
    assert not (run_dir / "restarts.jsonl").exists()  # not retried
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and "the user's own bug" in status["error"]
    # iteration 1 scored 0 everywhere: the warning names the function, shows a sample's columns
    assert "reward 'flat_then_broken' returned 0 for every sample" in status["warning"], status
    assert status["warning"].startswith("iteration 1: ") and "columns {answer: " in status["warning"]
    assert "reward 'flat_then_broken' returned 0 for every sample" in " ".join(proc.stderr.split())  # wrapped
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [1] and metrics[0]["zero_std_groups"] == 1.0
    # the warm start's steps are kept: a checkpoint at iteration 0, which a resume starts from
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["iter_0000000"]

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["rewards"][0]["fn"] = config["rewards"][0]["fn"].replace("flat_then_broken", "fixed")
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    resumed = tide("resume", run_dir)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from iteration 0" in resumed.stderr
    timings = [json.loads(line) for line in (run_dir / "timings.jsonl").read_text().splitlines()]
    assert [t["phase"] for t in timings].count("warmup") == 1  # not warmed up again
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [1, 2]
