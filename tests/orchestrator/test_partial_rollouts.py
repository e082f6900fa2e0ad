"""Partial rollouts (orchestrator/agents/partial_rollouts.py) against a stand-in engine whose generations have known
lengths: segments, versions, the requests' token ids, groups, seeds, the staleness bound and its metrics."""
from __future__ import annotations

import pytest

from orchestrator.agents.agent_rollout import Rollout
from orchestrator.agents.partial_rollouts import (mask_stale, request_seed, sample_partially, sampled_in,
                                           token_staleness)
from orchestrator.iteration.schedule import Drawn, RolloutScheduler
from rollout.samples import Sample, Samples
from rollout.tasks import Problem

PROMPT = (7, 8)


class Engine:
    """Generation j of the prompt whose answer is a wants `lengths[(a, j)]` tokens (it ends there, with `stop`);
    its token k is 10000 j + 100 (k + 1) + a, with log-prob -(version + 1) / 100. A new generation's j is its
    place among its prompt's requests, a continued one's is in its tokens. Records every request."""

    def __init__(self, lengths: dict[tuple[str, int], int]):
        self.lengths, self.version, self.requests = lengths, 0, []

    def generate(self, requests: list[Problem]) -> Samples:
        self.requests.append(list(requests))
        out, opened = [], {}
        for r in requests:
            done = len(r.prompt_ids) - len(PROMPT)
            if done:
                j = r.prompt_ids[len(PROMPT)] // 10000
            else:
                j = opened[r.answer] = opened.get(r.answer, -1) + 1
            want = self.lengths[(r.answer, j)]
            n = min(r.max_new_tokens, want - done)
            ids = [10000 * j + 100 * (done + k + 1) + int(r.answer) for k in range(n)]
            out.append(Sample(0, r.task_id, list(r.prompt_ids), ids, [-(self.version + 1) / 100] * n,
                              finish_reason="stop" if done + n == want else "length"))
        return Samples(out)


def _problems(answers: list[str]) -> list[Problem]:
    return [Problem("t", f"p{a}", a, prompt_ids=PROMPT) for a in answers]


def _draw(engine: Engine, problems, carried, seed, version, *, max_draws=2, finish_all=False, segment=3, max_new=8,
          min_groups=0):
    engine.version = version
    return sample_partially(engine.generate, problems, carried, n_samples=2, max_new_tokens=max_new,
                            segment_tokens=segment, max_draws=max_draws, min_groups=min_groups, seed=seed,
                            version=version,
                            finish_all=finish_all, decode=lambda ids: " ".join(map(str, ids)))


def test_a_long_generation_is_set_aside_and_continued_from_its_tokens_under_the_next_version():
    # prompt 1: both generations end within the 3-token segment; prompt 2: one wants 6 tokens, one 10 (> 8 max)
    engine = Engine({("1", 0): 2, ("1", 1): 3, ("2", 0): 6, ("2", 1): 10, ("3", 0): 1, ("3", 1): 2})
    first = _draw(engine, _problems(["1", "2"]), [], seed=11, version=0)
    assert [p.answer for p in first.problems] == ["1"]  # prompt 2's group waits for its running generations
    assert [(s.prompt_index, s.completion_ids, s.versions) for s in first.samples] == [
        (0, [101, 201], [0, 0]), (0, [10101, 10201, 10301], [0, 0, 0])]
    assert first.samples.items[0].text == "101 201"
    (group,) = first.set_aside
    assert group.running == [True, True] and group.draws == 1
    assert first.metrics == {"partial_continued": 0, "partial_set_aside": 2, "partial_groups_set_aside": 1,
                             "partial_groups_finished_early": 0, "partial_share": 0.0, "partial_span": 0.0}

    second = _draw(engine, _problems(["3"]), first.set_aside, seed=12, version=1)
    # continued from its own token ids (no decode / encode), with the rest of the token budget: its last sampling
    continued = engine.requests[1][:2]
    assert [r.prompt_ids for r in continued] == [PROMPT + (102, 202, 302), PROMPT + (10102, 10202, 10302)]
    assert [r.max_new_tokens for r in continued] == [5, 5]
    assert [r.max_new_tokens for r in engine.requests[1][2:]] == [3, 3]  # new: one segment
    assert [p.answer for p in second.problems[:1]] == ["2"]  # the carried group first, then what ended at once
    a, b = second.samples.items[:2]
    assert a.completion_ids == [102, 202, 302, 402, 502, 602] and a.versions == [0, 0, 0, 1, 1, 1]
    assert a.logprobs == [-0.01] * 3 + [-0.02] * 3 and a.finish_reason == "stop" and a.prompt_index == 0
    assert b.completion_ids == [10000 + 100 * k + 2 for k in range(1, 9)] and b.versions == [0] * 3 + [1] * 5
    assert b.finish_reason == "length" and b.text == " ".join(str(10000 + 100 * k + 2) for k in range(1, 9))
    assert second.metrics["partial_continued"] == 2 and second.metrics["partial_share"] == pytest.approx(2 / 4)
    assert second.metrics["partial_span"] == 2.0
    # the carried groups handed in are left as they were (a checkpoint holds them)
    assert first.set_aside[0].samples[0].completion_ids == [102, 202, 302]


