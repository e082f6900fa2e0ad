"""trainer/memory_plan.py and rollout/memory_plan.py against figures worked out by hand (docs/training.md,
"Memory planner"), and the parameter count against transformers' models of every family."""
from __future__ import annotations

import glob
from dataclasses import replace
import math
from pathlib import Path

import pytest
import yaml

from rollout.memory_plan import CUDA_ENGINE_BASELINE, engine_memory
from trainer.memory_plan import (CPU_ALLOCATOR_OVERHEAD, CPU_RANK_BASELINE, GiB, ModelShape, TrainerLayout,
                                 activation_bytes, logits_bytes, lora_parameters, rank_memory, rank_parameters)

ROOT = Path(__file__).resolve().parents[2]
# 2 layers, hidden 8, 2 heads of 4 (no GQA), a gated MLP of 16, vocabulary 32
SMALL = ModelShape(layers=2, hidden=8, ffn=16, heads=2, kv_heads=2, head_dim=4, vocab=32)
TWO_ROWS_OF_FOUR = TrainerLayout(rows=2, seq_len=4, dtype="float32", attention="eager")


def test_quickstart_parameters_by_hand():
    # qwen2, hidden 64, 2 layers, 2 heads of 32, 1 KV head, MLP 128, vocabulary 320, untied:
    # per layer q 64x64 + k, v 64x32 each + their biases 64 + 64 + o 64x64 + 2 norms 64 + MLP 3 x 64 x 128
    layer = 4096 + 2 * 2048 + 128 + 4096 + 2 * 64 + 3 * 64 * 128
    quickstart = ModelShape(layers=2, hidden=64, ffn=128, heads=2, kv_heads=1, head_dim=32, vocab=320, qkv_bias=True)
    assert quickstart.parameters() == 2 * layer + 2 * 320 * 64 + 64 == 115264


def test_activations_by_hand():
    # per token and layer, outside the core attention: 5h 40 + q, k, v 24 + rotated q, k 16 + the projection's
    # input 8 + the gated MLP's 5f 80 = 168 elements; the core attention: its output 8 and, eager, 2 heads x 4
    # positions of probabilities (16 in all), sdpa a float32 log-sum-exp per head (10); 8 tokens, float32
    rest = 168 * 8
    eager_core, sdpa_core = 16 * 8, 10 * 8
    scores_grads = 2 * 2 * 4 * 8  # one layer's backward: the gradients of scores and probabilities
    mask = 2 * 4 * 4  # a boolean [s, s] per layer
    assert activation_bytes(SMALL, TWO_ROWS_OF_FOUR, "none") == \
        (2 * (rest + eager_core) + scores_grads) * 4 + mask == 12320
    # selective: no layer keeps its core attention's; one layer's come back in its backward
    assert activation_bytes(SMALL, TWO_ROWS_OF_FOUR, "selective") == \
        (2 * rest + eager_core + scores_grads) * 4 + mask == 11808
    # full: each layer's input (h per token) plus one layer's whole activations, recomputed
    assert activation_bytes(SMALL, TWO_ROWS_OF_FOUR, "full") == \
        (2 * 8 * 8 + rest + eager_core + scores_grads) * 4 + mask == 6944
    sdpa = TrainerLayout(rows=2, seq_len=4, dtype="float32", attention="sdpa")
    assert activation_bytes(SMALL, sdpa) == 2 * (rest + sdpa_core) * 4 == 11392


def test_activations_match_the_saved_tensors_counted():
    # scripts/validate_plan.py's 34M qwen2 at 512 positions: torch.autograd.graph.saved_tensors_hooks counted
    # 263 MiB of distinct storages saved by a train step's forward with sdpa, 329 MiB eager (both with the rotary
    # tables', the embedding's and the loss's few MiB). Korthikanti's count without dropout (16 sbh + a s^2 b
    # elements per layer) would say 8 x 512 x (16 x 512 + 8 x 512) x 4 B = 192 MiB eager: their 4h GeLU MLP keeps
    # 8h where tide's gated one keeps 5f = 20h, and Megatron's local layers keep the fused qkv output beside the
    # rotated q and k
    shape = ModelShape(layers=8, hidden=512, ffn=2048, heads=8, kv_heads=8, head_dim=64, vocab=320, qkv_bias=True)
    sdpa = activation_bytes(shape, TrainerLayout(rows=1, seq_len=512, attention="sdpa"))
    eager = activation_bytes(shape, TrainerLayout(rows=1, seq_len=512, attention="eager"))
    one_backward, masks = 2 * 8 * 512 * 512 * 4, 8 * 512 * 512
    assert sdpa / 2**20 == pytest.approx(256.125)
    assert (eager - one_backward - masks) / 2**20 == pytest.approx(320)


