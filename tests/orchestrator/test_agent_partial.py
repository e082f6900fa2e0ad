"""Partial rollouts of multi-turn trajectories (orchestrator/agents/agent_partial.py) on the guessing game, with the
real Agent, runner, environment and chat template, and a scripted stand-in for the engines' sampling whose turn depends
on the turn's seed only: trajectories set aside at turn boundaries come out token for token as the same
trajectories sampled whole, each token with the version of the sampling that produced it, and continue the same
after a pickle round trip (the checkpoint of a batch drawn ahead)."""
from __future__ import annotations

import pickle
import re

import pytest

from orchestrator.agents.agent_partial import AgentGroup, draw_agent_partially
from orchestrator.agents.partial_rollouts import sampled_in
from rollout.samples import Sample, Samples
from rollout.tasks import Problem

N = 2  # trajectories per prompt


@pytest.fixture(scope="module")
def agent(tiny_model_dir):
    from transformers import AutoTokenizer

    from orchestrator.agents.agent_rollout import Agent
    from rollout.agent.config import AgentConfig

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    cfg = AgentConfig(environment="guess", max_turns=5, max_total_tokens=200, max_tokens_per_turn=4)
    return Agent(cfg, tok, tok.chat_template, None, 4, None, "guess")


def scripted(tokenizer, calls: list):
    """Each request's turn: a guess drawn from its seed (the secret, 7, one time in three), ended by EOS."""
    def generate(problems, max_new, seed):
        out = []
        for p in problems:
            calls.append(p)
            guess = 7 if p.seed % 3 == 0 else 1 + p.seed % 19
            ids = tokenizer.encode(str(guess), add_special_tokens=False)[:p.max_new_tokens - 1] + [
                tokenizer.eos_token_id]
            out.append(Sample(0, p.task_id, list(p.prompt_ids), ids, [-0.5] * len(ids), text=str(guess),
                              finish_reason="stop"))
        return Samples(out)
    return generate


def problems(k: int) -> list[Problem]:
    return [Problem(f"g{i}", "", "7", columns={"secret": 7, "high": 20}) for i in range(k)]


def _draw(agent, calls, new, carried, seed, version, **kw):
    args = dict(n_samples=N, seed=seed, version=version, segment=1, max_draws=3, min_groups=0, finish_all=False) | kw
    return draw_agent_partially(agent, scripted(agent.tokenizer, calls), new, carried, **args)


def test_trajectories_set_aside_at_turn_boundaries_end_as_whole_ones_with_each_turns_version(agent):
    whole = agent.rollout(scripted(agent.tokenizer, []), problems(3), N, 11, version=0).samples
    calls: list = []
    first = _draw(agent, calls, problems(3), [], 11, 0)
    # one turn each (segment 1: a turn reaches it), then set aside after the environment's reply: only games won
    # at the first guess end now
    assert all(s.versions.count(0) == len(s.versions) - s.versions.count(-1) for s in first.samples)
    assert first.metrics["partial_continued"] == 0 and first.set_aside
    second = _draw(agent, calls, problems(1), first.set_aside, 12, 1)
    third = _draw(agent, calls, [], second.set_aside, 13, 2)
    assert not third.set_aside  # a group's third sampling runs it to its end (max_draws 3)
    opened_first = {id(g.problem) for g in first.set_aside} | {id(p) for p in first.problems}
    ended = [(p, [s for s in d.samples if s.prompt_index == i]) for d in (first, second, third)
             for i, p in enumerate(d.problems) if id(p) in opened_first]
    assert sorted(p.task_id for p, _ in ended) == ["g0", "g1", "g2"]
    by_task = {p.task_id: group for p, group in ended}
    for i, s in enumerate(whole):
        got = by_task[s.task_id][i % N]
        # the same tokens, mask, log-probs, reward and conversation as the trajectory sampled whole
        assert (got.prompt_ids, got.completion_ids, got.loss_mask, got.logprobs, got.reward, got.conversation) == (
            s.prompt_ids, s.completion_ids, s.loss_mask, s.logprobs, s.reward, s.conversation)
        # turn k sampled by version min(k, 2) (one turn per sampling, the rest in the third); inserted tokens -1
        turns, versions = 0, []
        for m, prev in zip(got.loss_mask, [0] + got.loss_mask):
            turns += m == 1 and prev == 0
            versions.append(min(turns - 1, 2) if m else -1)
        assert got.versions == versions
    # a continued trajectory's request carries every id it had: nothing decoded and encoded again
    by_seed = {}
    for p in calls:
        by_seed.setdefault(p.task_id, []).append(p.prompt_ids)
    assert any(len(v) > 1 for v in by_seed.values())
    spanning = [s for d in (second, third) for s in d.samples if len(set(s.versions) - {-1}) > 1]
    assert spanning and second.metrics["partial_continued"] > 0 and third.metrics["partial_share"] > 0
    # each sampling's tokens, as the gap check of a batch drawn ahead reads them
    mine = sampled_in(second.samples, second.set_aside, 1)
    assert mine and all(all(v == 1 for v, m in zip(s.versions, s.loss_mask) if m) for s in mine)


