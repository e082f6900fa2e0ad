"""Turning text and samples into the trainer's batches (the one place prompts and completions are tokenised
on the driver)."""
from __future__ import annotations

from collections.abc import Iterable

from orchestrator.agents.partial_rollouts import token_versions
from rollout.config import RolloutConfig
from rollout.samples import Samples
from trainer.batch import TokenDistribution, TrainBatch, TrainSequence


def behaviour_distribution(rollout: RolloutConfig) -> TokenDistribution:
    """The distribution the engines sample from, as the trainer recomputes it."""
    return TokenDistribution(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k)


def text_batch(tokenizer, pairs: Iterable[tuple[str, str]]) -> TrainBatch:
    """(prompt, completion) text pairs; each completion ends with the tokenizer's end-of-sequence token, as a
    generated completion that stopped on its own does."""
    eos = tokenizer.eos_token_id
    return TrainBatch([TrainSequence(tokenizer(p, add_special_tokens=False).input_ids,
                                     tokenizer(c, add_special_tokens=False).input_ids + [eos]) for p, c in pairs])


def attach_reference_logprobs(batch: TrainBatch, ref_logprobs: list[list[float]]) -> None:
    for seq, ref in zip(batch.sequences, ref_logprobs, strict=True):
        seq.ref_logprobs = ref


def samples_batch(samples: Samples, sampling: TokenDistribution, unscored: bool = False,
                  version: int | None = None) -> TrainBatch:
    """Samples drawn from `sampling`, with their rollout log-probs, rewards and (mixture-of-experts models) the
    rollout's expert routing; samples of one prompt form one group. Samples without a reward (every reward
    function skipped them) are left out; with `unscored`, a batch only rescored and never trained, they are kept
    (reward 0: a trajectory is scored after the rollout). With `version`, the policy version that sampled them,
    every sequence carries the version of each of its tokens (a sample's own, where it has them)."""
    return TrainBatch([TrainSequence(s.prompt_ids, s.completion_ids, old_logprobs=s.logprobs,
                                     reward=0.0 if s.reward is None else s.reward,
                                     group=s.prompt_index, routed_experts=s.routed_experts,
                                     loss_mask=[float(m) for m in s.loss_mask] if s.loss_mask else [],
                                     versions=token_versions(s, version) if version is not None else [])
                       for s in samples if unscored or s.reward is not None], sampling)