def test_the_first_pipeline_stage_holds_pp_micro_batches():
    # pp 2: half the layers, the activations of 2 micro-batches in flight (1F1B): as many as all layers of one
    sdpa = TrainerLayout(rows=2, seq_len=4, attention="sdpa")
    assert activation_bytes(SMALL, TrainerLayout(rows=2, seq_len=4, attention="sdpa", pp=2)) == \
        activation_bytes(SMALL, sdpa) == 11392


def test_tensor_parallel_splits_all_but_the_replicated_inputs():
    # Korthikanti eq. 2 (no sequence parallelism): the 5h of norm inputs and outputs stay whole on every rank
    tp2 = TrainerLayout(rows=2, seq_len=4, dtype="float32", attention="eager", tp=2)
    per_token = 40 + (24 + 16 + 8 + 80) / 2 + (8 / 2 + 1 * 4)
    assert activation_bytes(SMALL, tp2) == (2 * per_token * 8 + 2 * 1 * 4 * 8) * 4 + 2 * 16
    sequence_parallel = TrainerLayout(rows=2, seq_len=4, dtype="float32", attention="eager", tp=2,
                                      sequence_parallel=True)
    per_token -= 20
    assert activation_bytes(SMALL, sequence_parallel) == (2 * per_token * 8 + 2 * 1 * 4 * 8) * 4 + 2 * 16


def test_logits_and_logprob_chunk():
    # the output layer's logits (and their gradient) and 3 float32 tensors per position, for one chunk of
    # positions (here all 8: the default chunk is larger), vocabulary 32
    assert logits_bytes(SMALL, TWO_ROWS_OF_FOUR) == (2 * 8 * 32 * 4, 8 * 32 * 4 * 3)
    chunked = TrainerLayout(rows=2, seq_len=4, logprob_chunk=2)
    assert logits_bytes(SMALL, chunked) == (2 * 2 * 32 * 4, 2 * 32 * 4 * 3)
    unchunked = TrainerLayout(rows=2, seq_len=4, logprob_chunk=None, dtype="bfloat16")
    assert logits_bytes(SMALL, unchunked) == (2 * 8 * 32 * 2, 8 * 32 * 4 * 3)


def test_weights_gradients_and_adam():
    params = SMALL.parameters()
    fp32 = rank_memory(SMALL, TrainerLayout(rows=1, seq_len=4))
    assert (fp32.weights, fp32.gradients, fp32.optimizer) == (4 * params, 4 * params, 8 * params)
    assert fp32.baseline == CPU_RANK_BASELINE
    assert fp32.allocator == math.ceil(CPU_ALLOCATOR_OVERHEAD * fp32.tensors)  # cpu: glibc's heap beside them
    # bf16: 2-byte weights, float32 gradients (grad_reduce_in_fp32), 12 bytes of Adam (two moments and the main
    # parameters), halved over dp 2 by the distributed optimizer; a reference model is a second copy of the weights
    bf16 = rank_memory(SMALL, TrainerLayout(rows=1, seq_len=4, dtype="bfloat16", dp=2, distributed_optimizer=True,
                                            reference=True, device="cuda"))
    assert (bf16.weights, bf16.gradients, bf16.optimizer) == (2 * 2 * params, 4 * params, 6 * params)
    assert bf16.allocator == 0 and bf16.total == (bf16.baseline + bf16.weights + bf16.gradients + bf16.optimizer
                                                  + bf16.activations + bf16.logits + bf16.logprob_chunk)


