"""Each RL loss against values computed by hand."""
import math

import pytest
import torch

from trainer.losses import (LossSpec, advantages, clipped_token_loss, kimi_token_loss, length_reward,
                            policy_loss_sum)


def test_group_baseline_is_per_prompt_mean():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = advantages(LossSpec("kimi"), rewards, groups)
    assert torch.allclose(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0]))


def test_grpo_divides_by_group_std():
    rewards = torch.tensor([1.0, 0.0])
    adv = advantages(LossSpec("grpo"), rewards, torch.tensor([0, 0]))
    # mean 0.5, population std 0.5
    assert torch.allclose(adv, torch.tensor([1.0, -1.0]), atol=1e-5)


def test_kimi_token_loss_by_hand():
    logp = torch.tensor([[-1.0, -2.0]])
    old = torch.tensor([[-1.5, -2.0]])
    adv = torch.tensor([0.5])
    got = kimi_token_loss(logp, old, adv, tau=0.2)
    # -(0.5)(-1) + 0.1 * 0.25 = 0.525 ; -(0.5)(-2) + 0 = 1.0
    assert torch.allclose(got, torch.tensor([[0.525, 1.0]]))


def test_kimi_gradient_is_policy_gradient_plus_pull_to_rollout_policy():
    logp = torch.tensor([[-1.0]], requires_grad=True)
    kimi_token_loss(logp, torch.tensor([[-1.5]]), torch.tensor([2.0]), tau=0.4).sum().backward()
    # d/dlogp [-2 logp + 0.2 (logp + 1.5)^2] = -2 + 0.4 * 0.5 = -1.8
    assert logp.grad.item() == pytest.approx(-1.8)


def test_clipped_loss_by_hand():
    old = torch.tensor([[0.0, 0.0]])
    logp = torch.tensor([[math.log(1.5), math.log(0.5)]])
    pos = clipped_token_loss(logp, old, torch.tensor([1.0]), eps=0.2)
    neg = clipped_token_loss(logp, old, torch.tensor([-1.0]), eps=0.2)
    # A>0: min(1.5, 1.2) = 1.2 ; min(0.5, 0.8) = 0.5
    assert torch.allclose(pos, torch.tensor([[-1.2, -0.5]]))
    # A<0: min(-1.5, -1.2) = -1.5 ; min(-0.5, -0.8) = -0.8
    assert torch.allclose(neg, torch.tensor([[1.5, 0.8]]))


def test_policy_loss_sum_respects_mask():
    logp = torch.tensor([[-1.0, -5.0]])
    mask = torch.tensor([[1.0, 0.0]])
    got = policy_loss_sum(LossSpec("kimi", kimi_tau=0.0), logp, logp, mask, torch.tensor([1.0]))
    assert got.item() == pytest.approx(1.0)


def test_length_reward_by_hand():
    lengths = torch.tensor([2, 4, 6, 3])
    correct = torch.tensor([True, True, False, True])
    groups = torch.tensor([0, 0, 0, 1])
    got = length_reward(lengths, correct, groups)
    # group 0: lam = 0.5 - (len-2)/4 -> 0.5, 0.0, -0.5 ; wrong gets min(0, lam); group 1 single length -> 0
    assert torch.allclose(got, torch.tensor([0.5, 0.0, -0.5, 0.0]))
