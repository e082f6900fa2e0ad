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


def test_entropy_by_hand():
    from trainer.sampling import entropy, processed_logits

    # uniform over 4 tokens: log 4; p = (1/4, 3/4): -(1/4 log 1/4 + 3/4 log 3/4)
    assert entropy(torch.zeros(4)).item() == pytest.approx(math.log(4), abs=1e-6)
    two = torch.tensor([0.0, math.log(3)])
    assert entropy(two).item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-6)
    # the processed distribution: temperature 0.5 of [0, log 3] is (1/10, 9/10); top_k 2 of [1, 1, 0, 0] with
    # the sampled token 3 forced into the set keeps tokens 0, 1 and 3: p = (e, e, 1) / (2e + 1)
    z = processed_logits(torch.tensor([[0.0, math.log(3)]]), torch.tensor([0]), TokenDistribution(temperature=0.5))
    assert entropy(z).item() == pytest.approx(-(0.1 * math.log(0.1) + 0.9 * math.log(0.9)), abs=1e-6)
    logits = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    z = processed_logits(logits, torch.tensor([3]), TokenDistribution(top_k=2))
    assert entropy(z).item() == pytest.approx(-(2 * (math.e / (2 * math.e + 1)) * math.log(math.e / (2 * math.e + 1))
                                                + (1 / (2 * math.e + 1)) * math.log(1 / (2 * math.e + 1))),
                                              abs=1e-6)
    # top_k 1: a single token, no uncertainty
    z = processed_logits(torch.tensor([[3.0, 1.0, 0.0]]), torch.tensor([0]), TokenDistribution(top_k=1))
    assert entropy(z).item() == pytest.approx(0.0, abs=1e-6)


def test_entropy_gradient_is_finite_and_raises_entropy():
    """The entropy bonus's gradient: finite with tokens cut off by top-k (no 0 x inf), zero for the cut tokens,
    and a small step along it raises the entropy (it is d H / d z, checked against finite differences)."""
    from trainer.sampling import entropy, processed_logits

    logits = torch.tensor([[2.0, 0.5, -0.3, -4.0]], requires_grad=True)
    dist = TokenDistribution(top_k=3)
    h = entropy(processed_logits(logits, torch.tensor([0]), dist))
    h.sum().backward()
    grad = logits.grad.clone()
    assert torch.isfinite(grad).all() and grad[0, 3].item() == 0.0
    for i in range(3):
        bumped = logits.detach().clone()
        bumped[0, i] += 1e-3
        numeric = (entropy(processed_logits(bumped, torch.tensor([0]), dist)) - h.detach()) / 1e-3
        assert grad[0, i].item() == pytest.approx(numeric.item(), abs=1e-3)
    stepped = logits.detach() + 0.1 * grad
    assert entropy(processed_logits(stepped, torch.tensor([0]), dist)).item() > h.item()


def test_vocabulary_shards_give_the_whole_entropy():
    """Tensor parallelism: the partial sums of each vocabulary shard, added up, give the entropy of the whole
    vocabulary (what the trainer all-reduces across TP ranks)."""
    from trainer.sampling import entropy, entropy_from_partials, entropy_partials

    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 5, 16, generator=g) * 4
    m = z.max(-1).values
    parts = [entropy_partials(shard, m) for shard in z.split(8, dim=-1)]
    got = entropy_from_partials(m, sum(p[0] for p in parts), sum(p[1] for p in parts))
    torch.testing.assert_close(got, entropy(z), atol=1e-5, rtol=1e-5)


def test_the_entropy_metric_in_pieces_equals_the_whole(monkeypatch):
    """The trainer computes the entropy metric a few positions at a time (vocabulary-wide temporaries): the
    pieces give the same values, in order, without a gradient."""
    from trainer.megatron import logprobs
    from trainer.sampling import entropy

    monkeypatch.setattr(logprobs, "ENTROPY_CHUNK", 3)
    z = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(1), requires_grad=True)
    got = logprobs.position_entropy(z, "metric", entropy)
    assert got.shape == (2, 5) and not got.requires_grad
    torch.testing.assert_close(got, entropy(z.detach()))
    assert logprobs.position_entropy(z, "grad", entropy).requires_grad
    assert logprobs.position_entropy(z, "no", entropy) is None
