"""configs/reward_model.yaml and configs/judge.yaml: the quickstart job scored by a served reward model or a
generative judge (`models:`, Ray actors of their own). The reward model's replica SIGKILLed mid-run is replaced
and the run goes on to its last iteration; with the reward model scripts/train_reward_model.py trains (or the
judge scripts/train_judge.py trains), RL raises the model's score and the rule it encodes (the right sum)
without ever rewarding that rule directly."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.integration.run_helpers import ROOT, resume_here, run_here

pytestmark = pytest.mark.slow


def _config(tmp_path: Path, rm_dir: Path, name: str = "reward_model", **top) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    cfg["models"][next(iter(cfg["models"]))]["path"] = str(rm_dir)
    cfg["publish"]["shm_root"] = f"/dev/shm/tide-test-{name}-{os.getpid()}"
    cfg.update(top)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _trained(script: str, out: Path, report_name: str) -> dict:
    """scripts/`script` run as users run it, writing its model to `out`; its training report."""
    trained = subprocess.run([sys.executable, f"scripts/{script}", "--out", str(out)], cwd=ROOT,
                             capture_output=True, text=True, timeout=600)
    assert trained.returncode == 0, trained.stderr[-3000:]
    return json.loads((out / report_name).read_text())


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_reward_model_killed_mid_run_is_replaced_and_the_run_goes_on_exactly(tmp_path, tiny_model_dir,
                                                                               worker_pools):
    """The run whose replica died ends as one stopped at iteration 3 and resumed (scores rescored by the
    replacement are the same scores; a resumed run starts a new replica and ends as an uninterrupted one)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rm_dir = tmp_path / "rm"  # random weights: what is checked is its serving, not its judgement
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1).save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(rm_dir)
    run_dir = tmp_path / "run"
    killed: list[int] = []

    def kill_after_the_second_iteration() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            status, metrics = run_dir / "status.json", run_dir / "metrics.jsonl"
            if status.exists() and metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                pid = json.loads(status.read_text())["served_pids"]["rm"][0]
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_after_the_second_iteration, daemon=True)
    killer.start()
    run_here(worker_pools, _config(tmp_path, rm_dir, iterations=5, save_every=5), run_dir=run_dir)
    killer.join()
    assert killed, "the reward model's replica was never killed"
    metrics = _metrics(run_dir)
    assert [m["iteration"] for m in metrics] == [1, 2, 3, 4, 5]
    assert metrics[0]["served/rm/replaced"] == 0.0 and metrics[-1]["served/rm/replaced"] == 1.0
    assert all(m["served/rm/scored"] == 64 * 8 and "reward/right" in m and "reward/rm" in m for m in metrics)
    timings = [json.loads(line) for line in (run_dir / "timings.jsonl").read_text().splitlines()]
    reward = [t for t in timings if t["phase"] == "reward"]
    assert len(reward) == 5 and all(0 < t["parts"]["served/rm"] <= t["seconds"] for t in reward)
    with pytest.raises(ProcessLookupError):
        os.kill(killed[0], 0)
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
    (tmp_path / "short").mkdir()
    short = run_here(worker_pools, _config(tmp_path / "short", rm_dir, iterations=3, save_every=5),
                     run_dir=tmp_path / "short" / "run")
    resume_here(worker_pools, short, iterations=5)

    def learning(d: Path) -> list[dict]:
        return [{k: v for k, v in m.items() if k != "served/rm/replaced"} for m in _metrics(d)]

    assert learning(short) == learning(run_dir)
    assert (short / "samples.jsonl").read_text() == (run_dir / "samples.jsonl").read_text()
    assert json.loads((short / "final.json").read_text())["parameter_digests"] == \
        json.loads((run_dir / "final.json").read_text())["parameter_digests"]


@pytest.mark.skipif(not os.environ.get("TIDE_LEARN_MODELS"),
                    reason="the reward model's training (~30 s) and a 70-iteration run: set TIDE_LEARN_MODELS=1")
def test_rl_on_the_trained_reward_model_raises_its_score_and_the_rule_it_encodes(tmp_path, worker_pools):
    rm_dir = tmp_path / "rm"
    report = _trained("train_reward_model.py", rm_dir, "tide_reward_model.json")
    assert report["held_out_pairwise_accuracy"]["all"] >= 0.9, report
    run_dir = run_here(worker_pools, _config(tmp_path, rm_dir), run_dir=tmp_path / "run")
    metrics = _metrics(run_dir)
    scores = [m["reward/rm"] for m in metrics]
    right = [m["reward/right"] for m in metrics]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    first = [s["reward"] for s in samples if s["iteration"] <= 2]
    spread = (sum((x - sum(first) / len(first)) ** 2 for x in first) / len(first)) ** 0.5
    # the score's rise on its own scale: in standard deviations of the first two iterations' logged samples
    rise = (sum(scores[-10:]) / 10 - sum(scores[:2]) / 2) / spread
    assert rise >= 0.3, (rise, scores)
    assert sum(right[-10:]) / 10 >= sum(right[:2]) / 2 + 0.1, right


@pytest.mark.skipif(not os.environ.get("TIDE_LEARN_MODELS"),
                    reason="the judge's training (~30 s) and a 70-iteration run: set TIDE_LEARN_MODELS=1")
def test_rl_on_the_trained_judge_raises_the_rule_it_reads(tmp_path, worker_pools):
    judge_dir = tmp_path / "judge"
    report = _trained("train_judge.py", judge_dir, "tide_judge.json")
    assert report["held_out_agreement"]["all"] >= 0.9, report  # its verdicts follow the rule
    run_dir = run_here(worker_pools, _config(tmp_path, judge_dir, "judge"), run_dir=tmp_path / "run")
    metrics = _metrics(run_dir)
    right, judged = [m["reward/right"] for m in metrics], [m["reward/judge"] for m in metrics]
    assert all("served/judge/unreadable" in m for m in metrics)
    assert sum(right[-10:]) / 10 >= sum(right[:2]) / 2 + 0.1, right
    assert sum(judged[-10:]) / 10 >= sum(judged[:2]) / 2 + 0.1, judged
    logged = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert all(isinstance(s["judge/reply"], str) for s in logged)  # the judge's reply beside each logged sample
