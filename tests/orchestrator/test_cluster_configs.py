"""The GPU cluster examples (configs/cluster/) load as a user would start them (their data files in place), ask
for CUDA, NCCL and GPU memory as a share, and split the models they name the way the trainer and vLLM can: the
layout checks the trainer runs at start-up pass on those models' architectures (their config.json values), and
the ranks and engines fit the nodes the comments describe: placement.trainer_nodes nodes of trainer ranks, the
engines on one more."""
from pathlib import Path

import pytest
import yaml

from ckpt_transfer.convert import family
from orchestrator.config.schema import load_config
from trainer.megatron.model import check_layout

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs" / "cluster").glob("*.yaml"))

# The architectures of the models the configs name (from their Hugging Face config.json)
ARCHITECTURES = {
    "Qwen/Qwen2.5-7B-Instruct": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944,
                                     num_attention_heads=28, num_key_value_heads=4, num_hidden_layers=28,
                                     vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6),
    "Qwen/Qwen2.5-14B-Instruct": dict(model_type="qwen2", hidden_size=5120, intermediate_size=13824,
                                      num_attention_heads=40, num_key_value_heads=8, num_hidden_layers=48,
                                      vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6),
    "mistralai/Mixtral-8x7B-Instruct-v0.1": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336,
                                                 num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32,
                                                 vocab_size=32000, max_position_embeddings=32768, rope_theta=1e6,
                                                 num_local_experts=8, num_experts_per_tok=2),
    "Qwen/Qwen3-30B-A3B": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, head_dim=128,
                               moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4,
                               num_hidden_layers=48, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                               vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6),
}
GPUS_PER_NODE = 8
# GPU memory (GiB) of the nodes a config's comment names, where not an 80 GB GPU (H200: ~139 GiB usable)
GPU_MEMORY_GB = {"mixtral-8x7b-gsm8k.yaml": 139.0}


def test_there_are_a_dense_and_a_moe_example():
    assert {yaml.safe_load(p.read_text())["model"]["path"] for p in CONFIGS} == set(ARCHITECTURES)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_cluster_config_loads_and_fits_its_model(path, tmp_path):
    from transformers import AutoConfig

    raw = yaml.safe_load(path.read_text())
    # the data files the config names, relative to its directory, as the comment's command writes them
    data = tmp_path / raw["task"]["path"]
    data.parent.mkdir(parents=True)
    row = '{"messages": [{"role": "user", "content": "1+1?"}], "answer": "2"}\n'
    for name in ("path", "eval_path"):
        (tmp_path / raw["task"][name]).write_text(row)
    local = tmp_path / path.name
    local.write_text(path.read_text())
    cfg = load_config(local)
    t, r = cfg.trainer, cfg.rollout
    assert (t.device, t.backend, r.device, cfg.model.dtype) == ("cuda", "nccl", "cuda", "bfloat16")
    assert r.kv_cache_gb is None and 0 < r.gpu_memory_utilization < 1 and r.kv_cache_bytes is None
    assert r.engine_config(cfg.iterations).enforce_eager is False  # CUDA graphs on GPUs
    assert Path(cfg.task.path) == data  # relative to the config file
    arch = dict(ARCHITECTURES[cfg.model.path])
    hf = AutoConfig.for_model(arch.pop("model_type"), **arch)
    kwargs = dict(family(hf).megatron_transformer_kwargs(hf))
    p = t.parallel
    check_layout(kwargs, vocab_size=hf.vocab_size, tp=p.tp, pp=p.pp, ep=p.ep)  # raises LayoutError otherwise
    assert hf.num_key_value_heads % r.tp == 0 and hf.num_attention_heads % r.tp == 0  # vLLM's TP split
    nodes = cfg.placement.trainer_nodes  # each node's ranks publish into its shared memory
    assert p.world % nodes == 0 and p.world // nodes <= GPUS_PER_NODE
    engine_gpus = r.engines * r.tp
    assert engine_gpus <= GPUS_PER_NODE * (nodes + 1) - p.world
    if not cfg.transfer.enabled:  # engines read the trainer node's shared memory: one node for everything
        assert p.world + engine_gpus <= GPUS_PER_NODE
    else:
        assert cfg.transfer.mooncake.local_host == "auto"
    assert r.max_new_tokens + r.max_prompt_tokens <= hf.max_position_embeddings


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_the_memory_planner_fits_each_example_on_its_gpus(path, tmp_path):
    """`tide plan` on each example (its model's config.json written locally): every trainer rank and engine fits
    the GPUs its comment names (the LoRA example only with the base frozen: no gradients or Adam state of its own,
    and trainer.kl's reference the base itself)."""
    from transformers import AutoConfig

    from orchestrator.run.plan import plan

    raw = yaml.safe_load(path.read_text())
    row = '{"messages": [{"role": "user", "content": "1+1?"}], "answer": "2"}\n'
    for name in ("path", "eval_path"):
        (tmp_path / raw["task"][name]).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / raw["task"][name]).write_text(row)
    arch = dict(ARCHITECTURES[raw["model"]["path"]])
    AutoConfig.for_model(arch.pop("model_type"), **arch).save_pretrained(tmp_path / "model")
    (tmp_path / path.name).write_text(path.read_text())
    cfg = load_config(tmp_path / path.name)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(tmp_path / "model")})})
    report = plan(cfg, gpus_per_node=GPUS_PER_NODE, gpu_memory_gb=GPU_MEMORY_GB.get(path.name, 80.0))
    assert report.fits, (report.problems, report.rank, report.engine)
