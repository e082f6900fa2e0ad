"""A LoRA run end to end (configs/lora.yaml through the CLI, on the test session's Ray cluster): the engines serve
the trainer's adapted policy within the log-prob gap bound every iteration, a KL term against the base (adapters
off) is computed, RUN_DIR/hf is a PEFT adapter over the base, `tide export` writes and verifies the adapter and the
merged model, and a run resumed from its checkpoint (adapters and optimizer state only) ends exactly as the
uninterrupted one."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from tests.integration.run_helpers import ROOT, assert_ends_as, resume_cut_back, tide

pytestmark = pytest.mark.slow

FP32_GAP = 1e-5  # float32 engine and trainer log-probs of the same tokens: ~1e-7 apart (tests/integration/test_loop.py)


def _config(tmp: Path, address: str, sync: str) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / "lora.yaml").read_text())
    cfg.update(iterations=3, save_every=2, ray={"address": address})
    cfg["trainer"] |= {"warmup_sft_steps": 4, "warmup_sft_batch": 32, "kl": {"coef": 0.05}}
    cfg["trainer"]["lora"]["sync"] = sync
    cfg["rollout"] |= {"prompts_per_iteration": 8, "n_samples": 4, "kv_cache_gb": 0.125, "probe_prompts": 4}
    cfg["publish"]["shm_root"] = f"/dev/shm/tide-test-lora-{os.getpid()}"
    path = tmp / "lora.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_lora_run_serves_exports_and_resumes_exactly(tmp_path, address, sync):
    """Both syncs serve the trainer's policy; the adapter sync moves only the adapter (its publish a few percent
    of the model's). Exports and the resume are checked once (they do not depend on the sync)."""
    from peft import PeftConfig

    whole = tmp_path / "whole"
    proc = tide("run", _config(tmp_path, address, sync), "--run-dir", whole)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3
    for m in metrics:
        assert 0 < m["logprob_gap"] <= FP32_GAP, m
        assert m["kl_ref"] != 0, m  # the reference is the base: the adapters moved the policy off it
    published = [t["bytes"] for t in map(json.loads, (whole / "timings.jsonl").read_text().splitlines())
                 if t["phase"] == "publish"]
    status = json.loads((whole / "status.json").read_text())
    model_bytes, adapter_bytes = 4 * status["lora_base_params"], 4 * status["lora_trainable_params"]  # float32
    if sync == "merged":
        assert published and min(published) >= model_bytes
        return
    # the adapter alone (its safetensors headers aside): here 29% of the tiny model, 3% of a ~85M one
    assert published and all(adapter_bytes <= b < 1.1 * adapter_bytes for b in published), published
    # RUN_DIR/hf: the adapter as PEFT writes one, over the base the run trained on
    peft = PeftConfig.from_pretrained(whole / "hf")
    lora = yaml.safe_load((whole / "config.yaml").read_text())["trainer"]["lora"]
    assert (peft.r, peft.lora_alpha) == (lora["rank"], lora["alpha"])
    assert sorted(peft.target_modules) == sorted(lora["target_modules"])
    assert not list((whole / "hf").glob("model*.safetensors"))
    # status.json counts the trainable parameters: the adapter's, a small share of the base's
    from safetensors.torch import load_file

    status = json.loads((whole / "status.json").read_text())
    adapter = sum(t.numel() for t in load_file(whole / "hf" / "adapter_model.safetensors").values())
    assert status["lora_trainable_params"] == adapter
    assert status["lora_trainable_share"] == pytest.approx(adapter / status["lora_base_params"])
    assert 0 < status["lora_trainable_share"] < 0.5
    for args, shows in ((["--verify"], "adapter_model.safetensors"), (["--merged", "--verify"], "config.json")):
        out = tmp_path / f"export{len(args)}"
        exported = tide("export", whole, out, *args, timeout=300)
        assert exported.returncode == 0, exported.stderr[-4000:]
        assert "verified" in exported.stdout and (out / shows).is_file(), exported.stdout
    resume_cut_back(whole, tmp_path / "cut", 2)
    assert_ends_as(tmp_path / "cut", whole)
