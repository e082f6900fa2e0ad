"""LoRA on the Megatron trainer (trainer.lora, trainer/megatron/lora.py): a new adapter leaves the model's outputs
bit for bit; training moves only the adapters; the reference of trainer.kl is the base; the merged publish and the
PEFT adapter directory both give Megatron's logits in transformers; tensor- and pipeline-parallel layouts train as
one rank does and publish the same adapter."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from ckpt_transfer.manifest import Manifest
from rollout.tasks import AdditionTask
from trainer.batch import TrainBatch, TrainSequence
from trainer.config import KLConfig, LoRAConfig, ParallelConfig, TrainerConfig, TrainerSpec

pytestmark = pytest.mark.slow

LORA = LoRAConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    # two key/value heads: TP 2 gives each rank one query group; 4 layers: PP 2 gives each stage two
    spec = TinyModelConfig(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96, num_layers=4,
                           init_std=0.1)
    return build_tiny_model(tmp_path_factory.mktemp("lora") / "model", AdditionTask(1).corpus(), spec)


@pytest.fixture(scope="module")
def seqs(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [TrainSequence(tok(p).input_ids, tok(a).input_ids + [tok.eos_token_id])
            for p, a in AdditionTask(1).sft_examples(0, 16)]


def _group(rank_pool, model_dir, lora=LORA, tp=1, pp=1, **trainer):
    from orchestrator.workers.trainer_group import TrainerGroup

    cfg = TrainerConfig(parallel=ParallelConfig(tp=tp, pp=pp), lora=lora, micro_batch_size=8, **trainer)
    return TrainerGroup(TrainerSpec(hf_dir=str(model_dir), trainer=cfg), pool=rank_pool)


def _train(group, seqs, steps=3):
    return [group.train_step(TrainBatch(seqs), mode="sft", lr=2e-2)["loss"] for _ in range(steps)]


def _logprobs(group, seqs, reference=False):
    return torch.tensor([x for lp in group.logprobs(TrainBatch(seqs), reference=reference) for x in lp])


def test_adapters_start_as_the_base_train_alone_and_the_base_is_the_reference(rank_pool, model_dir, seqs,
                                                                             tmp_path):
    base = _group(rank_pool, model_dir, lora=None)
    try:
        base_logp = _logprobs(base, seqs)
    finally:
        base.shutdown()
    group = _group(rank_pool, model_dir, kl=KLConfig(coef=0.1))
    try:
        assert torch.equal(_logprobs(group, seqs), base_logp)  # B = 0: the adapters add exactly nothing
        before = group.publish("lora", 0, str(tmp_path / "before"), shard_bytes=1 << 20)
        losses = _train(group, seqs)
        assert losses[-1] < losses[0]
        trained = _logprobs(group, seqs)
        assert (trained - base_logp).abs().max() > 1e-3
        assert torch.equal(_logprobs(group, seqs, reference=True), base_logp)  # the reference: adapters off
        merged = group.publish("lora", 1, str(tmp_path / "merged"), shard_bytes=1 << 20)
        adapter = group.publish("lora", 1, str(tmp_path / "adapter"), shard_bytes=1 << 20, adapter=True)
        tokens = [s.prompt_ids + s.completion_ids for s in seqs[:4]]
        megatron_logits = group.logits(tokens)
    finally:
        group.shutdown()
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from ckpt_transfer.peft_adapter import adapter_config, write_peft_adapter

    # the publish before any step is the base, bit for bit
    original = load_file(next(Path(model_dir).glob("*.safetensors")))
    published = {k: v for f in sorted(Path(before.directory).glob("*.safetensors")) for k, v in load_file(f).items()}
    assert published.keys() == original.keys() and all(torch.equal(published[k], original[k]) for k in original)
    # merged: transformers on the published weights gives Megatron's logits
    hf = AutoModelForCausalLM.from_pretrained(merged.directory, dtype=torch.float32)
    _assert_logits(hf, tokens, megatron_logits)
    # the adapter as a PEFT directory on the base gives them too
    from peft import PeftModel

    peft_dir = write_peft_adapter(Manifest.load(adapter.directory), tmp_path / "peft",
                                  adapter_config(rank=LORA.rank, alpha=LORA.alpha, dropout=0.0,
                                                 target_modules=LORA.target_modules, base_model=str(model_dir)))
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                           peft_dir)
    _assert_logits(peft_model, tokens, megatron_logits)
    n_adapters = sum(1 for n in load_file(peft_dir / "adapter_model.safetensors"))
    assert n_adapters == 2 * 7 * 4  # A and B of 7 projections in 4 layers


def _assert_logits(model, tokens, reference):
    for toks, ref in zip(tokens, reference):
        with torch.no_grad():
            got = model(torch.tensor([toks])).logits[0]
        assert (got - ref).abs().max().item() <= 1e-4


@pytest.fixture(scope="module")
def trained_on_one_rank(rank_pool, model_dir, seqs, tmp_path_factory):
    """Two steps on one rank, checkpointed; its published adapter; then a third step's statistics and adapter."""
    from ckpt_transfer.reslice import merged_tensors

    tmp = tmp_path_factory.mktemp("one-rank")
    group = _group(rank_pool, model_dir)
    try:
        start = merged_tensors(group.publish("lora", 0, str(tmp / "0"), shard_bytes=1 << 20, adapter=True))
        _train(group, seqs, steps=2)
        group.save_checkpoint(str(tmp / "ckpt"))
        saved = merged_tensors(group.publish("lora", 2, str(tmp / "2"), shard_bytes=1 << 20, adapter=True))
        step = group.train_step(TrainBatch(seqs), mode="sft", lr=2e-2)
        after = merged_tensors(group.publish("lora", 3, str(tmp / "3"), shard_bytes=1 << 20, adapter=True))
        return {"start": start, "ckpt": tmp / "ckpt", "saved": saved, "step": step, "after": after,
                "logprobs": _logprobs(group, seqs)}
    finally:
        group.shutdown()


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_a_parallel_layout_holds_and_trains_the_adapter_one_rank_does(rank_pool, model_dir, seqs, tmp_path,
                                                                     trained_on_one_rank, tp, pp):
    """A new adapter is the same in every layout, bit for bit (initialised whole from its name, then sliced); the
    one-rank checkpoint resharded into TP 2 or PP 2 publishes the one-rank adapter bit for bit; a step from there
    has the one-rank step's loss and gradient norm (every shard counted once) and gives its adapter, to float32
    rounding (the ranks sum in another order)."""
    from ckpt_transfer.reslice import merged_tensors

    one = trained_on_one_rank
    group = _group(rank_pool, model_dir, tp=tp, pp=pp)
    try:
        start = merged_tensors(group.publish("lora", 0, str(tmp_path / "0"), shard_bytes=1 << 20, adapter=True))
        group.load_checkpoint(str(one["ckpt"]))
        saved = group.publish("lora", 2, str(tmp_path / "2"), shard_bytes=1 << 20, adapter=True)
        step = group.train_step(TrainBatch(seqs), mode="sft", lr=2e-2)
        after = merged_tensors(group.publish("lora", 3, str(tmp_path / "3"), shard_bytes=1 << 20, adapter=True))
        logprobs = _logprobs(group, seqs)
        counted = group.adapter_parameters()  # the ranks' own counts of what they write, summed
    finally:
        group.shutdown()
    assert counted == sum(t.numel() for t in after.values())
    _assert_equal(start, one["start"])
    _assert_equal(merged_tensors(saved), one["saved"])
    assert any(not torch.equal(one["saved"][k], one["start"][k]) for k in one["start"])  # it trained
    assert step["loss"] == pytest.approx(one["step"]["loss"], rel=1e-6)
    assert step["grad_norm"] == pytest.approx(one["step"]["grad_norm"], rel=1e-5)
    assert all(torch.allclose(after[k], one["after"][k], rtol=0, atol=1e-6) for k in after)
    assert (logprobs - one["logprobs"]).abs().max() <= 1e-5
    if tp > 1:  # a published adapter missing a tensor-parallel shard is refused, by name
        from ckpt_transfer.peft_adapter import adapter_config, write_peft_adapter
        from ckpt_transfer.reslice import ResliceError

        dropped = dataclasses.replace(saved, shards=[s for s in saved.shards if "-tp01-" not in s.file])
        with pytest.raises(ResliceError, match=r"lora_[AB]\.weight: TP shards \[1\] of 2 are missing"):
            write_peft_adapter(dropped, tmp_path / "peft", adapter_config(
                rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj"], base_model=str(model_dir)))


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_checkpoint_holds_the_adapters_and_resumes_only_onto_its_base(rank_pool, model_dir, trained_on_one_rank,
                                                                        tmp_path):
    """The checkpoint holds the adapters and their optimizer state, not the base (named by digest in layout.json);
    loading it onto another base is refused, naming both."""
    import json

    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    from torch.distributed.checkpoint import FileSystemReader

    ckpt = trained_on_one_rank["ckpt"]
    saved = FileSystemReader(str(ckpt / "megatron")).read_metadata().state_dict_metadata
    tensors = {k: math.prod(v.size) for k, v in saved.items() if hasattr(v, "size")}
    model = {k for k in tensors if not k.startswith("optimizer.")}
    assert model and all("_lora." in k for k in model), sorted(model)[:5]
    adapter_elements = sum(tensors[k] for k in model)
    # per layer, A [4, in] and B [out, 4] of q and o (64 -> 64), k and v (64 -> 32), gate and up (64 -> 96), down
    per_layer = 2 * (4 * 64 + 64 * 4) + 2 * (4 * 64 + 32 * 4) + 2 * (4 * 64 + 96 * 4) + (4 * 96 + 64 * 4)
    assert adapter_elements == 4 * per_layer
    assert sum(tensors.values()) - adapter_elements == 2 * adapter_elements  # Adam's two moments, nothing more
    record = json.loads((ckpt / "layout.json").read_text())["lora"]
    assert record["rank"] == 4 and len(record["base_digest"]) == 64
    other = build_tiny_model(tmp_path / "other", AdditionTask(1).corpus(),
                             TinyModelConfig(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96,
                                             num_layers=4, init_std=0.1), seed=1)
    group = _group(rank_pool, other)
    try:
        with pytest.raises(Exception, match=r"adapters trained on the base .* the model directory .*other.* differs"):
            group.load_checkpoint(str(ckpt))
    finally:
        group.shutdown()


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    spec = TinyModelConfig(family="qwen3_moe", hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=64,
                           num_layers=2, num_experts=4, experts_per_token=2, init_std=0.1)
    return build_tiny_model(tmp_path_factory.mktemp("lora-moe") / "model", AdditionTask(1).corpus(), spec)


def _moe_group(rank_pool, moe_dir, ep):
    from orchestrator.workers.trainer_group import TrainerGroup

    cfg = TrainerConfig(parallel=ParallelConfig(ep=ep), lora=LORA, micro_batch_size=8)
    return TrainerGroup(TrainerSpec(hf_dir=str(moe_dir), trainer=cfg), pool=rank_pool)


def test_expert_parallel_ranks_hold_and_train_the_experts_adapters_one_rank_does(rank_pool, moe_dir, seqs,
                                                                                   tmp_path):
    """Every expert gets its own adapter (PEFT's names: experts.<e>.gate_proj, ...); under EP 2 each rank holds
    its experts' and publishes them once (an expert's replicas do not both write it). Both layouts start from the
    same adapter, bit for bit; a step gives the one-rank step's loss, gradient norm and adapter (to float32
    rounding: the data-parallel halves sum in another order); the one-rank model trained further, loaded into EP 2
    (its parameters: megatron-core does not reshard a mixture-of-experts optimizer), publishes its adapter bit for
    bit."""
    from ckpt_transfer.reslice import merged_tensors

    def publish(group, tag):
        return group.publish("lora", 0, str(tmp_path / tag), shard_bytes=1 << 20, adapter=True)

    def step(group):
        return group.train_step(TrainBatch(seqs), mode="sft", lr=2e-2)

    one = _moe_group(rank_pool, moe_dir, ep=1)
    try:
        one_start = merged_tensors(publish(one, "one-start"))
        one_step = step(one)
        one_after = merged_tensors(publish(one, "one-after"))
        step(one)
        one.save_checkpoint(str(tmp_path / "ckpt"))
        one_saved = merged_tensors(publish(one, "one-saved"))
    finally:
        one.shutdown()
    experts = {k for k in one_start if ".experts." in k}
    # A and B of gate, up and down for 4 experts in 2 layers; the attention's four projections beside them
    assert len(experts) == 2 * 3 * 4 * 2 and len(one_start) == len(experts) + 2 * 4 * 2
    assert any(not torch.equal(one_saved[k], one_start[k]) for k in experts)  # the experts' adapters trained
    two = _moe_group(rank_pool, moe_dir, ep=2)
    try:
        start = publish(two, "two-start")
        two_step = step(two)
        after = merged_tensors(publish(two, "two-after"))
        two.load_model(str(tmp_path / "ckpt"))
        saved = merged_tensors(publish(two, "two-saved"))
        counted = two.adapter_parameters()  # each expert's adapter counted by the one replica that writes it
    finally:
        two.shutdown()
    assert counted == sum(t.numel() for t in one_start.values())
    names = [t.name for s in start.shards for t in s.tensors]
    assert len(names) == len(set(names))  # each tensor written by one replica
    _assert_equal(merged_tensors(start), one_start)
    assert two_step["loss"] == pytest.approx(one_step["loss"], rel=1e-6)
    assert two_step["grad_norm"] == pytest.approx(one_step["grad_norm"], rel=1e-5)
    assert after.keys() == one_after.keys()
    worst = max(after, key=lambda k: (after[k] - one_after[k]).abs().max().item())
    # Adam's first step is lr g / (|g| + eps): where an expert saw few tokens, g nears eps and its float32 rounding
    # shows at ~1e-4 of lr (8e-5 measured); a gradient of the wrong scale shows in the norm above
    assert (after[worst] - one_after[worst]).abs().max().item() <= 5e-4 * 2e-2, worst
    _assert_equal(saved, one_saved)


def test_gpt_oss_adapts_its_attention_and_refuses_its_stacked_experts_by_name(rank_pool, seqs, tmp_path_factory,
                                                                              tmp_path):
    """gpt_oss's checkpoint stacks each layer's experts in one tensor (mlp.experts.gate_up_proj, down_proj): there
    is no expert projection for a PEFT adapter to name, and targeting the MLP projections is refused by name before
    any step; its attention projections take adapters, train, and the merged publish (experts as they were) gives
    Megatron's logits in transformers."""
    from transformers import AutoModelForCausalLM

    from orchestrator.workers.trainer_group import TrainerGroup
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    spec = TinyModelConfig(family="gpt_oss", hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=64,
                           num_layers=2, num_experts=4, experts_per_token=2, init_std=0.1)
    model_dir = build_tiny_model(tmp_path_factory.mktemp("lora-gpt-oss") / "model", AdditionTask(1).corpus(), spec)

    def group(lora):
        cfg = TrainerConfig(lora=lora, micro_batch_size=8)
        return TrainerGroup(TrainerSpec(hf_dir=str(model_dir), trainer=cfg), pool=rank_pool)

    with pytest.raises(Exception, match=r"target_modules \['down_proj', 'gate_proj', 'up_proj'\]: LoRA on gpt_oss's "
                                        r"experts is not implemented .* target its attention projections"):
        group(LORA)
    attention = LoRAConfig(rank=4, alpha=8.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    trained = group(attention)
    try:
        losses = _train(trained, seqs)
        assert losses[-1] < losses[0]
        names = sorted(trained.adapter())
        merged = trained.publish("lora", 1, str(tmp_path / "merged"), shard_bytes=1 << 20)
        tokens = [s.prompt_ids + s.completion_ids for s in seqs[:4]]
        megatron_logits = trained.logits(tokens)
    finally:
        trained.shutdown()
    assert len(names) == 2 * 4 * 2 and all(".self_attn." in n for n in names), names  # A, B; 4 projections; 2 layers
    _assert_logits(AutoModelForCausalLM.from_pretrained(merged.directory, dtype=torch.float32), tokens,
                   megatron_logits)
