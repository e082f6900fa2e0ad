"""Each RL loss, estimator and schedule against values computed by hand."""
import math

import pytest
import torch

from trainer.losses import (LossSpec, advantages, aggregate, clipped_token_loss, kimi_sequence_loss, kimi_token_loss,
                            length_reward, loglinear_proximal, policy_loss)
from trainer.batch import TokenDistribution
from trainer.lr_schedule import LRSchedule, lr_at


def test_group_baseline_is_per_prompt_mean():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = advantages(LossSpec("kimi"), rewards, groups)
    assert torch.allclose(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0]))


def test_grpo_divides_by_group_std():
    rewards = torch.tensor([1.0, 0.0])
    adv = advantages(LossSpec("grpo", adv_std_norm=True), rewards, torch.tensor([0, 0]))
    # mean 0.5, population std 0.5
    assert torch.allclose(adv, torch.tensor([1.0, -1.0]), atol=1e-5)
    assert torch.allclose(advantages(LossSpec("grpo", adv_std_norm=False), rewards, torch.tensor([0, 0])),
                          torch.tensor([0.5, -0.5]))


def test_grpo_unbiased_std_is_trls():
    """trainer.adv_std: unbiased, adv_std_eps 1e-4: TRL's (r - mean) / (std(n - 1) + 1e-4), by hand."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 7.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2])
    adv = advantages(LossSpec("grpo", adv_std_norm=True, adv_std_unbiased=True, adv_std_eps=1e-4), rewards, groups)
    # group 0: mean 1/4, squared deviations 9/16 + 3 x 1/16 = 3/4, / (4 - 1): std 1/2; group 1 mirrored;
    # a group of one: advantage 0, not NaN
    half = 0.5 + 1e-4
    assert torch.allclose(adv, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75, 0.0]) / torch.tensor(
        [half] * 8 + [1.0]), atol=1e-7)
    population = advantages(LossSpec("grpo", adv_std_norm=True), rewards, groups)
    # population std sqrt(3/16) = 0.433: advantages sqrt(4/3) larger
    assert population[0].item() == pytest.approx(0.75 / (math.sqrt(3 / 16) + 1e-6), rel=1e-6)


def test_adv_std_config_reaches_the_loss_spec():
    from trainer.config import TrainerConfig

    spec = TrainerConfig(loss="grpo", adv_std="unbiased", adv_std_eps=1e-4).loss_spec()
    assert (spec.adv_std_norm, spec.adv_std_unbiased, spec.adv_std_eps) == (True, True, 1e-4)
    assert TrainerConfig(loss="grpo").loss_spec().adv_std_unbiased is False


def test_kimi_sequence_loss_by_hand():
    """Kimi k1.5: -(r - r_mean) log pi(y|x) + tau/2 (log pi(y|x) - log pi_old(y|x))^2, per completion."""
    logp = torch.tensor([[-1.0, -2.0, -9.0]])
    old = torch.tensor([[-1.5, -2.25, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third position is padding
    got = kimi_sequence_loss(logp, old, mask, torch.tensor([0.5]), tau=0.2)
    # log pi(y|x) = -3, log-ratio = 0.5 + 0.25 = 0.75: -(0.5)(-3) + 0.1 * 0.5625 = 1.55625
    assert got.tolist() == pytest.approx([1.55625])


def test_kimi_squares_the_sequence_log_ratio_not_each_token():
    """Two tokens whose log-ratios cancel: the paper's regulariser is 0, the per-token variant's is not."""
    logp = torch.tensor([[-1.0, -1.0]])
    old = torch.tensor([[-1.5, -0.5]])
    mask = torch.ones(1, 2)
    zero_adv = torch.tensor([0.0])
    assert kimi_sequence_loss(logp, old, mask, zero_adv, tau=1.0).item() == pytest.approx(0.0)
    assert (kimi_token_loss(logp, old, zero_adv, tau=1.0) * mask).sum().item() == pytest.approx(0.25)


def test_kimi_gradient_by_hand():
    logp = torch.tensor([[-1.0, -0.5]], requires_grad=True)
    kimi_sequence_loss(logp, torch.tensor([[-1.5, -0.5]]), torch.ones(1, 2), torch.tensor([2.0]), tau=0.4).backward()
    # d/dlogp_t [-2 (l1 + l2) + 0.2 (l1 + l2 - (-2))^2] = -2 + 0.4 * 0.5 = -1.8 for both tokens
    assert logp.grad.tolist() == [pytest.approx([-1.8, -1.8])]


def test_kimi_token_variant_by_hand():
    logp = torch.tensor([[-1.0, -2.0]])
    old = torch.tensor([[-1.5, -2.0]])
    got = kimi_token_loss(logp, old, torch.tensor([0.5]), tau=0.2)
    # -(0.5)(-1) + 0.1 * 0.25 = 0.525 ; -(0.5)(-2) + 0 = 1.0
    assert torch.allclose(got, torch.tensor([[0.525, 1.0]]))


def test_clipped_loss_by_hand():
    old = torch.tensor([[0.0, 0.0]])
    logp = torch.tensor([[math.log(1.5), math.log(0.5)]])
    pos = clipped_token_loss(logp, old, torch.tensor([1.0]), eps_low=0.2)
    neg = clipped_token_loss(logp, old, torch.tensor([-1.0]), eps_low=0.2)
    # A>0: min(1.5, 1.2) = 1.2 ; min(0.5, 0.8) = 0.5
    assert torch.allclose(pos, torch.tensor([[-1.2, -0.5]]))
    # A<0: min(-1.5, -1.2) = -1.5 ; min(-0.5, -0.8) = -0.8
    assert torch.allclose(neg, torch.tensor([[1.5, 0.8]]))


def test_clip_higher_by_hand():
    """DAPO's clip-higher: the ratio may rise to 1 + eps_high (0.28) for a positive advantage."""
    old = torch.tensor([[0.0, 0.0]])
    logp = torch.tensor([[math.log(1.5), math.log(0.5)]])
    pos = clipped_token_loss(logp, old, torch.tensor([1.0]), eps_low=0.2, eps_high=0.28)
    neg = clipped_token_loss(logp, old, torch.tensor([-1.0]), eps_low=0.2, eps_high=0.28)
    assert torch.allclose(pos, torch.tensor([[-1.28, -0.5]]))
    assert torch.allclose(neg, torch.tensor([[1.5, 0.8]]))  # A<0 clips at 1 - eps_low, unchanged