LORA_ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_lora_adapters_by_hand():
    # rank 2 adapters hold 2 x (input + output) per projection: q, k, v, o 2 x (8 + 8) = 32 each, gate and up
    # 2 x (8 + 16) = 48 each, down 2 x (16 + 8) = 48: 272 per layer, 544 for the two
    lora = TrainerLayout(rows=2, seq_len=4, lora_rank=2, lora_targets=LORA_ALL)
    assert lora_parameters(SMALL, lora) == 2 * (4 * 32 + 3 * 48) == 544
    # tp 2 splits the column-parallel outputs (q, k, v, gate, up: B's rows) and the row-parallel inputs (o, down:
    # A's columns): q, k, v, o 2 x (8 + 4) = 24, gate, up 2 x (8 + 8) = 32, down 2 x (8 + 8) = 32
    assert lora_parameters(SMALL, replace(lora, tp=2)) == 2 * (4 * 24 + 3 * 32) == 384
    assert lora_parameters(SMALL, replace(lora, pp=2)) == 272  # a stage's layer
    # every routed expert of both MoE layers gets its own: 2 layers x 4 experts x 3 x 2 x (8 + 8), half per EP rank;
    # Mixtral's names for the same projections count alike, and only experts when no dense MLP is left
    moe = ModelShape(layers=2, hidden=8, ffn=16, heads=2, kv_heads=2, head_dim=4, vocab=32, experts=4, moe_layers=2,
                     moe_ffn=8, top_k=2)
    for names in (("gate_proj", "up_proj", "down_proj"), ("w1", "w2", "w3")):
        assert lora_parameters(moe, replace(lora, lora_targets=names)) == 2 * 4 * 3 * 32 == 768
        assert lora_parameters(moe, replace(lora, lora_targets=names, ep=2)) == 384
    # o_proj on both layers whole (64) beside w1 of the rank's 2 experts of each layer (2 x 2 x 32)
    assert lora_parameters(moe, replace(lora, lora_targets=("o_proj", "w1"), ep=2)) == 64 + 128
    with pytest.raises(ValueError, match=r"\['gate_up_proj'\]"):
        lora_parameters(moe, replace(lora, lora_targets=("gate_up_proj",)))


def test_lora_trains_the_adapters_alone_over_a_frozen_base():
    """The base keeps its weights only: gradients and Adam's state are the adapters', and trainer.kl's reference
    is the base with the adapters off (no copy)."""
    params = rank_parameters(SMALL, TWO_ROWS_OF_FOUR)
    for dtype, adam in (("float32", 8), ("bfloat16", 12)):
        lora = TrainerLayout(rows=2, seq_len=4, dtype=dtype, reference=True, lora_rank=2, lora_targets=LORA_ALL)
        m = rank_memory(SMALL, lora)
        width = 4 if dtype == "float32" else 2
        assert (m.weights, m.gradients, m.optimizer) == ((params + 544) * width, 544 * 4, 544 * adam)
        full = rank_memory(SMALL, replace(lora, lora_rank=0))
        assert (full.weights, full.gradients) == (2 * params * width, params * 4)  # the reference's copy


def test_parameters_split_over_tp_pp_and_ep():
    moe = ModelShape(layers=2, hidden=8, ffn=16, heads=2, kv_heads=2, head_dim=4, vocab=32, experts=4,
                     moe_layers=2, moe_ffn=8, top_k=2)
    experts = 2 * 4 * 3 * 8 * 8
    dense = moe.parameters() - experts
    assert rank_parameters(moe, TrainerLayout(rows=1, seq_len=1, ep=2)) == dense + experts // 2
    assert rank_parameters(moe, TrainerLayout(rows=1, seq_len=1, tp=2)) == (dense + experts) // 2


