"""Partial rollouts (`rollout.partial_rollout`; Kimi k1.5, arXiv:2501.12599, section 2.6.2): each batch's
sampling gives a generation at most `segment_tokens` new tokens; one still running then is set aside with its
tokens and continued, from those very token ids, when the next batch is sampled, on the weights the engines
serve then. A group (a prompt's n generations) is trained in the batch whose sampling ends its last generation,
so a batch holds the groups set aside before and ended now, then the new groups that ended at once.

Staleness: with one batch sampled ahead (rollout.max_staleness >= 1), a batch sampled by policy v trains at the
earliest one update later; a generation continued in k later samplings started k versions before the last of
them, so `max_draws` = max_staleness samplings keep every token within max_staleness updates of the policy that
trains on it. A generation in its last allowed sampling, or in the run's last iteration, runs to its end.

Every sampled token carries the version that sampled it (Sample.versions) beside its log-prob; the ids are
never decoded and encoded again (the text is decoded from them for the reward). Seeds are a pure function of
(seed of the sampling that opened the group, prompt, sample, sampling count), so the schedule of which version
sampled which token is fixed by the config (deterministic runs resume exactly)."""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from rollout import routing_capture
from rollout.samples import Sample, Samples
from rollout.tasks import Problem


@dataclass
class OpenGroup:
    """A prompt's group some of whose generations have not ended: set aside between two samplings."""

    problem: Problem
    samples: list[Sample]  # its n generations, in sample order, with their tokens so far
    running: list[bool]  # per generation: not ended yet
    segments: list[int]  # per generation: the requests made for it (each one's seed is its own)
    samplings: list[int]  # per generation: the samplings (batches drawn) that gave it tokens
    seed: int  # the seed of the sampling that opened the group
    index: int  # the prompt's index in that sampling
    draws: int  # samplings it has been part of


@dataclass
class PartialDraw:
    """One sampling's outcome: the batch (the groups whose generations have all ended, indexed by their place in
    `problems`) and the groups set aside for the next sampling."""

    problems: list[Problem]
    samples: Samples
    set_aside: list  # OpenGroup (orchestrator/agents/agent_partial.py: AgentGroup)
    metrics: dict[str, float]
    parts: dict[str, float] = field(default_factory=dict)  # multi-turn: seconds of generation and of tools