def test_aggregations_by_hand():
    """Two completions of 1 and 3 tokens with per-token losses [3] and [1, 1, 1]."""
    per_token = torch.tensor([[3.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    # token_mean (DAPO): (3 + 1 + 1 + 1) / 4 tokens
    assert aggregate(per_token, mask, "token_mean", 2, 4).item() == pytest.approx(6 / 4)
    # seq_mean_token_mean (GRPO): (3/1 + 3/3) / 2
    assert aggregate(per_token, mask, "seq_mean_token_mean", 2, 4).item() == pytest.approx(2.0)
    # seq_mean_token_sum (Dr. GRPO): (3 + 3) / 2
    assert aggregate(per_token, mask, "seq_mean_token_sum", 2, 4).item() == pytest.approx(3.0)


def test_micro_batch_parts_add_up_to_the_mini_batch_objective():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(6, 5, generator=g)
    old = logp + 0.1 * torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    mask[:, 0] = 1
    adv = torch.randn(6, generator=g)
    n_tokens = int(mask.sum())
    for spec in [LossSpec("kimi"), LossSpec("kimi_token"), LossSpec("grpo", agg="seq_mean_token_mean"),
                 LossSpec("grpo", agg="token_mean"), LossSpec("grpo", agg="seq_mean_token_sum")]:
        whole = policy_loss(spec, logp, old, mask, adv, 6, n_tokens)
        parts = sum(policy_loss(spec, logp[i:i + 2], old[i:i + 2], mask[i:i + 2], adv[i:i + 2], 6, n_tokens)
                    for i in (0, 2, 4))
        assert parts.item() == pytest.approx(whole.item(), rel=1e-6), spec


def test_length_reward_by_hand():
    lengths = torch.tensor([2, 4, 6, 3])
    correct = torch.tensor([True, True, False, True])
    groups = torch.tensor([0, 0, 0, 1])
    got = length_reward(lengths, correct, groups)
    # group 0: lam = 0.5 - (len-2)/4 -> 0.5, 0.0, -0.5 ; wrong gets min(0, lam); group 1 single length -> 0
    assert torch.allclose(got, torch.tensor([0.5, 0.0, -0.5, 0.0]))


def test_lr_schedule_by_hand():
    """transformers' schedules after tide's warm-up: the first decayed iteration at lr, min_lr reached one
    iteration after the last, so the last one still updates (it ran at min_lr, 0 by default, before)."""
    lin = LRSchedule(warmup_iterations=2, decay="linear", min_lr=0.1)
    # warm-up 1/2, 2/2; then progress (it - 3) / 4: 0, 0.25, 0.5, 0.75
    assert [lr_at(1.0, lin, it, 6) for it in range(1, 7)] == pytest.approx([0.5, 1.0, 1.0, 0.775, 0.55, 0.325])
    cos = LRSchedule(decay="cosine", min_lr=0.0)
    # progress (it - 1) / 4: 2 x 0.5 (1 + cos(pi x progress))
    assert [lr_at(2.0, cos, it, 4) for it in range(1, 5)] == pytest.approx(
        [2.0, 1 + math.cos(math.pi / 4), 1.0, 1 + math.cos(3 * math.pi / 4)])
    assert lr_at(1.0, LRSchedule(decay="linear"), 70, 70) == pytest.approx(1 / 70)  # the last update is not lost
    # transformers' own linear schedule with no warm-up, step s = iteration - 1: the same rates
    import torch
    from transformers import get_linear_schedule_with_warmup

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = get_linear_schedule_with_warmup(opt, 0, 5)
    theirs = []
    for _ in range(5):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert [lr_at(1.0, LRSchedule(decay="linear"), it, 5) for it in range(1, 6)] == pytest.approx(theirs)
    assert [lr_at(0.3, LRSchedule(), it, 5) for it in (1, 5)] == [0.3, 0.3]


def _expected_kl_loss_gradients(theta: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """The exact expected gradient of a KL estimator used as a loss: sum over every token y of pi(y) (sampling,
    not differentiated) times grad k(y), through trainer.losses.kl_estimate."""
    from trainer.losses import kl_estimate

    theta = theta.clone().requires_grad_(True)
    logp = theta.log_softmax(-1)
    vocab = torch.arange(theta.numel())
    per_token = kl_estimate(logp[vocab][None], ref_logp[vocab][None], estimator)[0]
    (per_token * logp.exp().detach()).sum().backward()
    return theta.grad


@pytest.mark.parametrize("estimator,divergence", [("k1", None), ("k2", "reverse"), ("k3", "forward")])
def test_kl_estimator_gradients_follow_the_named_divergence(estimator, divergence):
    """Tang & Munos 2025: as a loss on tokens sampled from pi, k1's expected gradient is 0, k2's is that of
    KL(pi || ref) and k3's that of KL(ref || pi), exactly, over a 6-token vocabulary; the divergences' own
    gradients by autograd, and checked by central finite differences."""
    torch.manual_seed(0)
    theta = torch.randn(6, dtype=torch.float64)
    ref_logp = (torch.randn(6, dtype=torch.float64) * 1.5).log_softmax(-1)

    def reverse(t):
        lp = t.log_softmax(-1)
        return (lp.exp() * (lp - ref_logp)).sum()

    def forward(t):
        return (ref_logp.exp() * (ref_logp - t.log_softmax(-1))).sum()

    got = _expected_kl_loss_gradients(theta, ref_logp, estimator)
    if divergence is None:
        assert got.abs().max().item() < 1e-12
        return
    fn = reverse if divergence == "reverse" else forward
    t = theta.clone().requires_grad_(True)
    fn(t).backward()
    torch.testing.assert_close(got, t.grad, rtol=1e-10, atol=1e-12)
    h = 1e-6
    finite = torch.stack([(fn(theta + h * e) - fn(theta - h * e)) / (2 * h) for e in torch.eye(6, dtype=torch.float64)])
    torch.testing.assert_close(got, finite, rtol=1e-6, atol=1e-8)
    other = forward if divergence == "reverse" else reverse  # and not the other divergence's
    t = theta.clone().requires_grad_(True)
    other(t).backward()
    assert (got - t.grad).abs().max().item() > 1e-3


def test_kl_under_top_p_compares_proper_distributions():
    """With top-p sampling the KL term's log-probs are those of the whole tempered vocabulary on both sides:
    the reference's values sum to 1 over the vocabulary (its own nucleus with the sampled token forced in, as
    tide computed it before, sums to more), KL(pi, pi) = 0 and the estimate grows as the policy leaves the
    reference."""
    from trainer.losses import kl_estimate
    from trainer.sampling import kl_distribution, token_logprobs

    torch.manual_seed(1)
    vocab = 12
    ref_logits = torch.randn(vocab) * 2
    sampled = TokenDistribution(temperature=0.7, top_p=0.5)
    kl_dist = kl_distribution(sampled)
    assert (kl_dist.temperature, kl_dist.top_p, kl_dist.top_k) == (0.7, 1.0, 0)

    def values(dist):  # the reference's probability of each token, had it been the one sampled
        labels = torch.arange(vocab)
        return token_logprobs(ref_logits.expand(vocab, vocab), labels, dist).exp()

    assert values(kl_dist).sum().item() == pytest.approx(1.0, abs=1e-6)
    assert values(sampled).sum().item() > 1.2  # the forced-in nucleus: no distribution

    def expected_kl(policy_logits):  # E_{y ~ pi}[k3] under the KL term's distribution: KL(pi || ref) exactly
        labels = torch.arange(vocab)
        pol = token_logprobs(policy_logits.expand(vocab, vocab), labels, kl_dist)
        ref = token_logprobs(ref_logits.expand(vocab, vocab), labels, kl_dist)
        return (kl_estimate(pol, ref, "k3") * pol.exp()).sum().item()

    assert expected_kl(ref_logits) == pytest.approx(0.0, abs=1e-7)
    drift = torch.randn(vocab)
    kls = [expected_kl(ref_logits + a * drift) for a in (0.0, 0.5, 1.0, 2.0)]
    assert all(b > a for a, b in zip(kls, kls[1:])), kls


def test_k1_as_a_loss_is_refused_with_a_hint():
    from pydantic import ValidationError

    from trainer.config import KLConfig

    with pytest.raises(ValidationError, match=r"k1 as a loss does not regularise.*use k3.*or k2"):
        KLConfig(coef=0.05, estimator="k1")
    assert KLConfig(coef=0.0, estimator="k1").estimator == "k1"  # no KL term: nothing to refuse
    KLConfig(coef=0.05, estimator="k2")


def test_kl_estimators_by_hand():
    """Schulman's k1, k2, k3 with r = log pi_ref - log pi."""
    from trainer.losses import kl_estimate

    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -2.0]])  # r = -0.5, 0
    assert kl_estimate(logp, ref, "k1").tolist() == [pytest.approx([0.5, 0.0])]
    assert kl_estimate(logp, ref, "k2").tolist() == [pytest.approx([0.125, 0.0])]
    assert kl_estimate(logp, ref, "k3").tolist() == [pytest.approx([math.exp(-0.5) - 1 + 0.5, 0.0])]


def test_kl_term_by_hand():
    """grpo token_mean: surrogate + coef * mean k1 over tokens; kimi: + coef * mean over completions of the
    completion's summed k1."""
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    old, mask, adv = logp.clone(), torch.tensor([[1.0, 1.0], [1.0, 0.0]]), torch.zeros(2)
    ref = logp - torch.tensor([[0.2, 0.4], [0.6, 9.0]])  # k1 = 0.2, 0.4, 0.6 (and 9 on padding)
    grpo = LossSpec("grpo", kl_coef=0.5, kl_estimator="k1")
    # zero advantages: the surrogate is 0; KL token mean (0.2 + 0.4 + 0.6) / 3 = 0.4
    assert policy_loss(grpo, logp, old, mask, adv, 2, 3, ref).item() == pytest.approx(0.5 * 0.4)
    kimi = LossSpec("kimi", kimi_tau=0.0, kl_coef=0.5, kl_estimator="k1")
    # per completion 0.6 and 0.6, mean 0.6
    assert policy_loss(kimi, logp, old, mask, adv, 2, 3, ref).item() == pytest.approx(0.5 * 0.6)
    with pytest.raises(ValueError, match="reference"):
        policy_loss(grpo, logp, old, mask, adv, 2, 3)


def test_kl_term_takes_the_policy_under_the_kl_distribution():
    """Under top-p the KL term reads `kl_logp` (the whole tempered vocabulary), the surrogate `logp` (the
    sampled, truncated distribution): k3 of kl_logp against ref, by hand, and its gradient reaches kl_logp only."""
    logp = torch.tensor([[-0.5, -0.25]], requires_grad=True)  # truncated: each kept token more likely
    kl_logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0]])  # r = -0.5, 0 against kl_logp
    mask, adv = torch.ones(1, 2), torch.zeros(1)
    spec = LossSpec("grpo", kl_coef=0.5, kl_estimator="k3")
    loss = policy_loss(spec, logp, logp.detach(), mask, adv, 1, 2, ref, kl_logp=kl_logp)
    # each token's term weighed by pi_KL(y) / pi_sampled(y) (kl_importance_weight): e^(-1 + 0.5) on the first,
    # whose k3 is the only one not 0
    assert loss.item() == pytest.approx(0.5 * math.exp(-0.5) * (math.exp(-0.5) - 1 + 0.5) / 2)
    loss.backward()
    assert logp.grad.abs().sum().item() == 0 and kl_logp.grad.abs().sum().item() > 0


