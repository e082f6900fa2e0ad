"""The `agent:` section's rollout (orchestrator/agents/agent_rollout.py) on scripted turns: groups of n_samples
trajectories per prompt, per-token versions, environments' own rewards, the split of rollout time, warm-start
demonstrations laid out token for token as the rollouts lay out trajectories, and what it refuses by name."""
from __future__ import annotations

import json

import pytest

from orchestrator.agents.agent_rollout import Agent, env_columns, episode_rewards
from orchestrator.config.schema import ConfigError
from rollout.agent.config import AgentConfig
from rollout.tasks import GuessTask, Problem
from tests.rollout.rollout_helpers import scripted_generate


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _agent(tokenizer, task="guess", **cfg) -> Agent:
    cfg = {"environment": "guess", **cfg}
    return Agent(AgentConfig(**cfg), tokenizer, tokenizer.chat_template, None, 8, None, task, context=None)


def test_guessing_games_in_groups_carry_versions_and_their_own_rewards(tokenizer):
    problems = GuessTask(high=20).problems(seed=0, iteration=1, n=3)
    secrets = [p.columns["secret"] for p in problems]
    # trajectory k answers problem k // 2: a wrong guess, then the secret
    script = {k: [str(secrets[k // 2] % 20 + 1), str(secrets[k // 2])] for k in range(6)}
    agent = _agent(tokenizer, max_turns=4)
    done = agent.rollout(scripted_generate(tokenizer, script), problems, n_samples=2, seed=5, version=3)
    samples = done.samples.items
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2]  # a prompt's trajectories form its group
    for s in samples:
        sampled = [v for v, m in zip(s.versions, s.loss_mask) if m]
        assert sampled and set(sampled) == {3} and set(v for v, m in zip(s.versions, s.loss_mask) if not m) == {-1}
        assert s.reward == 1 - 1 / 4 and s.finish_reason == "episode"  # found on the second of 4 guesses
        assert s.text == str(secrets[s.prompt_index])  # the last turn; the whole conversation is kept for the logs
        assert [m["role"] for m in s.conversation] == ["assistant", "user", "assistant"]
    assert done.metrics["env/solved"] == 1.0 and done.metrics["env/turns_solved"] == 2.0
    assert done.metrics["turns/mean"] == 2.0 and 0 < done.metrics["masked_token_share"] < 1
    assert set(done.parts) == {"generate", "tools"} and all(v >= 0 for v in done.parts.values())
    assert episode_rewards(done.samples).metrics["reward_mean"] == pytest.approx(0.75)


def test_an_environment_that_never_scored_is_an_error_not_a_zero(tokenizer):
    from rollout.samples import Sample, Samples

    with pytest.raises(RuntimeError, match="without a reward"):
        episode_rewards(Samples([Sample(0, "t", [1], [2], [0.0], reward=None)]))


def test_warm_start_demonstrations_are_laid_out_as_rollouts_lay_them_out(tokenizer):
    """The same conversation, written (demonstration) and played (the runner on scripted turns), gives the same
    tokens and masks: supervised warm start trains on exactly the layout RL will sample and train on."""
    task = GuessTask(high=20)
    agent = _agent(tokenizer, max_turns=8)
    games = task.sft_conversations(seed=0, n=6)
    assert any(len(g) >= 5 for g in games)  # some games take several guesses
    demos = agent.demonstrations(games, [tokenizer.eos_token_id])
    for game, demo in zip(games, demos):
        secret = int(game[-1]["content"])
        problem = Problem("guess", game[0]["content"], str(secret), messages=(game[0],),
                          columns={"secret": secret, "high": 20})
        script = {0: [m["content"] for m in game if m["role"] == "assistant"]}
        played = agent.rollout(scripted_generate(tokenizer, script), [problem], 1, seed=0, version=0).samples.items[0]
        assert demo.prompt_ids == played.prompt_ids and demo.completion_ids == played.completion_ids
        assert demo.loss_mask == [float(m) for m in played.loss_mask]
        assert 0 < sum(demo.loss_mask) < len(demo.loss_mask)


def test_code_problems_reach_the_environment_with_their_tests():
    spec = {"language": "python", "tests": ["assert f(1) == 2"], "reference": "def f(x): return 2 * x"}
    columns = env_columns(Problem("code", "Write f.\n", json.dumps(spec)))
    assert columns["tests"] == spec["tests"] and columns["prompt"] == "Write f.\n" and columns["language"] == "python"
    assert env_columns(Problem("guess", "p", "7", columns={"secret": 7}))["secret"] == 7


@pytest.mark.parametrize("task, cfg, message", [
    ("addition", {"environment": "guess"}, "plays the problems of task.name guess"),
    ("addition", {"environment": "code_feedback"}, "needs coding problems with tests"),
    ("addition", {"environment": None, "tools": ["no_such_module:fn"]}, "agent.tools: tool 'no_such_module:fn'"),
    ("addition", {"environment": None, "tools": ["json:nothing_here"]}, "has no function 'nothing_here'"),
])
def test_what_cannot_run_is_refused_by_name(tokenizer, task, cfg, message):
    with pytest.raises(ConfigError, match=message):
        _agent(tokenizer, task, **cfg)


def test_a_model_without_a_chat_template_is_refused(tokenizer):
    with pytest.raises(ConfigError, match="chat template"):
        Agent(AgentConfig(environment="guess"), tokenizer, None, None, 8, None, "guess")


def python(code: str) -> str:
    """Evaluate a print of an arithmetic expression (a stand-in for the sandbox's python tool).

    Args:
        code: a line `print(<expression>)`
    """
    return str(eval(code.removeprefix("print(").removesuffix(")"), {"__builtins__": {}}))


def test_tool_demonstrations_are_written_as_the_parser_reads_and_laid_out_as_played(tokenizer):
    """A written tool conversation (OpenAI `tool_calls`) and the same conversation played through the tool loop
    give the same tokens and masks, with the call written as agent.tool_parser reads it."""
    from rollout.tasks import MultiplyTask

    agent = _agent(tokenizer, "multiply", environment=None, tools=[f"{__name__}:python"], max_turns=3)
    task = MultiplyTask(max_digits=3)
    for conversation, demo in zip(task.sft_conversations(seed=0, n=3), agent.demonstrations(
            task.sft_conversations(seed=0, n=3), [tokenizer.eos_token_id])):
        call = agent._as_written(conversation[1])["content"]
        assert call.startswith("<tool_call>") and agent.parser.parse(call).calls[0].name == "python"
        problem = task.problems(seed=0, iteration=1, n=1)[0].__class__(
            "multiply", conversation[0]["content"], conversation[-1]["content"], messages=(conversation[0],))
        played = agent.rollout(scripted_generate(tokenizer, {0: [call, conversation[-1]["content"]]}), [problem], 1,
                               seed=0, version=0)
        s = played.samples.items[0]
        assert played.metrics["tools/call_frequency"] == 1 and played.metrics["tools/failure_frequency"] == 0
        assert s.text == conversation[-1]["content"] and s.finish_reason == "episode"
        assert demo.prompt_ids == s.prompt_ids and demo.completion_ids == s.completion_ids
        assert demo.loss_mask == [float(m) for m in s.loss_mask]


def test_long_replies_are_cut_tools_to_their_head_environments_to_first_line_and_tail(tokenizer):
    from rollout.agent import AgentLimits, AgentRunner

    runner = AgentRunner(None, tokenizer, AgentLimits(max_tool_response_tokens=60))
    long = "4 of 4 tests failed\n" + "x" * 300 + "\nSyntaxError: invalid syntax"
    tool = runner._clip({"role": "tool", "content": long})["content"]
    env = runner._clip({"role": "user", "content": long})["content"]
    assert tool.startswith("4 of 4 tests failed\nxxx") and "SyntaxError" not in tool and "tokens cut" in tool
    assert env.startswith("4 of 4 tests failed\n... (") and env.endswith("xx\nSyntaxError: invalid syntax")
    assert len(tokenizer.encode(env, add_special_tokens=False)) <= 60 + 25  # the budget and the cut note
    short = {"role": "user", "content": "lower"}
    assert runner._clip(short) == short


def test_eval_measures_the_agent_beside_the_single_completion(tokenizer):
    """The eval phase with an agent: the single completion (one guess, no feedback) and the agent's trajectories
    on the same held-out games, from engines that always answer 7."""
    from orchestrator.config.schema import EvalConfig
    from orchestrator.iteration.evaluation import evaluate
    from rollout.config import RolloutConfig
    from rollout.samples import Sample, Samples

    class Engines:
        def generate(self, problems, n_samples, max_new_tokens, sampling, seed):
            ids = tokenizer.encode("7", add_special_tokens=False) + [tokenizer.eos_token_id]
            return Samples([Sample(i, p.task_id, list(p.prompt_ids), ids, [-0.5] * len(ids), text="7",
                                   finish_reason="stop") for i, p in enumerate(problems) for _ in range(n_samples)])

    task = GuessTask(high=20)
    problems = [Problem("guess", "g", str(s), messages=({"role": "user", "content": "g"},),
                        columns={"secret": s, "high": 20}) for s in (7, 3)]
    out = evaluate(Engines(), task, problems, EvalConfig(every=1, n_samples=2), RolloutConfig(), seed=0,
                   agent=_agent(tokenizer, max_turns=4))
    assert out["eval/pass@1"] == 0.5 and out["eval/reward_mean"] == 0.5  # one guess: right for the 7 only
    assert out["eval/agent_reward_mean"] == 0.5 and out["eval/agent_sampled_pass@1"] == 0.5
    assert out["eval/agent_turns_mean"] == (1 + 4) / 2  # found at once; four wrong 7s