def test_engine_kv_cache_by_hand():
    e = engine_memory(parameters=1000, kv_elements_per_token=64, dtype_bytes=2, tp=2, concurrency=4, seq_tokens=10,
                      kv_cache_bytes=None, device="cuda", gpu_bytes=10 * GiB, gpu_memory_utilization=0.5)
    assert (e.weights, e.kv_bytes_per_token, e.kv_needed) == (1000, 64, 4 * 10 * 64)
    assert e.kv_cache == 5 * GiB - 1000 - CUDA_ENGINE_BASELINE
    cpu = engine_memory(parameters=1000, kv_elements_per_token=64, dtype_bytes=4, tp=1, concurrency=4,
                        seq_tokens=10, kv_cache_bytes=3 * 2560, device="cpu")
    # 64 float32 elements per token: 2560 bytes per sequence of 10 tokens; the cache holds 3 of the 4
    assert (cpu.kv_needed, cpu.sequences_cached, cpu.kv_cache) == (4 * 2560, 3, 3 * 2560)
    # adapter slots (trainer.lora sync adapter): 300 parameters in bf16 over tp 2, taken from the cache vLLM sizes
    lora = engine_memory(parameters=1000, kv_elements_per_token=64, dtype_bytes=2, tp=2, concurrency=4, seq_tokens=10,
                         kv_cache_bytes=None, device="cuda", gpu_bytes=10 * GiB, gpu_memory_utilization=0.5,
                         lora_parameters=300)
    assert lora.lora == 300 and lora.kv_cache == e.kv_cache - 300 and lora.total == e.total


def test_an_adapter_serving_engine_plans_its_adapter_slots():
    """`tide plan` of configs/lora.yaml (sync adapter, on cpu): the engine holds max_loras + max_cpu_loras slots of
    the adapter at vLLM's slot rank (rollout/lora_serving.py: 1 + 2 of rank 16) on the quickstart model's seven
    projections: per layer q 16 x (64 + 64), k and v 16 x (64 + 32), o 16 x (64 + 64), gate and up 16 x (64 + 128),
    down 16 x (128 + 64), float32; a merged sync holds none."""
    from orchestrator.config.schema import load_config
    from orchestrator.run.plan import engine_plan, model_shape

    per_layer = 16 * (128 + 2 * 96 + 128 + 3 * 192)
    # its base (runs/lora_base/hf, made by configs/lora_base.yaml) has lora_base.yaml's shape: planned from that
    base_model = yaml.safe_load((ROOT / "configs" / "lora_base.yaml").read_text())["model"]
    cfg = load_config(ROOT / "configs" / "lora.yaml", {"model.path": None, "model.tiny": base_model["tiny"]})
    shape, _ = model_shape(cfg)
    engine = engine_plan(cfg, shape, 64, None)
    assert engine.lora == 3 * 2 * per_layer * 4 == 393216
    assert engine.total == engine.baseline + engine.weights + engine.lora + engine.kv_cache
    merged = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={
        "lora": cfg.trainer.lora.model_copy(update={"sync": "merged"})})})
    assert engine_plan(merged, shape, 64, None).lora == 0


@pytest.mark.parametrize("config", sorted(glob.glob(str(ROOT / "configs/models/*.yaml"))) +
                         [str(ROOT / "configs/moe_ep2.yaml")], ids=lambda p: Path(p).stem)
def test_parameters_equal_transformers(config):
    """The count from the trainer's architecture (megatron_transformer_kwargs) equals the HF model's, for every
    family a config ships."""
    import torch
    from transformers import AutoModelForCausalLM

    from ckpt_transfer.convert import family
    from trainer.tiny_model import TinyModelConfig, _hf_config

    tiny = TinyModelConfig(**yaml.safe_load(Path(config).read_text())["model"]["tiny"])
    hf = _hf_config(tiny, dict(vocab_size=320, hidden_size=tiny.hidden_size, intermediate_size=tiny.intermediate_size,
                               num_hidden_layers=tiny.num_layers, num_attention_heads=tiny.num_heads,
                               num_key_value_heads=tiny.num_kv_heads, head_dim=tiny.hidden_size // tiny.num_heads,
                               max_position_embeddings=tiny.max_position_embeddings, rms_norm_eps=1e-6,
                               tie_word_embeddings=tiny.tie_word_embeddings, rope_theta=10000.0))
    shape = ModelShape.from_megatron(family(hf).megatron_transformer_kwargs(hf), hf.vocab_size,
                                     hf.tie_word_embeddings)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    assert shape.parameters() == sum(p.numel() for p in model.parameters())
