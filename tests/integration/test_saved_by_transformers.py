"""Model directories exactly as transformers writes them serve on tide's engines with transformers' log-probs, for
every family tide converts.

Each directory is what fine-tuning with transformers leaves: the family's own transformers config class with sizes
and the tokenizer's special tokens set and every other field at the class's default, `save_pretrained`, and a
tokenizer beside it. tide's own tiny models (trainer/tiny_model.py) also write fields transformers' config classes do
not define (DeepSeek-V3's topk_method and scoring_func), which vLLM reads with other defaults: a DeepSeek-V3 saved by
transformers 5.19 has none, and vLLM 0.32 then neither creates its e_score_correction_bias (the engine died at start,
KeyError 'layers.1.mlp.gate.e_score_correction_bias') nor scores with a sigmoid.

The session's engine actor (tests/integration/conftest.py's `engine`) serves the directories in turn, restarted onto
each: onto the directory as saved (the run's model.path, which engines start on: the fields the engine needs come as
hf_overrides), and for DeepSeek-V3 also onto its publish (config.json as tide's publish path writes it,
ckpt_transfer.writer.copy_aux_files). The weights stay the saved ones: the conversion tests check that a publish gives
them back."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import ray
import torch

from ckpt_transfer.manifest import Manifest, ShardRecord, TensorRecord
from rollout.tasks import AdditionTask

pytestmark = pytest.mark.slow
WEIGHTS = "model.safetensors"
TOL = 1e-4
# vLLM's CPU kernels: attention heads of 32 (64, 80, ...), DeepSeek's MLA latent 512 + 64 (its decode kernel's only
# width), gpt-oss expert widths in multiples of 32
_SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              max_position_embeddings=256, initializer_range=0.3)
FAMILIES = {
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    "llama3": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "mistral": ("MistralConfig", {}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 64}),
    "deepseek_v3": ("DeepseekV3Config", {"num_key_value_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 512,
                                         "qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 32,
                                         "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                         "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1}),
    "gpt_oss": ("GptOssConfig", {"intermediate_size": 64, "head_dim": 32, "num_local_experts": 4,
                                 "num_experts_per_tok": 2}),
}
# gpt-oss with a yarn rope given without beta_fast / beta_slow (transformers takes 32 and 1; vLLM's gpt-oss reads them
# without a default and died at start: KeyError 'beta_fast')
_OSS_YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "original_max_position_embeddings": 64}
VARIANTS = {"gpt_oss_yarn_no_betas": ("GptOssConfig", {**FAMILIES["gpt_oss"][1], "rope_parameters": _OSS_YARN})}
# what publishing adds to the saved config.json (nothing for the others)
ADDED = {"deepseek_v3": {"topk_method": "noaux_tc", "scoring_func": "sigmoid"},
         "gpt_oss_yarn_no_betas": {"rope_parameters": {**_OSS_YARN, "beta_fast": 32.0, "beta_slow": 1.0}}}


def _save(family: str, out: Path) -> Path:
    """`family`'s tiny model as transformers' save_pretrained writes it, with a tokenizer trained on the task."""
    import transformers
    from transformers import AutoModelForCausalLM

    from trainer.tiny_model import train_tokenizer

    tok = train_tokenizer(AdditionTask(1).corpus(), out)
    cls, fields = {**FAMILIES, **VARIANTS}[family]
    special = dict(bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    config = getattr(transformers, cls)(**{**_SIZES, **fields, **special, "vocab_size": -(-len(tok) // 64) * 64})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():  # a model after fine-tuning: the experts' correction bias moved from its zero init
        g = torch.Generator().manual_seed(1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.rand(buffer.shape, generator=g) * 0.5)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("saved-by-transformers")
    return {family: _save(family, root / family) for family in {**FAMILIES, **VARIANTS}}


def _manifest(directory: Path, run: str, iteration: int) -> Manifest:
    """The manifest of an iteration whose one shard is `directory`'s safetensors file, as is."""
    from safetensors.torch import load_file

    from ckpt_transfer.checksum import checksum_file

    tensors = tuple(TensorRecord(n, str(t.dtype).removeprefix("torch."), tuple(t.shape))
                    for n, t in load_file(str(directory / WEIGHTS)).items())
    shard = ShardRecord(file=WEIGHTS, node="local", nbytes=(directory / WEIGHTS).stat().st_size,
                        checksum=checksum_file(directory / WEIGHTS), tensors=tensors)
    aux = sorted(p.name for p in directory.iterdir() if p.suffix in (".json", ".jinja") and p.name != "manifest.json")
    return Manifest(run=run, iteration=iteration, directory=str(directory), shards=[shard], aux_files=aux)


def _published(src: Path, out: Path) -> Path:
    """`src` laid out as tide publishes an iteration: its weights, and the config and tokenizer files as the trainer
    ranks write them (copy_aux_files)."""
    from ckpt_transfer.writer import copy_aux_files

    out.mkdir(parents=True)
    shutil.copyfile(src / WEIGHTS, out / WEIGHTS)
    copy_aux_files(src, out)
    return out


def _reference(model_dir: Path, samples) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            lp = torch.log_softmax(model(torch.tensor([s.prompt_ids + s.completion_ids])).logits[0].float(), dim=-1)
            start = len(s.prompt_ids)
            out.append([lp[start + i - 1, t].item() for i, t in enumerate(s.completion_ids)])
    return out


CASES = [(f, "as saved") for f in {**FAMILIES, **VARIANTS}] + [(f, "published") for f in ADDED]


@pytest.mark.parametrize("family,form", CASES, ids=[f"{f}-{w.replace(' ', '-')}" for f, w in CASES])
def test_engine_serves_it_with_transformers_logprobs(engine, saved, tmp_path, family, form):
    directory = saved[family] if form == "as saved" else _published(saved[family], tmp_path / "published")
    iteration = list(CASES).index((family, form)) + 1
    ray.get(engine.sync.remote(_manifest(directory, f"saved-{family}", iteration), "restart"), timeout=600)
    problems = AdditionTask(1).problems(seed=0, iteration=0, n=4)
    samples = ray.get(engine.generate.remote(problems, 2, 6, 1.0, 0), timeout=600).items
    reference = _reference(saved[family], samples)
    gap = max(abs(a - b) for s, ref in zip(samples, reference) for a, b in zip(s.logprobs, ref))
    print(f"{family} {form}: max log-prob gap {gap:.2e} over {sum(len(s.logprobs) for s in samples)} tokens")
    assert gap <= TOL


def test_publish_adds_only_the_fields_the_engines_lack(saved, tmp_path):
    """The published config.json is the saved one, byte for byte, where vLLM computes what transformers does from it;
    DeepSeek-V3's gains the two routing fields transformers hard-codes, the gpt-oss rope its betas; the engine is
    told the same where it starts on the saved directory, and nothing about the publish."""
    from transformers import AutoConfig

    from ckpt_transfer.convert.engine_config import engine_overrides

    for family, src in saved.items():
        out = _published(src, tmp_path / family)
        raw, published = (json.loads((d / "config.json").read_text()) for d in (src, out))
        if family in ADDED:
            assert all(raw.get(k) != v for k, v in ADDED[family].items()), family  # as transformers wrote it
            assert published == {**raw, **ADDED[family]}, family
            assert engine_overrides(AutoConfig.from_pretrained(src)) == ADDED[family], family
        else:
            assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes(), family
        assert engine_overrides(AutoConfig.from_pretrained(out)) == {}, family