def test_seeds_are_fixed_by_the_config_and_differ_per_generation_and_sampling():
    engine = Engine({("1", 0): 9, ("1", 1): 9})
    first = _draw(engine, _problems(["1"]), [], seed=11, version=0, max_draws=3)
    _draw(engine, [], first.set_aside, seed=12, version=1, max_draws=3)
    seeds = [r.seed for batch in engine.requests for r in batch]
    assert seeds == [request_seed(11, 0, j, d) for d in (0, 1) for j in (0, 1)]  # the group's own seed goes on
    assert len(set(seeds)) == 4
    again = Engine({("1", 0): 9, ("1", 1): 9})
    _draw(again, _problems(["1"]), [], seed=11, version=0, max_draws=3)
    assert [r.seed for r in again.requests[0]] == seeds[:2]


def test_the_last_sampling_and_the_last_iteration_run_every_generation_to_its_end():
    engine = Engine({("1", 0): 7, ("1", 1): 1})
    # max_draws 3: set aside twice at most; the third sampling has the rest of the budget
    d1 = _draw(engine, _problems(["1"]), [], seed=11, version=0, max_draws=3)
    d2 = _draw(engine, [], d1.set_aside, seed=12, version=1, max_draws=3)
    d3 = _draw(engine, [], d2.set_aside, seed=13, version=2, max_draws=3)
    assert (len(d1.problems), len(d2.problems), len(d3.problems)) == (0, 0, 1)
    assert d3.samples.items[0].versions == [0] * 3 + [1] * 3 + [2] and not d3.set_aside
    last = _draw(Engine({("1", 0): 7, ("1", 1): 8}), _problems(["1"]), [], seed=11, version=0, finish_all=True)
    assert [len(s.completion_ids) for s in last.samples] == [7, 8] and not last.set_aside


def test_too_few_ended_groups_finish_the_oldest_open_ones_in_a_second_call():
    # three prompts, all long: none ends within its segment; the trainer needs 2 groups
    engine = Engine({(a, j): 6 + j for a in "123" for j in range(2)})
    part = _draw(engine, _problems(["1", "2", "3"]), [], seed=11, version=4, min_groups=2)
    assert [p.answer for p in part.problems] == ["1", "2"] and [g.problem.answer for g in part.set_aside] == ["3"]
    assert len(engine.requests) == 2 and [r.max_new_tokens for r in engine.requests[1]] == [5, 5, 5, 5]
    assert [r.prompt_ids[2:] for r in engine.requests[1]][:2] == [(101, 201, 301), (10101, 10201, 10301)]
    assert [r.seed for r in engine.requests[1]] == [request_seed(11, i, j, 1) for i in (0, 1) for j in (0, 1)]
    assert all(s.versions == [4] * len(s.completion_ids) for s in part.samples)
    assert part.metrics["partial_groups_finished_early"] == 2
    assert part.metrics["partial_share"] == 0.0  # one sampling gave them all their tokens
    assert part.set_aside[0].samples[0].completion_ids == [103, 203, 303]


