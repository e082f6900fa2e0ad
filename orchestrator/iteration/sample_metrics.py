"""What an iteration's samples say, as the metrics TRL and veRL users read: the spread of rewards within each
prompt's group (GRPO learns nothing from a group whose rewards are all equal), completion lengths and the share
cut at `rollout.max_new_tokens`, and a few completions to read (RUN_DIR/samples.jsonl, TensorBoard text)."""
from __future__ import annotations

import statistics
from collections.abc import Mapping

from rollout.samples import Samples
from rollout.tasks import Problem


def sample_metrics(samples: Samples) -> dict[str, float]:
    """`reward_std`: the standard deviation of the batch's rewards (with Bessel's correction, as TRL 1.16's
    `reward_std`); `reward_std_in_group`: the mean over prompts of their samples' reward std (population, what
    GRPO's advantages divide by); `zero_std_groups`: the share of prompts whose samples all got the same reward
    (zero advantage for all of them: TRL's `frac_reward_zero_std`); `completion_len` (mean, `_min`, `_max`) in
    tokens; `clipped_ratio`: the share of completions that hit max_new_tokens (TRL's
    `completions/clipped_ratio`); `prompt_tokens`. Samples without a reward (every reward function skipped them)
    are left out of the reward figures, as out of training."""
    lengths = [len(s.completion_ids) for s in samples]
    groups: dict[int, list[float]] = {}
    for s in samples:
        if s.reward is not None:
            groups.setdefault(s.prompt_index, []).append(s.reward)
    rewards = [r for group in groups.values() for r in group]
    stds = [statistics.pstdev(group) for group in groups.values()]
    prompts = {s.prompt_index: len(s.prompt_ids) for s in samples}
    nan = float("nan")
    return {
        "reward_std": statistics.stdev(rewards) if len(rewards) > 1 else nan,
        "reward_std_in_group": statistics.fmean(stds) if stds else nan,
        "zero_std_groups": sum(sd == 0.0 for sd in stds) / len(stds) if stds else nan,
        "completion_len": statistics.fmean(lengths) if lengths else nan,
        "completion_len_min": min(lengths, default=nan),
        "completion_len_max": max(lengths, default=nan),
        "clipped_ratio": sum(s.finish_reason == "length" for s in samples) / len(samples) if lengths else nan,
        "prompt_tokens": sum(prompts.values()),
    }


def sample_records(iteration: int, problems: list[Problem], samples: Samples, n: int,
                   extra_columns: Mapping[str, list] | None = None) -> list[dict]:
    """Up to `n` completions to read, the first sample of each of the first prompts (a different prompt each,
    the same ones whenever the run is repeated or resumed): the prompt as the engine saw it, the completion's
    text, its reward, length and why generation stopped, and what reward functions logged for it (TRL's
    `log_extra`: one value per sample, in sample order)."""
    firsts: dict[int, int] = {}
    for i, s in enumerate(samples):
        firsts.setdefault(s.prompt_index, i)
    records = []
    for i in [firsts[p] for p in sorted(firsts)[:n]]:
        s = samples.items[i]
        completion = s.text if s.conversation is None else "\n".join(f"{m['role']}: {m['content']}"
                                                                     for m in s.conversation)
        records.append({"iteration": iteration, "prompt": problems[s.prompt_index].prompt, "completion": completion,
                        "reward": s.reward, "completion_tokens": len(s.completion_ids),
                        "finish_reason": s.finish_reason,
                        **{name: values[i] for name, values in (extra_columns or {}).items()}})
    return records