def test_kl_ignores_placeholders_outside_the_mask():
    """A zero placeholder where log pi is very negative (padding) must not turn the loss into inf or NaN."""
    logp = torch.tensor([[-1.0, -200.0]], requires_grad=True)
    ref = torch.tensor([[-1.1, 0.0]])
    mask = torch.tensor([[1.0, 0.0]])
    spec = LossSpec("grpo", kl_coef=1.0, kl_estimator="k3")
    loss = policy_loss(spec, logp, logp.detach(), mask, torch.zeros(1), 1, 1, ref)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all()
    assert loss.item() == pytest.approx(math.exp(-0.1) - 1 + 0.1, rel=1e-5)


def test_tis_weighs_each_tokens_policy_gradient_by_hand():
    """grpo: each token's clipped term times w_t; kimi: -A sum_t w_t log pi_t, the regulariser unweighted."""
    logp = torch.tensor([[math.log(0.5), math.log(0.25)]], requires_grad=True)
    old = logp.detach().clone()
    mask, adv, w = torch.ones(1, 2), torch.tensor([1.0]), torch.tensor([[0.5, 2.0]])
    # ratio 1 on both tokens: per-token -A = -1, weighted -0.5 and -2.0, token mean -1.25
    grpo = policy_loss(LossSpec("grpo", agg="token_mean"), logp, old, mask, adv, 1, 2, is_weight=w)
    assert grpo.item() == pytest.approx(-1.25)
    grpo.backward()
    # d/dlogp_t of -A w_t ratio_t / 2 tokens = -w_t / 2 at ratio 1
    assert logp.grad.tolist() == [pytest.approx([-0.25, -1.0])]
    kimi = policy_loss(LossSpec("kimi", kimi_tau=1.0), logp, old - 0.5, mask, adv, 1, 2, is_weight=w)
    # -(0.5 ln 0.5 + 2 ln 0.25) + 1/2 (0.5 + 0.5)^2
    assert kimi.item() == pytest.approx(-(0.5 * math.log(0.5) + 2 * math.log(0.25)) + 0.5)
    token = policy_loss(LossSpec("kimi_token", kimi_tau=0.0), logp, old, mask, adv, 1, 2, is_weight=w)
    assert token.item() == pytest.approx(-(0.5 * math.log(0.5) + 2 * math.log(0.25)) / 2)
    # weights of 1 change nothing
    ones = torch.ones(1, 2)
    for spec in (LossSpec("grpo"), LossSpec("kimi"), LossSpec("kimi_token")):
        assert policy_loss(spec, logp, old - 0.1, mask, adv, 1, 2, is_weight=ones).item() == pytest.approx(
            policy_loss(spec, logp, old - 0.1, mask, adv, 1, 2).item())