def test_a_prompt_without_token_ids_is_refused():
    with pytest.raises(ValueError, match="from token ids: problem t has none"):
        _draw(Engine({}), [Problem("t", "p", "1")], [], seed=11, version=0)


def _sample(versions, mask=None):
    return Sample(0, "t", [1], [5] * len(versions), [0.0] * len(versions), versions=versions, loss_mask=mask)


def test_tokens_beyond_the_bound_are_left_out_of_the_loss_and_counted():
    samples = Samples([_sample([0, 0, 1, 2]), _sample([2, -1, 0], mask=[1, 0, 1]), _sample([1, 2])])
    # trained by policy 3 with bound 2: version 0 is 3 updates old; an inserted token (-1) is never stale
    assert mask_stale(samples, 3, 2, version=2) == 3
    assert [s.loss_mask for s in samples] == [[0, 0, 1, 1], [1, 0, 0], None]
    assert mask_stale(samples, 3, 3, version=2) == 0
    plain = Samples([Sample(0, "t", [1], [5, 6], [0.0, 0.0])])  # one version, given by its batch
    assert mask_stale(plain, 3, 1, version=1) == 2 and plain.items[0].loss_mask == [0, 0]


def test_staleness_per_token_and_per_sample():
    samples = Samples([_sample([0, 0, 1, 1]), _sample([1, -1, 1])])
    # trained by policy 2: tokens 2, 2, 1, 1 and 1, 1; samples (oldest token) 2 and 1
    assert token_staleness(samples, 2, 1) == {
        "staleness_token_mean": pytest.approx(8 / 6), "staleness_token_max": 2, "staleness_sample_mean": 1.5,
        "staleness_tokens_0": 0.0, "staleness_tokens_1": pytest.approx(4 / 6),
        "staleness_tokens_2": pytest.approx(2 / 6)}


def test_a_sampling_is_checked_on_exactly_the_tokens_it_sampled():
    # the second: a token of this version its own loss mask leaves out stays out of the check too
    batch = Samples([_sample([0, 0, 1, 1]), _sample([1, 1, 1], mask=[1, 0, 1]), _sample([0])])
    engine = Engine({("1", 0): 9, ("1", 1): 9})
    aside = _draw(engine, _problems(["1"]), [], seed=11, version=1).set_aside  # 3 tokens each, version 1
    checked = sampled_in(batch, aside, 1)
    assert [s.loss_mask for s in checked] == [[0, 0, 1, 1], [1, 0, 1], [1, 1, 1], [1, 1, 1]]
    assert batch.items[0].loss_mask is None  # narrowed on copies


def test_a_run_of_partial_rollouts_never_trains_a_token_beyond_the_bound():
    """The scheduler and partial rollouts together, as the loop runs them (batch t + 1 drawn ahead by the policy
    the engines serve during iteration t, trained by policy t): with max_staleness k, every trained token is at
    most k updates old, the bound is reached, and every generation is trained exactly once."""
    lengths = {(str(a), j): 1 + (a * 7 + j * 3) % 12 for a in range(40) for j in range(2)}
    for bound in (2, 3):
        engine, trained = Engine(lengths), []

        def draw(it, version, carried):
            problems = _problems([str(4 * (it - 1) + k) for k in range(4)])
            part = _draw(engine, problems, carried, seed=10 + it, version=version, max_draws=bound, segment=2,
                         max_new=12, finish_all=it == 10, min_groups=1)
            assert len(part.problems) >= 1
            return Drawn(it, part.problems, None, Rollout(part.samples, part.metrics), version, 0.0, 0.0,
                         set_aside=part.set_aside)

        with RolloutScheduler(draw, bound, 0, 10) as scheduler:
            for it in range(1, 11):
                drawn = scheduler.take(it)
                scheduler.ahead(it)
                trained += [(it - 1 - v, s.text) for s in drawn.rolled.samples for v in s.versions]
                scheduler.drain()
                scheduler.synced(it)
        assert max(age for age, _ in trained) == bound
        assert len({text for _, text in trained}) == 40 * 2  # each generation once (its tokens name it)
