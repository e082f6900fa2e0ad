"""Two runs of one config at once, in two run directories, as a user starts them: each publishes its weights under
its own run's key and its engines serve its own weights (the log-prob gap of every iteration is the float32 one,
not the distance between two different policies); a third start on a live run's directory is refused; neither
leaves a `vllm_dist_*` rendezvous file in /tmp, nor anything in its publish root."""
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


def test_two_runs_of_one_config_keep_their_own_weights(tmp_path, address):
    shm = f"/dev/shm/tide-test-two-{os.getpid()}"
    cfg = {
        "name": "twins", "deterministic": True, "iterations": 3, "save_every": 10,
        "ray": {"address": address},
        "model": {"tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                           "intermediate_size": 128}},
        "task": {"name": "addition", "max_digits": 1},
        "trainer": {"lr": 5e-3, "warmup_sft_steps": 1, "warmup_sft_batch": 8, "warmup_sft_lr": 3e-3},
        "rollout": {"prompts_per_iteration": 2, "n_samples": 2, "max_new_tokens": 4, "kv_cache_gb": 0.125,
                    "probe_prompts": 2},
        "publish": {"shm_root": shm},
    }
    config = tmp_path / "twins.yaml"
    config.write_text(yaml.safe_dump(cfg))
    leftovers = set(glob.glob(f"{tempfile.gettempdir()}/vllm_dist_*"))
    runs = [tmp_path / "a", tmp_path / "b"]
    # different seeds: different weights from the first step on, so an engine serving the other run's shows
    procs = [subprocess.Popen([*TIDE, "run", config, f"seed={seed}", "--run-dir", run], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for seed, run in zip((1, 2), runs)]
    try:
        _wait_for(lambda: (runs[0] / "run_id").is_file() and (runs[0] / "lock").is_file(), procs[0])
        busy = tide("run", config, "--run-dir", runs[0], timeout=120)
        assert busy.returncode == 2, busy.stderr[-2000:]
        assert f"{runs[0]} is in use by a live run (pid {procs[0].pid})" in busy.stderr
        outs = [p.communicate(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    ids = [(run / "run_id").read_text().strip() for run in runs]
    assert ids[0] != ids[1]
    digests = []
    for run in runs:
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [m["iteration"] for m in metrics] == [1, 2, 3]
        assert all(0 < m["logprob_gap"] <= FP32_GAP for m in metrics), metrics
        digests.append(json.loads((run / "final.json").read_text())["parameter_digests"])
    assert digests[0] != digests[1]  # two policies, each served to its own engines
    assert not Path(shm).exists()  # each removed its own weights, and the root once empty
    assert set(glob.glob(f"{tempfile.gettempdir()}/vllm_dist_*")) <= leftovers


def _wait_for(ready, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        assert time.monotonic() < deadline, "the run never took its directory"
        time.sleep(0.05)