def test_entropy_bonus_by_hand():
    """grpo token_mean: surrogate - coef * mean entropy over completion tokens (padding ignored); kimi: - coef *
    mean over completions of the completion's summed entropy; refused without the entropies."""
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    old, mask, adv = logp.clone(), torch.tensor([[1.0, 1.0], [1.0, 0.0]]), torch.zeros(2)
    ent = torch.tensor([[0.3, 0.6], [0.9, 50.0]])
    grpo = LossSpec("grpo", entropy_coef=0.1)
    assert policy_loss(grpo, logp, old, mask, adv, 2, 3, entropy=ent).item() == pytest.approx(-0.1 * 0.6)
    kimi = LossSpec("kimi", kimi_tau=0.0, entropy_coef=0.1)
    assert policy_loss(kimi, logp, old, mask, adv, 2, 3, entropy=ent).item() == pytest.approx(-0.1 * (0.9 + 0.9) / 2)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(grpo, logp, old, mask, adv, 2, 3)


def test_entropy_bonus_gradient_raises_the_policy_entropy():
    """Minimising the loss with only the entropy bonus (zero advantages) makes a peaked categorical flatter: the
    bonus's gradient follows +H, not -H."""
    from trainer.sampling import entropy

    logits = torch.tensor([[[3.0, 0.0, -1.0]]], requires_grad=True)
    label = torch.tensor([[0]])
    before = entropy(logits.detach()).item()
    spec = LossSpec("grpo", entropy_coef=1.0)
    for _ in range(20):
        logp = logits.log_softmax(-1).gather(-1, label.unsqueeze(-1)).squeeze(-1)
        loss = policy_loss(spec, logp, logp.detach(), torch.ones(1, 1), torch.zeros(1), 1, 1, entropy=entropy(logits))
        logits.grad = None
        loss.backward()
        with torch.no_grad():
            logits -= 0.5 * logits.grad
    assert entropy(logits.detach()).item() > before + 0.3


