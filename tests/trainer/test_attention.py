"""The trainer's SDPA core attention (trainer.attention sdpa, trainer/megatron/attention.py): the kernel against the
attention written out, and every family's logits against transformers' and Megatron's eager attention at a length
where the kernels work differently (the CPU flash kernel splits the keys into blocks with an online softmax; the
sliding window and the sinks take their own paths)."""
from __future__ import annotations

import pytest
import torch

from trainer.megatron.attention import attend, reference_attention

CASES = {  # heads, key/value groups, query/key width, value width, window, sink
    "mha": (4, 4, 16, 16, None, False),
    "gqa": (4, 2, 16, 16, None, False),
    "mla-narrow-values": (4, 4, 24, 16, None, False),
    "wide-values": (4, 2, 16, 24, None, False),
    "window": (4, 2, 16, 16, 8, False),
    "sinks": (4, 2, 16, 16, None, True),
    "window-and-sinks": (4, 1, 24, 16, 5, True),
    "window-over-the-length": (2, 2, 8, 8, 64, True),
}


@pytest.mark.parametrize("case", CASES)
def test_attend_equals_the_attention_written_out_in_values_and_gradients(case):
    heads, groups, d, dv, window, with_sink = CASES[case]
    torch.manual_seed(0)
    s, b = 37, 2
    q = torch.randn(s, b, heads, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(s, b, groups, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(s, b, groups, dv, dtype=torch.float64, requires_grad=True)
    sink = torch.randn(heads, dtype=torch.float64, requires_grad=True) if with_sink else None
    inputs = [q, k, v] + ([sink] if with_sink else [])
    got = attend(q.float(), k.float(), v.float(), scale=0.3, window=window,
                 sink=sink.float() if with_sink else None)
    want = reference_attention(q, k, v, scale=0.3, window=window, sink=sink)
    assert got.shape == (s, b, heads, dv)
    assert (got.double() - want).abs().max() <= 2e-6
    g = torch.randn_like(want)
    for a, e in zip(torch.autograd.grad((got.double() * g).sum(), inputs), torch.autograd.grad((want * g).sum(), inputs)):
        assert (a - e).abs().max() <= 5e-6


FAMILIES = ["qwen2", "qwen3", "llama3", "mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3"]
LENGTH = 700  # over the CPU flash kernel's key block (512): its online softmax combines blocks


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    from rollout.tasks import AdditionTask
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    built = {}

    def get(family: str):
        if family not in built:
            spec = TinyModelConfig(family=family, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=64,
                                   max_position_embeddings=1024, init_std=0.1)
            built[family] = build_tiny_model(tmp_path_factory.mktemp(family) / "model", AdditionTask(1).corpus(),
                                             spec)
        return built[family]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_gives_transformers_logits_on_sdpa_at_length(family_dir, family):
    """A 700-token sequence (and a short one beside it): SDPA's logits equal transformers' and Megatron's eager
    attention's in float32."""
    from transformers import AutoModelForCausalLM

    from tests.trainer.test_memory import one_rank
    from trainer.megatron.scoring import logits

    model_dir = family_dir(family)
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(3, 60, (LENGTH,), generator=gen).tolist(), torch.randint(3, 60, (9,), generator=gen).tolist()]
    got = {}
    for attention in ("sdpa", "eager"):
        with one_rank(model_dir, attention=attention, micro_batch_size=2) as rank:
            got[attention] = logits(rank, tokens)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for k, toks in enumerate(tokens):
        with torch.no_grad():
            want = hf(torch.tensor([toks])).logits[0]
        assert (got["sdpa"][k] - want).abs().max() <= 1e-5, "transformers"
        assert (got["sdpa"][k] - got["eager"][k]).abs().max() <= 1e-5, "eager"
