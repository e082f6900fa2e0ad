"""Build a tiny Hugging Face model directory (one of the supported families, random init) with a tokenizer
trained locally on a text corpus. Used when no `model.path` is configured: tests and the quickstart need a model and
this machine reaches no model hub. The directory is a normal HF checkpoint, loaded by the same code as a
real model."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from ckpt_transfer.config import StrictModel

EOS = "<|endoftext|>"
# A minimal chat format for the tiny models, so that message prompts run through the real chat-template path;
# a turn ends with the end-of-sequence token.
TINY_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                      "{% if m['role'] == 'assistant' %}" + EOS + "{% endif %}{{ '\\n' }}{% endfor %}"
                      "{% if add_generation_prompt %}assistant: {% endif %}")
# part of the cache key: bump when the directory's contents change (2: chat template; 3: deepseek_v3 with yarn)
TINY_FORMAT_VERSION = 3
TinyFamily = Literal["qwen2", "qwen3", "qwen3_moe", "llama3", "deepseek_v3", "mixtral", "gpt_oss"]


class TinyModelConfig(StrictModel):
    """Architecture of the locally built model (the YAML `model.tiny:` section, used when `model.path` is
    absent)."""

    model_config = ConfigDict(frozen=True)

    family: TinyFamily = Field("qwen2", description="Architecture family: `qwen2`, `qwen3` (q/k RMSNorm), `llama3` "
                               "(Llama 3.x with llama3 rope scaling), or mixture of experts: `qwen3_moe`, `mixtral`, "
                               "`deepseek_v3` (multi-latent attention, shared experts, group-limited sigmoid "
                               "routing), `gpt_oss` (attention sinks, alternating sliding windows, biased experts "
                               "with a clamped SwiGLU).")
    num_experts: int = Field(4, gt=0, description="Routed experts per MoE layer (MoE families only).")
    experts_per_token: int = Field(2, gt=0, description="Experts each token is routed to (MoE families only).")
    hidden_size: int = Field(64, gt=0, description="Model width. vLLM's CPU attention needs hidden_size / "
                             "num_heads to be 32, 64, 80, ...")
    num_layers: int = Field(2, gt=0, description="Transformer layers.")
    num_heads: int = Field(4, gt=0, description="Attention heads.")
    num_kv_heads: int = Field(2, gt=0, description="Key/value heads (grouped-query attention when fewer than "
                              "num_heads).")
    intermediate_size: int = Field(128, gt=0, description="Width of the MLP (of each expert, for mixtral).")
    max_position_embeddings: int = Field(256, gt=0, description="Longest sequence (prompt + completion) in "
                                         "tokens the model supports.")
    tie_word_embeddings: bool = Field(False, description="Share the input embedding's weights with the output "
                                      "layer.")
    init_std: float = Field(0.02, gt=0, description="Standard deviation of the random initial weights.")
    vocab_multiple: int = Field(64, gt=0, description="The vocabulary is padded to a multiple of this, so that "
                                "any tensor-parallel degree dividing it divides the vocabulary.")

    @model_validator(mode="before")
    @classmethod
    def _old_key(cls, data):
        # `architecture` was this field's name before the families beyond qwen2/mixtral (run dirs still hold it)
        if isinstance(data, dict) and "architecture" in data and "family" not in data:
            data = {("family" if k == "architecture" else k): v for k, v in data.items()}
        return data


def train_tokenizer(corpus: str, out_dir: Path, vocab_size: int = 256):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    # Digits one per token and no merges across punctuation: arithmetic stays learnable for a tiny model.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, bos_token=None)
    fast.chat_template = TINY_CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def build_tiny_model(out_dir: str | Path, corpus: str, spec: TinyModelConfig = TinyModelConfig(),
                     seed: int = 0) -> Path:
    """Create (or reuse, when the same spec, corpus and seed were built before) a tiny HF model directory
    whose weights are drawn with `seed`."""
    import torch
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    key = hashlib.sha256(json.dumps([spec.model_dump(), corpus, seed, TINY_FORMAT_VERSION]).encode()).hexdigest()[:16]
    stamp = out_dir / ".tide-tiny"
    if stamp.exists() and stamp.read_text() == key:
        return out_dir
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    tok = train_tokenizer(corpus, tmp)
    vocab = -(-len(tok) // spec.vocab_multiple) * spec.vocab_multiple
    common = dict(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=spec.init_std,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
        torch_dtype="float32",
    )
    config = _hf_config(spec, common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.save_pretrained(tmp, safe_serialization=True)
    if spec.family in ("llama3", "deepseek_v3", "gpt_oss"):
        _as_released_rope(tmp / "config.json")
    (tmp / ".tide-tiny").write_text(key)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def _hf_config(spec: TinyModelConfig, common: dict):
    """The transformers config of `spec.family` with the shared sizes in `common`."""
    from transformers import LlamaConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    moe = dict(num_experts_per_tok=spec.experts_per_token)
    if spec.family == "qwen2":
        return Qwen2Config(**common)
    if spec.family == "qwen3":
        return Qwen3Config(**common)
    if spec.family == "llama3":
        # Llama 3.2's rope scaling, with the original context shrunk so that it acts within a tiny model's
        # positions (at 8192 it would only touch frequencies no short sequence resolves)
        rope = dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=64)
        return LlamaConfig(**{**common, "rope_theta": None}, rope_parameters=rope)
    if spec.family == "mixtral":
        return MixtralConfig(**common, **moe, num_local_experts=spec.num_experts, router_aux_loss_coef=0.0)
    if spec.family == "qwen3_moe":
        return Qwen3MoeConfig(**common, **moe, num_experts=spec.num_experts, moe_intermediate_size=spec.intermediate_size,
                              norm_topk_prob=True, router_aux_loss_coef=0.0)
    if spec.family == "deepseek_v3":
        return _deepseek_v3_config(spec, common)
    if spec.family == "gpt_oss":
        return _gpt_oss_config(spec, common)
    raise ValueError(f"unknown tiny family {spec.family!r}")


def _deepseek_v3_config(spec: TinyModelConfig, common: dict):
    """DeepSeek-V3 in miniature: multi-latent attention, a dense first layer, shared + routed experts with
    group-limited sigmoid routing (noaux_tc: the e_score_correction_bias picks the experts), routed weights scaled
    by routed_scaling_factor, interleaved rope. The latent sizes are DeepSeek-V3's own (kv_lora_rank 512 +
    qk_rope_head_dim 64): vLLM's CPU MLA decode kernel is only built for a 576-wide latent cache. No
    multi-token-prediction layer."""
    from transformers import DeepseekV3Config

    head = spec.hidden_size // spec.num_heads
    kw = {k: v for k, v in common.items() if k not in ("head_dim", "num_key_value_heads")}
    return DeepseekV3Config(**kw, num_key_value_heads=spec.num_heads, q_lora_rank=spec.hidden_size // 2,
                            kv_lora_rank=512, qk_nope_head_dim=head, qk_rope_head_dim=64, v_head_dim=head,
                            n_routed_experts=spec.num_experts, n_shared_experts=1,
                            num_experts_per_tok=spec.experts_per_token, moe_intermediate_size=spec.intermediate_size,
                            n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                            norm_topk_prob=True, rope_interleave=True, topk_method="noaux_tc", scoring_func="sigmoid",
                            num_nextn_predict_layers=0, rope_parameters=_DEEPSEEK_YARN)


def _gpt_oss_config(spec: TinyModelConfig, common: dict):
    """gpt-oss in miniature: attention sinks, sliding-window and full attention layers alternating (sliding
    first, as released), q/k/v/o, router and expert biases, the clamped SwiGLU (alpha 1.702, limit 7), top-k
    routing softmaxed over the chosen experts, yarn rope. The window is shrunk from the released 128 positions to
    4, so that it acts on the quickstart task's sequences (6 or 7 tokens). The expert biases start at zero as
    transformers initialises them (training moves them: the conversion tests compare after steps)."""
    from transformers import GptOssConfig

    layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec.num_layers)]
    return GptOssConfig(**{**common, "rope_theta": None, "rms_norm_eps": 1e-5}, num_local_experts=spec.num_experts,
                        num_experts_per_tok=spec.experts_per_token, sliding_window=4, layer_types=layer_types,
                        attention_bias=True, swiglu_limit=7.0, router_aux_loss_coef=0.0,
                        rope_parameters=_GPT_OSS_YARN)


# gpt-oss's released yarn (factor 32 over 4096 original positions, truncate false), shrunk to 64 original positions
# and factor 4 (256 / 64) as _DEEPSEEK_YARN
_GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                 "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}


# DeepSeek-V3's released yarn (there: factor 40 over 4096 positions; mscale = mscale_all_dim = 1, so the softmax
# scale grows by mscale(factor)^2), shrunk to 64 original positions, factor 4 (256 / 64), so that the interpolation
# acts on short sequences
_DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                  "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def _as_released_rope(config_json: Path) -> None:
    """Write the rope settings as the released Llama 3.x and DeepSeek-V3 config.json files hold them (`rope_theta`
    and `rope_scaling`), not as transformers 5 saves them (`rope_parameters`): the path a user's downloaded model
    takes."""
    config = json.loads(config_json.read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    config_json.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
