"""A LoRA run end to end (configs/lora.yaml and configs/lora_moe.yaml through the Python API on the test session's
pooled ranks and engines; `tide export` through the CLI): the engines serve the trainer's adapted policy within the
log-prob gap bound every iteration, a KL term against the base (adapters off) is computed, RUN_DIR/hf is a PEFT
adapter over the base, `tide export` writes and verifies the adapter and the merged model, and a run resumed from
its checkpoint (adapters and optimizer state only) ends exactly as the uninterrupted one. The mixture-of-experts run
(expert parallelism 2, adapters on every expert, merged sync) also exports an adapter that PEFT loads onto
transformers' fused experts with Megatron's logits."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from tests.integration.run_helpers import ROOT, assert_ends_as, resume_cut_back, run_here, tide

pytestmark = pytest.mark.slow

FP32_GAP = 1e-5  # float32 engine and trainer log-probs of the same tokens: ~1e-7 apart (tests/integration/test_loop.py)


def _config(tmp: Path, address: str, config: str, iterations: int) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / config).read_text())
    if "path" in cfg["model"]:  # lora.yaml's pretrained base (test_learning.py makes it): its random model here
        cfg["model"] = yaml.safe_load((ROOT / "configs" / "lora_base.yaml").read_text())["model"]
    cfg.update(iterations=iterations, save_every=2, ray={"address": address})
    cfg["trainer"] |= {"warmup_sft_steps": 4, "warmup_sft_batch": 32, "kl": {"coef": 0.05}}
    cfg["rollout"] |= {"prompts_per_iteration": 8, "n_samples": 4, "kv_cache_gb": 0.125, "probe_prompts": 4}
    cfg["publish"]["shm_root"] = f"/dev/shm/tide-test-lora-{os.getpid()}"
    path = tmp / "lora.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


# (config, its sync, iterations): the dense model's adapter sync, and the MoE model's merged sync (every iteration
# restarts its engine: two iterations)
RUNS = {"adapter": ("lora.yaml", 3), "merged": ("lora_moe.yaml", 2)}


@pytest.mark.parametrize("sync", list(RUNS))
def test_lora_run_serves_exports_and_resumes_exactly(tmp_path, address, sync, worker_pools):
    """Both syncs serve the trainer's policy; the adapter sync moves only the adapter (its publish a few percent
    of the model's). The merged export and the resume are checked once (they do not depend on the sync)."""
    from peft import PeftConfig

    whole = tmp_path / "whole"
    config, iterations = RUNS[sync]
    run_here(worker_pools, _config(tmp_path, address, config, iterations), run_dir=whole)
    assert yaml.safe_load((whole / "config.yaml").read_text())["trainer"]["lora"]["sync"] == sync
    metrics = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == iterations
    for m in metrics:
        assert 0 < m["logprob_gap"] <= FP32_GAP, m
        assert m["kl_ref"] != 0, m  # the reference is the base: the adapters moved the policy off it
    published = [t["bytes"] for t in map(json.loads, (whole / "timings.jsonl").read_text().splitlines())
                 if t["phase"] == "publish"]
    assert [m["publish_bytes"] for m in metrics] == published[-len(metrics):]  # each iteration's, in its metrics
    status = json.loads((whole / "status.json").read_text())
    model_bytes, adapter_bytes = 4 * status["lora_base_params"], 4 * status["lora_trainable_params"]  # float32
    if sync == "merged":
        assert published and min(published) >= model_bytes
        # RUN_DIR/hf holds every expert's adapter; PEFT puts them on transformers' fused experts, and the logits
        # match Megatron's (`--verify`: float32 within 1e-4)
        from safetensors import safe_open

        with safe_open(str(whole / "hf" / "adapter_model.safetensors"), "pt") as f:
            experts = {k.split(".experts.")[1].split(".")[0] for k in f.keys() if ".experts." in k}
        assert experts == {"0", "1", "2", "3"}, experts
        exported = tide("export", whole, tmp_path / "export", "--verify", timeout=300)
        assert exported.returncode == 0, exported.stderr[-4000:]
        assert "verified" in exported.stdout, exported.stdout
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
    resume_cut_back(whole, tmp_path / "cut", 2, pools=worker_pools)
    assert_ends_as(tmp_path / "cut", whole)