def test_a_pickled_group_continues_as_the_one_kept_in_memory(agent):
    first = _draw(agent, [], problems(3), [], 5, 0)
    kept = _draw(agent, [], [], first.set_aside, 6, 1, finish_all=True)
    first_again = _draw(agent, [], problems(3), [], 5, 0)
    restored = pickle.loads(pickle.dumps(first_again.set_aside))
    assert [type(g) for g in restored] == [AgentGroup] * len(first.set_aside)
    resumed = _draw(agent, [], [], restored, 6, 1, finish_all=True)
    key = [(s.task_id, s.completion_ids, s.versions, s.reward) for s in kept.samples]
    assert key == [(s.task_id, s.completion_ids, s.versions, s.reward) for s in resumed.samples] and key


def test_too_few_ended_groups_end_the_oldest_open_ones(agent):
    draw = _draw(agent, [], problems(3), [], 11, 0, min_groups=3)
    assert len(draw.problems) == 3 and not draw.set_aside
    assert draw.metrics["partial_groups_finished_early"] >= 1
    assert all(s.reward is not None for s in draw.samples)


def test_segment_tokens_default_to_the_trajectory_budget_over_the_staleness():
    from rollout.config import RolloutConfig

    r = RolloutConfig(max_staleness=2, partial_rollout=True, mismatch_correction="tis", max_new_tokens=8)
    assert r.segment_within(448) == 224 and r.segment_within(449) == 225 and r.segment_tokens == 4
    r = r.model_copy(update={"partial_rollout_tokens": 32})
    assert r.segment_within(448) == 32 and r.segment_tokens == 8


def test_partial_rollouts_take_environments_and_refuse_the_sandboxs_state():
    from orchestrator.config.schema import ConfigError, parse_config

    base = {"name": "t", "iterations": 1, "task": {"name": "guess"}, "trainer": {"loss": "grpo"},
            "rollout": {"max_staleness": 2, "partial_rollout": True, "mismatch_correction": "tis"}}
    assert parse_config({**base, "agent": {"environment": "guess"}}).rollout.partial_rollout
    with pytest.raises(ConfigError, match=re.escape("which a checkpoint does not hold")):
        parse_config({**base, "task": {"name": "code"}, "agent": {"environment": "code_feedback"}})


def test_stop_strings_with_agents_are_refused_by_name():
    """The engine cuts a stop string out of a turn's text while the sampled tokens keep it: the tool parser and
    the template would read other text than the tokens trained on (a turn sampled `1=1=` with stop `=` came back
    as context `...1=1=1`). Refused at start-up."""
    from orchestrator.config.schema import ConfigError, parse_config

    base = {"name": "t", "iterations": 1, "task": {"name": "guess"}, "agent": {"environment": "guess"}}
    assert parse_config(base).agent
    for agent in ({"environment": "guess"}, {"tools": ["python"]}):
        with pytest.raises(ConfigError, match=re.escape("rollout.stop with `agent:` is not built")):
            parse_config({**base, "agent": agent, "rollout": {"stop": ["</tool_call>"]}})


def test_a_batch_that_set_trajectories_aside_keeps_reading_what_it_sampled(agent):
    """The batch drawn ahead is checked against the policy that sampled it (checks.BatchChecks.drawn_ahead reads its
    set-aside trajectories' tokens) while the engines draw the next batch, which continues those trajectories:
    the check must read the tokens the batch sampled, whole and unchanged, however far the next draw has got."""
    from orchestrator.agents.agent_rollout import Rollout
    from orchestrator.iteration.schedule import Drawn

    first = _draw(agent, [], problems(3), [], 11, 0)
    drawn = Drawn(1, first.problems, None, Rollout(first.samples, first.metrics), 0, 0.0, 0.0,
                  set_aside=first.set_aside)
    before = [(s.completion_ids, s.loss_mask, s.logprobs, s.versions) for s in drawn.sampled()]
    assert before and any(len(g.trajectories[0].traj.ids) for g in first.set_aside)
    second = _draw(agent, [], [], first.set_aside, 12, 1, finish_all=True)  # extends every one of them
    assert second.samples and not second.set_aside
    after = [(s.completion_ids, s.loss_mask, s.logprobs, s.versions) for s in drawn.sampled()]
    assert after == before
    assert all(len(set(map(len, row))) == 1 for row in after)  # no ragged row
