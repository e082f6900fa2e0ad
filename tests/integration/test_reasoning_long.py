"""configs/reasoning_long.yaml, shortened (a short warm start, one iteration): completions run to a thousand
tokens and more, the trainer packs them (several sequences to a row), and the engines' log-probs of those
completions match the trainer's on the packed rows (rollout.max_logprob_gap, checked every iteration)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from tests.integration.run_helpers import ROOT, run_here

pytestmark = pytest.mark.slow


def test_reasoning_length_completions_train_packed_within_the_gap(tmp_path, address, worker_pools):
    cfg = yaml.safe_load((ROOT / "configs" / "reasoning_long.yaml").read_text())
    cfg |= {"ray": {"address": address}, "iterations": 1, "save_every": 1}
    cfg["publish"]["shm_root"] = f"/dev/shm/tide-test-long-{os.getpid()}"
    # enough of the warm start that the model writes numbers and has not learnt to stop: samples run on. The
    # config's sloppy teacher sampled at 1.0 needs its 400 steps for that (40: completions of ~480 tokens); exact
    # demonstrations sampled at 0.7 write long answers after 40
    cfg["task"]["sft_skip"] = 0.0
    cfg["trainer"] |= {"warmup_sft_steps": 40, "warmup_sft_batch": 4}
    cfg["rollout"] |= {"prompts_per_iteration": 2, "n_samples": 4, "max_new_tokens": 1100, "temperature": 0.7}
    path = tmp_path / "reasoning_long.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_here(worker_pools, path, run_dir=tmp_path / "run")
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1
    for m in metrics:
        print({k: m[k] for k in ("completion_len", "completion_len_max", "packed_rows", "packed_sequences_per_row",
                                 "logprob_gap")})
        assert m["completion_len"] >= 700 and m["completion_len_max"] >= 1000
        # every optimizer step's sequences went through the model packed, several to a row
        assert m["packed_rows"] >= 2 and m["packed_sequences_per_row"] > 1.5
        # a finished run means the gap held; float32 engine and trainer agree to ~1e-7, never exactly
        assert 0 < m["logprob_gap"] <= 1e-5
    assert Path(tmp_path / "run" / "final.json").is_file()