def request_seed(seed: int, index: int, sample: int, draw: int) -> int:
    digest = hashlib.blake2b(f"partial/{seed}/{index}/{sample}/{draw}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**62 - 1)


def ended(sample: Sample, max_new_tokens: int) -> bool:
    return sample.finish_reason != "length" or len(sample.completion_ids) >= max_new_tokens


def sample_partially(generate: Callable[[list[Problem]], Samples], new_problems: Sequence[Problem],
                     carried: Sequence[OpenGroup], *, n_samples: int, max_new_tokens: int, segment_tokens: int,
                     max_draws: int, min_groups: int, seed: int, version: int, finish_all: bool,
                     decode: Callable[[list[int]], str]) -> PartialDraw:
    """Continue the `carried` groups' running generations and open `n_samples` for each new problem, each for at
    most `segment_tokens` tokens (to its end where the group is in its `max_draws`-th sampling, or `finish_all`),
    in one call: `generate(requests)` returns one completion per request, in order, sampled with the request's
    own `seed` and `max_new_tokens` by the engines serving `version`. Where fewer than `min_groups` groups have
    ended then (a batch the trainer can cut into its mini-batches), the oldest open ones run to their end in a
    second call."""
    groups = [replace(g, samples=[replace(x) for x in g.samples], running=list(g.running),
                      segments=list(g.segments), samplings=list(g.samplings)) for g in carried]
    for i, problem in enumerate(new_problems):
        if not problem.prompt_ids:
            raise ValueError(f"partial rollouts continue generations from token ids: problem {problem.task_id} "
                             f"has none (its prompt was not rendered by the driver)")
        groups.append(OpenGroup(problem, [Sample(i, problem.task_id, list(problem.prompt_ids), [], [],
                                                 answer=problem.answer, versions=[]) for _ in range(n_samples)],
                                [True] * n_samples, [0] * n_samples, [0] * n_samples, seed, i, 0))
    before = [list(g.segments) for g in groups]
    continued = sum(bool(x.completion_ids) for g in groups for x, run in zip(g.samples, g.running) if run)
    _sampling_round(generate, groups, lambda g: finish_all or g.draws + 1 >= max_draws, max_new_tokens,
                    segment_tokens, version)
    short = min_groups - sum(not any(g.running) for g in groups)
    finished_now = [g for g in groups if any(g.running)][:max(short, 0)]
    _sampling_round(generate, finished_now, lambda g: True, max_new_tokens, segment_tokens, version)
    problems, items, set_aside, spans = [], [], [], []
    for group, segments in zip(groups, before):
        group.draws += 1
        group.samplings = [k + (after > b) for k, after, b in zip(group.samplings, group.segments, segments)]
        if any(group.running):
            set_aside.append(group)
            continue
        spans += group.samplings
        for sample in group.samples:
            sample.prompt_index = len(problems)
            sample.text = decode(sample.completion_ids)
            items.append(sample)
        problems.append(group.problem)
    return PartialDraw(problems, Samples(items), set_aside, partial_metrics(
        continued, sum(sum(g.running) for g in set_aside), len(set_aside), len(finished_now), spans))


def partial_metrics(continued: int, running_set_aside: int, groups_set_aside: int, finished_early: int,
                    spans: Sequence[int]) -> dict[str, float]:
    """One partial sampling's metrics; `spans`: per trained sample, the samplings that gave it tokens."""
    spanning = [k for k in spans if k > 1]
    return {"partial_continued": continued, "partial_set_aside": running_set_aside,
            "partial_groups_set_aside": groups_set_aside, "partial_groups_finished_early": finished_early,
            "partial_share": len(spanning) / max(len(spans), 1),
            "partial_span": sum(spanning) / len(spanning) if spanning else 0.0}


def _sampling_round(generate: Callable[[list[Problem]], Samples], groups: list[OpenGroup],
                    to_end: Callable[[OpenGroup], bool], max_new_tokens: int, segment_tokens: int,
                    version: int) -> None:
    """One engine call for the running generations of `groups`: a segment each, or the rest of the token budget
    where `to_end(group)`; their tokens, log-probs and versions appended."""
    requests, slots = [], []
    for group in groups:
        last = to_end(group)
        for j, sample in enumerate(group.samples):
            if not group.running[j]:
                continue
            left = max_new_tokens - len(sample.completion_ids)
            requests.append(replace(group.problem, prompt_ids=tuple(sample.prompt_ids) + tuple(sample.completion_ids),
                                    seed=request_seed(group.seed, group.index, j, group.segments[j]),
                                    max_new_tokens=left if last else min(segment_tokens, left)))
            slots.append((group, j, last))
    out = generate(requests).items if requests else []
    if len(out) != len(requests):
        raise RuntimeError(f"partial rollouts: {len(requests)} requests but {len(out)} completions")
    for (group, j, last), segment in zip(slots, out):
        sample = group.samples[j]
        if segment.routed_experts is not None:  # the call's prompt was the generation so far
            sample.routed_experts = routing_capture.extend_record(sample.routed_experts, segment.routed_experts)
        group.segments[j] += 1
        sample.completion_ids = sample.completion_ids + list(segment.completion_ids)
        sample.logprobs = sample.logprobs + list(segment.logprobs)
        sample.versions = sample.versions + [version] * len(segment.completion_ids)
        sample.finish_reason = segment.finish_reason
        group.running[j] = not ended(sample, max_new_tokens)
        if group.running[j] and last:
            raise RuntimeError(f"partial rollouts: a generation given the rest of its budget stopped after "
                               f"{len(sample.completion_ids)} of {max_new_tokens} tokens without ending")


def token_versions(sample: Sample, version: int) -> list[int]:
    """The version that sampled each completion token (-1: inserted by tide): a single turn without versions was
    sampled whole by `version`."""
    return sample.versions if sample.versions is not None else [version] * len(sample.completion_ids)


def mask_stale(samples: Samples, trained_by: int, max_staleness: int, version: int) -> int:
    """Leave out of the loss every sampled token more than `max_staleness` updates older than the policy
    `trained_by` that trains on it (a schedule that keeps the bound leaves none); how many were left out."""
    masked = 0
    for s in samples:
        versions = token_versions(s, version)
        stale = [v >= 0 and trained_by - v > max_staleness for v in versions]
        if any(stale):
            mask = s.loss_mask or [1] * len(versions)
            masked += sum(m and st for m, st in zip(mask, stale))
            s.loss_mask = [0 if st else m for m, st in zip(mask, stale)]
    return masked


def token_staleness(samples: Samples, trained_by: int, version: int) -> dict[str, float]:
    """Per sampled token and per sample (its oldest token): policy updates between sampler and trainer, with the
    share of tokens at each staleness."""
    per_token, per_sample = [], []
    for s in samples:
        versions = [v for v in token_versions(s, version) if v >= 0]
        if not versions:
            continue
        per_token += [trained_by - v for v in versions]
        per_sample.append(trained_by - min(versions))
    if not per_token:
        return {}
    out = {"staleness_token_mean": sum(per_token) / len(per_token), "staleness_token_max": max(per_token),
           "staleness_sample_mean": sum(per_sample) / len(per_sample)}
    for k in range(max(per_token) + 1):
        out[f"staleness_tokens_{k}"] = sum(x == k for x in per_token) / len(per_token)
    return out


def sampled_in(samples: Samples, set_aside: Sequence[OpenGroup], version: int) -> list[Sample]:
    """The tokens one sampling by `version` produced, as samples whose loss mask keeps only those: its batch's
    and those set aside (continued later, by a newer version, whose tokens are checked then)."""
    out = []
    for s in [*samples, *(x for g in set_aside for x in g.samples)]:
        mine = [int(v == version) for v in token_versions(s, version)]
        if s.loss_mask:
            mine = [a * int(b) for a, b in zip(mine, s.loss_mask)]
        if any(mine):
            out.append(replace(s, loss_mask=mine))
    return out
