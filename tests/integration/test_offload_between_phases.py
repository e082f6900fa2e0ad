"""trainer.offload_between_phases on CPU (the hybrid deployment's handover, orchestrator/iteration/colocation.py):
a run whose trainer ranks release their parameters, gradients and optimizer state after every publish and take
them back for each pass (the reference's log-probs, the train step, the probe, a checkpoint) ends exactly as the
run that keeps them, with deterministic: true, also when its engines are stopped while the trainer holds its
memory and started by the next sync (sync_mode restart, the Kimi way); the offload and onload phases are in
timings.jsonl."""
from __future__ import annotations

import json
import os

import pytest
import yaml

from tests.integration.run_helpers import run_here

pytestmark = pytest.mark.slow

# what a run's metrics hold that is not a function of its config and seed
TIMED = ("seconds", "per_s", "_s", "time")


def _run(tmp_path, address: str, pools, offload: bool, sync_mode: str = "reload") -> tuple[list[dict], list[dict]]:
    name = f"{'offload' if offload else 'resident'}-{sync_mode}"
    cfg = {
        "name": f"offload-{name}", "deterministic": True, "iterations": 2, "save_every": 1, "keep_checkpoints": 1,
        "ray": {"address": address},
        "model": {"tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                           "intermediate_size": 128}},
        "task": {"name": "addition", "max_digits": 1},
        # kl: the reference's log-probs need the frozen copy back too
        "trainer": {"lr": 5e-3, "kl": {"coef": 0.01}, "offload_between_phases": offload},
        "rollout": {"prompts_per_iteration": 2, "n_samples": 2, "max_new_tokens": 4, "kv_cache_gb": 0.125,
                    "probe_every": 2, "probe_prompts": 2, "sync_mode": sync_mode},
        "publish": {"shm_root": f"/dev/shm/tide-test-offload-{os.getpid()}"},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / name
    run_here(pools, path, run_dir=run_dir)
    read = lambda f: [json.loads(line) for line in (run_dir / f).read_text().splitlines()]  # noqa: E731
    return read("metrics.jsonl"), read("timings.jsonl")


def test_offloading_between_phases_ends_as_the_run_that_keeps_its_memory(tmp_path, address, worker_pools):
    offloaded, timings = _run(tmp_path, address, worker_pools, offload=True)
    resident, resident_timings = _run(tmp_path, address, worker_pools, offload=False)
    assert len(offloaded) == len(resident) == 2
    for a, b in zip(offloaded, resident):
        assert {"reward_mean", "loss", "grad_norm", "kl_ref", "logprob_gap"} <= a.keys()
        kept = [k for k in a if not any(t in k for t in TIMED)]
        assert {k: a[k] for k in kept} == {k: b[k] for k in kept}
    assert "probe_gap" in offloaded[1]  # the probe of iteration 2 ran with the trainer's memory taken back
    phases = [(t["iteration"], t["phase"]) for t in timings if t["phase"] in ("offload", "onload")]
    # each iteration: out before its rollout (the first) or after its publish, back for its log-probs and
    # train step, back beside the engines for the probe (iteration 2), back for its checkpoint, and for the end
    assert phases == [(1, "offload"), (1, "onload"), (1, "offload"), (1, "onload"), (1, "offload"),
                      (2, "onload"), (2, "offload"), (2, "onload"), (2, "offload"), (2, "onload"), (2, "offload"),
                      (2, "onload")], phases
    moved = [t for t in timings if t["phase"] in ("offload", "onload")]
    assert all(t["bytes"] > 0 and t["parts"]["trainer"] >= 0 for t in moved)
    assert not [t for t in resident_timings if t["phase"] in ("offload", "onload")]

    # restart: the engines stopped at each onload (before the trainer's log-probs and its checkpoints), started by
    # the sync on the new weights, or by the next rollout on the weights they served after a checkpoint
    stopped, timings = _run(tmp_path, address, worker_pools, offload=True, sync_mode="restart")
    for a, b in zip(stopped, resident):
        kept = [k for k in a if not any(t in k for t in TIMED)]
        assert {k: a[k] for k in kept} == {k: b[k] for k in kept}
    onloads = [t for t in timings if t["phase"] == "onload"]
    assert [sorted(t["parts"]) for t in onloads] == [["engine_stop", "trainer"], ["engine_stop", "trainer"],
                                                     ["engine_stop", "trainer"], ["trainer"], ["engine_stop", "trainer"],
                                                     ["engine_stop", "trainer"]]
