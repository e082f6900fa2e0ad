"""Build a tiny Hugging Face model directory (Qwen2 architecture, random init) with a tokenizer trained
locally on a text corpus. Used when no `model.path` is configured: tests and the quickstart need a model and
this machine reaches no model hub. The directory is a normal HF checkpoint, loaded by the same code as a
real model."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

EOS = "<|endoftext|>"
# A minimal chat format for the tiny models, so that message prompts run through the real chat-template path;
# a turn ends with the end-of-sequence token.
TINY_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                      "{% if m['role'] == 'assistant' %}" + EOS + "{% endif %}{{ '\\n' }}{% endfor %}"
                      "{% if add_generation_prompt %}assistant: {% endif %}")
TINY_FORMAT_VERSION = 2  # part of the cache key: bump when the directory's contents change (2: chat template)


class TinyModelConfig(BaseModel):
    """Architecture of the locally built model (the YAML `model.tiny:` section, used when `model.path` is
    absent)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    architecture: Literal["qwen2", "mixtral"] = Field("qwen2", description="`qwen2` (dense) or `mixtral` "
                                                      "(mixture of experts).")
    num_experts: int = Field(4, gt=0, description="Experts per MoE layer (mixtral only).")
    experts_per_token: int = Field(2, gt=0, description="Experts each token is routed to (mixtral only).")
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
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2Config

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
    if spec.architecture == "qwen2":
        config = Qwen2Config(**common)
    elif spec.architecture == "mixtral":
        config = MixtralConfig(**common, num_local_experts=spec.num_experts,
                               num_experts_per_tok=spec.experts_per_token, router_aux_loss_coef=0.0)
    else:
        raise ValueError(f"unknown tiny architecture {spec.architecture!r} (qwen2 or mixtral)")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / ".tide-tiny").write_text(key)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir
