"""The losses push the policy the right way: a softmax policy over 6 answers, trained on-policy with each loss
through the same sampling, advantages and optimizer steps as the trainer, raises the probability of the
rewarded answer; the same run with the reward's sign flipped lowers it. A sign error anywhere between reward
and gradient fails this."""
import pytest
import torch

from trainer.losses import LossSpec, advantages, policy_loss

SPECS = [LossSpec("kimi", kimi_tau=0.1), LossSpec("kimi_token", kimi_tau=0.1),
         LossSpec("grpo", adv_std_norm=True, agg="token_mean"),
         LossSpec("grpo", adv_std_norm=False, agg="seq_mean_token_sum", clip_eps_high=0.28)]


def _train(spec: LossSpec, sign: float, steps: int = 60, seed: int = 0) -> float:
    """Probability of the rewarded answer (index 2) after `steps` updates of 8 prompts x 8 samples."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.zeros(6, requires_grad=True)
    opt = torch.optim.Adam([logits], lr=0.05)
    for _ in range(steps):
        with torch.no_grad():
            old = torch.log_softmax(logits, -1)
            actions = torch.multinomial(old.exp(), 64, replacement=True, generator=g)
        rewards = sign * (actions == 2).float()
        groups = torch.arange(64) // 8
        adv = advantages(spec, rewards, groups)
        logp = torch.log_softmax(logits, -1)[actions][:, None]  # one-token completions
        loss = policy_loss(spec, logp, old[actions][:, None], torch.ones(64, 1), adv, 64, 64)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.softmax(logits, -1)[2].item()


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{s.agg}-{s.adv_std_norm}")
def test_reward_raises_and_flipped_reward_lowers_the_rewarded_answer(spec):
    start = 1 / 6
    assert _train(spec, +1.0) > start + 0.5
    assert _train(spec, -1.0) < start / 2