def test_clip_counts_by_hand():
    """TRL's clip_ratio/low and /high: tokens whose ratio left [1 - eps_low, 1 + eps_high] on the side where the
    clipped surrogate stops their gradient (low with a negative advantage, high with a positive one)."""
    from trainer.losses import clip_counts

    old = torch.zeros(2, 3)
    ratio = torch.tensor([[0.7, 1.0, 1.3], [0.7, 1.1, 1.3]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # sequence 0: positive advantage -> only 1.3 counts (high); sequence 1: negative -> only 0.7 counts (low);
    # sequence 1's 1.3 is padding
    low, high = clip_counts(ratio.log(), old, torch.tensor([1.0, -1.0]), mask, 0.2, 0.28)
    assert (low.item(), high.item()) == (1.0, 1.0)
    low, high = clip_counts(ratio.log(), old, torch.tensor([1.0, -1.0]), mask, 0.2, 0.35)  # 1.3 within 1 + 0.35
    assert (low.item(), high.item()) == (1.0, 0.0)


@pytest.mark.parametrize("spec", [LossSpec("kimi", kimi_tau=0.1), LossSpec("kimi_token", kimi_tau=0.1),
                                  LossSpec("grpo", agg="token_mean"), LossSpec("grpo", agg="seq_mean_token_mean"),
                                  LossSpec("grpo", agg="seq_mean_token_sum")],
                         ids=lambda s: f"{s.kind}-{s.agg}")
def test_inserted_tokens_add_nothing_to_the_loss_or_its_gradient(spec):
    """A multi-turn trajectory's inserted tokens (a tool's output: mask 0, behaviour log-prob 0.0, whatever the
    policy now gives them) leave the loss and every gradient as the same trajectory without them."""
    torch.manual_seed(0)
    sampled = torch.randn(2, 4) - 1.0
    old = (sampled + 0.1 * torch.randn(2, 4)).detach()
    adv = torch.tensor([1.5, -0.5])
    inserted = torch.tensor([[-30.0, -0.01, -7.0], [-2.0, -50.0, -0.3]])  # the policy's log-probs of the inserts

    def loss_and_grad(with_inserts: bool):
        logp = sampled.clone().requires_grad_(True)
        if with_inserts:  # two sampled turns with the inserted tokens between them
            full = torch.cat([logp[:, :2], inserted, logp[:, 2:]], dim=1)
            full_old = torch.cat([old[:, :2], torch.zeros(2, 3), old[:, 2:]], dim=1)
            mask = torch.tensor([[1.0, 1, 0, 0, 0, 1, 1]] * 2)
        else:
            full, full_old, mask = logp, old, torch.ones(2, 4)
        loss = policy_loss(spec, full, full_old, mask, adv, n_seqs=2, n_tokens=int(mask.sum()))
        loss.backward()
        return loss.detach(), logp.grad

    (a, ga), (b, gb) = loss_and_grad(False), loss_and_grad(True)
    # equal up to float32 summation order (Kimi's sums run over the zeros too)
    assert torch.allclose(a, b, rtol=1e-6, atol=0) and torch.allclose(ga, gb, rtol=1e-6, atol=0)
    assert ga.abs().sum() > 0


def test_loglinear_proximal_by_hand():
    """rollout.proximal loglinear: on the first mini-batch (no step taken since pi_prox) pi_prox is the current
    policy exactly; after k steps, log pi_b + d / (d + k) (log pi_theta - log pi_b); a token sampled by pi_prox
    itself (d = 0) keeps pi_b. The TIS weight is min(pi_prox / pi_b, cap); neither carries a gradient."""
    now = torch.tensor([[-1.0, -3.0, -2.0]], requires_grad=True)
    behaviour = torch.tensor([[-2.0, -2.5, -2.0]])
    behind = torch.tensor([[4.0, 4.0, 0.0]])
    prox, w = loglinear_proximal(now, behaviour, behind, 0, 2.0)
    assert prox.tolist() == [[-1.0, -3.0, -2.0]] and not prox.requires_grad and not w.requires_grad
    assert w.tolist() == [pytest.approx([2.0, math.exp(-0.5), 1.0])]  # e^1 capped at 2
    prox, w = loglinear_proximal(now, behaviour, behind, 4, 2.0)  # alpha 4 / 8 on the first two, 0 on the last
    assert prox.tolist() == [pytest.approx([-1.5, -2.75, -2.0])]
    assert w.tolist() == [pytest.approx([math.exp(0.5), math.exp(-0.25), 1.0])]
    # at k = 0 the clipped surrogate is the on-policy gradient, -A grad log pi weighted by w
    prox, w = loglinear_proximal(now, behaviour, behind, 0, 2.0)
    loss = policy_loss(LossSpec("grpo", agg="token_mean"), now, prox, torch.ones(1, 3), torch.tensor([1.0]), 1, 3,
                       is_weight=w)
    loss.backward()
    assert now.grad.tolist() == [pytest.approx([-2.0 / 3, -math.exp(-0.5) / 3, -1.0 / 3])]


def test_loglinear_proximal_takes_the_computed_proximal_policy_where_given():
    """Issue 58 item 6: a token sampled by pi_prox itself (d = 0: iteration 1, a token sampled in flight after the
    switch) on a later mini-batch gets alpha = 0 from the interpolation, so pi_prox would be the engine's and the
    TIS weight 1. Where the trainer computed pi_prox (its pre-update policy, `logp_prox`, `known`), that is pi_prox
    and the weight min(pi_prox / pi_b, cap), as lockstep's recomputed pi_old + tis gives; the rest interpolates."""
    now = torch.tensor([[-1.0, -3.0, -2.0]], requires_grad=True)
    behaviour = torch.tensor([[-2.0, -4.0, -2.5]])
    behind = torch.tensor([[4.0, 0.0, 0.0]])
    computed = torch.tensor([[0.0, -3.2, -2.9]])  # the first is not read (known False)
    known = torch.tensor([[False, True, True]])
    prox, w = loglinear_proximal(now, behaviour, behind, 4, 2.0, logp_prox=computed, known=known)
    # token 0: alpha 4 / 8, -2 + 0.5 x 1 = -1.5; tokens 1, 2: the computed values
    assert prox.tolist() == [pytest.approx([-1.5, -3.2, -2.9])]
    # e^0.5; e^(-3.2 + 4) = e^0.8 capped at 2; e^(-2.9 + 2.5)
    assert w.tolist() == [pytest.approx([math.exp(0.5), 2.0, math.exp(-0.4)])]
    assert not prox.requires_grad and not w.requires_grad
    # the clipped surrogate (eps 0.2) against it with A = -1: ratios e^0.5, e^0.2, e^0.9, all above 1.2, where a
    # negative advantage takes the unclipped term -r A w / 3 tokens, whose gradient in log pi is r w / 3
    loss = policy_loss(LossSpec("grpo", agg="token_mean"), now, prox, torch.ones(1, 3), torch.tensor([-1.0]), 1, 3,
                       is_weight=w)
    loss.backward()
    assert now.grad.tolist() == [pytest.approx([math.exp(0.5) * math.exp(0.5) / 3, math.exp(0.2) * 2.0 / 3,
                                                math.exp(0.9) * math.exp(-0.4) / 3])]
    # without computed values, the interpolation (d = 0: the engine's log-prob, weight 1), as before
    prox, w = loglinear_proximal(now, behaviour, behind, 4, 2.0)
    assert prox.tolist() == [pytest.approx([-1.5, -4.0, -2.5])]
    assert w.tolist() == [pytest.approx([math.exp(0.5), 1.0, 1.0])]


def _kl_setting(vocab: int, seed: int, temperature: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(vocab, generator=g, dtype=torch.float64)
    ref_logits = theta + torch.randn(vocab, generator=g, dtype=torch.float64)
    stale = theta + 0.7 * torch.randn(vocab, generator=g, dtype=torch.float64)  # the policy some steps ago
    return theta, ref_logits, stale


def _named_kl_gradient(theta: torch.Tensor, ref_logits: torch.Tensor, estimator: str, temperature: float):
    """The exact gradient of the divergence the estimator's gradient follows (Tang & Munos 2025), over the KL
    term's distribution (the whole tempered vocabulary): k2 -> KL(pi || ref), k3 -> KL(ref || pi)."""
    t = theta.clone().requires_grad_(True)
    lp, rl = (t / temperature).log_softmax(-1), (ref_logits / temperature).log_softmax(-1)
    kl = (lp.exp() * (lp - rl)).sum() if estimator == "k2" else (rl.exp() * (rl - lp)).sum()
    kl.backward()
    return t.grad


def _logp(logits: torch.Tensor, y: int, dist: TokenDistribution) -> torch.Tensor:
    """log p(y) under `dist` in the logits' own precision (float64 here; trainer.sampling computes in float32), the
    sampled token kept in a truncated set as sampling.processed_logits keeps it."""
    from trainer.sampling import truncate_logits

    z = logits / dist.temperature
    if dist.truncates:
        keep = torch.isfinite(truncate_logits(z.detach(), dist.top_k, dist.top_p))
        keep[y] = True
        z = z.masked_fill(~keep, float("-inf"))
    return z.log_softmax(-1)[y].reshape(1, 1)


def _expected_kl_term_gradient(theta, ref_logits, behaviour_logits, sampled: TokenDistribution, estimator: str,
                               old_logits=None, tis_cap: float = 1e9):
    """E over y ~ the behaviour's sampled distribution of the gradient of policy_loss's KL term on the one token y
    (zero advantage: the surrogate adds nothing), summed exactly over the vocabulary. Without `old_logits` the batch
    carries the behaviour's log-probs as pi_old (no correction); with them, pi_old is that policy's (recomputed by
    the trainer) and each token's is_weight min(pi_old / pi_b, tis_cap), as orchestrator/iteration/mismatch.py's tis."""
    from trainer.sampling import kl_distribution, truncate_logits

    kl_dist = kl_distribution(sampled)
    q = truncate_logits(behaviour_logits / sampled.temperature, sampled.top_k, sampled.top_p).softmax(-1)
    t = theta.clone().requires_grad_(True)
    spec = LossSpec("grpo", kl_coef=1.0, kl_estimator=estimator)
    total = torch.zeros((), dtype=torch.float64)
    for y in torch.nonzero(q > 0)[:, 0].tolist():
        behaviour = _logp(behaviour_logits, y, sampled)
        if old_logits is None:
            old, w = behaviour, None
        else:
            old = _logp(old_logits, y, sampled)
            w = torch.exp(torch.clamp(old - behaviour, max=math.log(tis_cap)))
        loss = policy_loss(spec, _logp(t, y, sampled), old, torch.ones(1, 1), torch.zeros(1, dtype=torch.float64), 1,
                           1, _logp(ref_logits, y, kl_dist), is_weight=w, kl_logp=_logp(t, y, kl_dist))
        total = total + q[y] * loss
    total.backward()
    return t.grad


def _unweighted_kl_gradient(theta, ref_logits, behaviour_logits, sampled: TokenDistribution, estimator: str):
    """The same expectation of the KL term as tide computed it before issue 58 (no importance weight)."""
    from trainer.losses import kl_estimate
    from trainer.sampling import truncate_logits

    q = truncate_logits(behaviour_logits / sampled.temperature, sampled.top_k, sampled.top_p).softmax(-1)
    t = theta.clone().requires_grad_(True)
    lp, ref = (t / sampled.temperature).log_softmax(-1), (ref_logits / sampled.temperature).log_softmax(-1)
    (q * kl_estimate(lp, ref, estimator)).sum().backward()
    return t.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_weighted_kl_term_follows_the_named_divergence_on_a_stale_batch(estimator, temperature):
    """Issue 58 item 8: on tokens a stale policy sampled (a batch drawn ahead, a later mini-batch), the KL term
    weighed by pi_theta / pi_behaviour (detached) has, exactly over a 7-token vocabulary, the expected gradient of
    the divergence it names (k2: KL(pi || ref), k3: KL(ref || pi)); unweighted it has not. Also through a mismatch
    correction: pi_old recomputed by the trainer and tis's min(pi_old / pi_b, cap), uncapped here."""
    theta, ref_logits, stale = _kl_setting(7, seed=3)
    dist = TokenDistribution(temperature=temperature)
    exact = _named_kl_gradient(theta, ref_logits, estimator, temperature)
    weighted = _expected_kl_term_gradient(theta, ref_logits, stale, dist, estimator)
    torch.testing.assert_close(weighted, exact, rtol=1e-9, atol=1e-12)
    old = stale + 0.3 * torch.randn(7, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    corrected = _expected_kl_term_gradient(theta, ref_logits, stale, dist, estimator, old_logits=old)
    torch.testing.assert_close(corrected, exact, rtol=1e-9, atol=1e-12)
    unweighted = _unweighted_kl_gradient(theta, ref_logits, stale, dist, estimator)
    assert (unweighted - exact).norm() > 0.05 * exact.norm()
    # on the policy's own samples the weight is 1: the same as before
    own = _expected_kl_term_gradient(theta, ref_logits, theta, dist, estimator)
    torch.testing.assert_close(own, _unweighted_kl_gradient(theta, ref_logits, theta, dist, estimator), rtol=1e-9,
                               atol=1e-12)


@pytest.mark.parametrize("behaviour", ["own", "stale"])
@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_weighted_kl_term_under_top_p_misses_only_the_unsampled_tail(estimator, behaviour):
    """Under top-p the tokens outside the behaviour's nucleus S are never sampled, so no weighting of the sampled
    ones recovers their part of the gradient. Weighed by pi_KL / pi_behaviour, the KL term's expected gradient is
    the named divergence's exact gradient less exactly that part, sum over y outside S of pi(y) grad k(y), written
    out by hand in the logits here (k2: grad_z k(y) = (log pi(y) - log ref(y)) (e_y - pi); k3: (1 - ref(y) / pi(y))
    (e_y - pi)); unweighted it is not (on the policy's own samples it is that, divided by the nucleus' mass)."""
    theta, ref_logits, stale = _kl_setting(8, seed=5)
    dist = TokenDistribution(top_p=0.7)
    behaviour_logits = theta if behaviour == "own" else stale
    from trainer.sampling import truncate_logits

    outside = ~torch.isfinite(truncate_logits(behaviour_logits, 0, 0.7))
    assert 0 < outside.sum() < 8
    lp, rl = theta.log_softmax(-1), ref_logits.log_softmax(-1)
    pi = lp.exp()
    a = (lp - rl) if estimator == "k2" else (1 - torch.exp(rl - lp))
    tail = sum(pi[y] * a[y] * (torch.eye(8, dtype=torch.float64)[y] - pi) for y in torch.nonzero(outside)[:, 0])
    exact = _named_kl_gradient(theta, ref_logits, estimator, 1.0)
    weighted = _expected_kl_term_gradient(theta, ref_logits, behaviour_logits, dist, estimator)
    torch.testing.assert_close(weighted, exact - tail, rtol=1e-9, atol=1e-12)
    unweighted = _unweighted_kl_gradient(theta, ref_logits, behaviour_logits, dist, estimator)
    assert (unweighted - (exact - tail)).norm() > 0.05 * exact.norm()
