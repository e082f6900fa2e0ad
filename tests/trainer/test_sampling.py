"""The trainer's token distribution is the one vLLM samples from: the same truncation as vLLM's own
top-k/top-p code, and log-probs renormalised over the kept tokens."""
import math

import pytest
import torch

from trainer.batch import TokenDistribution
from trainer.sampling import token_logprobs, truncate_logits


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (5, 1.0), (5, 0.7), (0, 0.3), (1, 1.0), (0, 0.999)])
def test_truncation_matches_vllm(top_k, top_p):
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    g = torch.Generator().manual_seed(top_k * 100 + int(top_p * 1000))
    logits = torch.randn(64, 97, generator=g) * 3
    logits[:8, :10] = 1.5  # ties
    k = torch.full((64,), top_k) if top_k > 0 else None
    p = torch.full((64,), top_p) if top_p < 1 else None
    theirs = apply_top_k_top_p_pytorch(logits.clone(), k, p)
    ours = truncate_logits(logits, top_k, top_p)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))
    assert torch.equal(ours[torch.isfinite(ours)], theirs[torch.isfinite(theirs)])


def test_logprobs_by_hand():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    label = torch.tensor([0])
    # temperature 0.5: softmax of [4, 2, 0, -2]
    z = torch.tensor([4.0, 2.0, 0.0, -2.0])
    want = z[0] - torch.logsumexp(z, 0)
    got = token_logprobs(logits, label, TokenDistribution(temperature=0.5))
    assert got.item() == pytest.approx(want.item(), abs=1e-6)
    # top_k 2: renormalised over the two largest, log(e^4 / (e^4 + e^2))
    got = token_logprobs(logits, label, TokenDistribution(temperature=0.5, top_k=2))
    assert got.item() == pytest.approx(4 - math.log(math.exp(4) + math.exp(2)), abs=1e-6)
    # top_p 0.5 at T=1: p = softmax([2,1,0,-1]) = [.644, .237, .087, .032]: the nucleus is token 0 alone
    got = token_logprobs(logits, label, TokenDistribution(top_p=0.5))
    assert got.item() == pytest.approx(0.0, abs=1e-6)


def test_sampled_token_is_never_impossible():
    """A token outside the trainer's nucleus (an edge case where trainer and engine logits differ in the last
    bits) keeps a finite log-prob: it is added to the kept set."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    got = token_logprobs(logits, torch.tensor([3]), TokenDistribution(top_p=0.5))
    assert math.isfinite(got.item())
    assert got.item() == pytest.approx(-1 - math.log(math.exp(2) + math.exp(-1)), abs=1e-6)


def test_gradient_flows_through_kept_tokens_only():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], requires_grad=True)
    token_logprobs(logits, torch.tensor([1]), TokenDistribution(top_k=2)).sum().backward()
    assert logits.grad[0, 2:].abs().sum().item() == 0.0
    assert logits.grad[0, :2].abs().sum().item() > 0.0
