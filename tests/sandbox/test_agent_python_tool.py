"""The agent's built-in `python` tool against the real sandbox service: one session per trajectory whose state
lasts across calls and which is closed when the trajectory ends; hostile calls (an endless loop, a fork bomb,
a flood of output) are contained, counted and answered, and the rollout goes on."""
from __future__ import annotations

from collections import Counter

import pytest

from rollout.agent import HermesParser, PythonSession, ToolBox
from rollout.agent.runner import AgentLimits, AgentRunner, ToolEpisode
from tests.rollout.rollout_helpers import python_episodes, scripted_generate

pytestmark = [pytest.mark.root, pytest.mark.timeout(240)]


def _call(code: str) -> str:
    import json

    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


def test_python_tool_sessions_per_trajectory(client, live_sessions, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    # two trajectories, each with a session of its own
    script = {0: [_call("x = 6 * 7"), _call("print(x)"), "The answer is 42."],
              1: [_call("while True:\n    pass"), _call("print('still here')"),
                  _call("import os\nwhile True:\n    os.fork()"), _call("print('x' * 1_000_000)"), "ok"]}
    generate = scripted_generate(tok, script)

    counts, sessions, episodes = Counter(), [], []
    for i in range(2):
        py = PythonSession(client, limits={"output_kb": 8, "pids": 32}, cell_timeout_s=1.0)
        box = ToolBox([py.tool()], timeout_s=30, max_chars=4000)
        sessions.append(py)
        episodes.append(ToolEpisode([{"role": "user", "content": f"task {i}"}], HermesParser(), box, counts, [py]))
    runner = AgentRunner(generate, tok, AgentLimits(max_turns=5, max_total_tokens=20000, max_tool_response_tokens=300),
                         tools=episodes[0].tools.schemas)
    samples = runner.run(episodes, seed=0).items
    texts = [tok.decode(s.completion_ids) for s in samples]
    assert "tool: 42" in texts[0] and sessions[0].opened == 1  # one session kept x between the calls
    assert "timed out" in texts[1] and "still here" in texts[1] and sessions[1].opened >= 2
    assert counts["failed_timeout"] >= 1 and counts["calls"] == 6  # the endless loop (the fork bomb may time out too)
    assert "tokens cut" in texts[1] or "characters cut" in texts[1]  # the flood reached the model cut
    assert all(s.finish_reason == "episode" for s in samples)
    assert live_sessions() == 0  # every trajectory's session was closed when it ended


def test_code_with_feedback_sends_failing_tests_back_until_they_pass(client, tiny_model_dir):
    from transformers import AutoTokenizer

    from rollout.agent import CodeFeedback
    from rollout.agent.runner import EnvEpisode

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    wrong, right = "```python\ndef add(a, b):\n    return a - b\n```", "```python\ndef add(a, b):\n    return a + b\n```"
    script = {0: [wrong, right], 1: [wrong, wrong, wrong], 2: ["```python\nimport os\nos._exit(0)\n```", right]}
    columns = {"prompt": "Write add(a, b).", "tests": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]}
    episodes = [EnvEpisode(CodeFeedback(client, max_turns=3), columns) for _ in range(3)]
    runner = AgentRunner(scripted_generate(tok, script), tok, AgentLimits(max_turns=5, max_total_tokens=5000))
    samples = runner.run(episodes, seed=0).items
    assert [s.reward for s in samples] == [1.0, 0.5, 1.0]  # add(0, 0) == 0 passes even with a - b
    assert [sum(1 for a, b in zip([0] + s.loss_mask, s.loss_mask) if b == 1 and a != 1) for s in samples] == [2, 3, 2]
    fed_back = tok.decode(samples[0].completion_ids)
    assert "1 of 2 tests failed" in fed_back and "assert add(1, 2) == 3" in fed_back and "Fix the code." in fed_back
    assert "2 of 2 tests failed" in tok.decode(samples[2].completion_ids)  # an early exit passes nothing


def test_the_trl_benchmarks_python_tool_is_tides_own_and_its_harness_failures_recorded(client, tiny_model_dir,
                                                                                       monkeypatch):
    """scripts/bench_agent_trl.py hands TRL tide's python tool, built on tide's Agent: a call runs in a sandbox
    session and its output comes back. A failure of that harness (not of the code it runs) is recorded for the
    bench to stop on: TRL answers the model with any tool exception and trains on, which is how a method renamed in
    tide left TRL's side without its tool, at reward 0 in every iteration, for a whole run."""
    import asyncio
    import sys
    from pathlib import Path

    from transformers import AutoTokenizer

    from orchestrator.agents.agent_rollout import Agent
    from rollout.agent.config import AgentConfig

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "scripts"))
    sys.modules.pop("bench_agent_trl", None)
    import bench_agent_trl

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    agent = Agent(AgentConfig(tools=["python"]), tok, tok.chat_template, None, 32, client.url, "multiply")
    agent.client = client  # the test service's token
    counts, errors = Counter(), []
    python = bench_agent_trl.tide_python_tool(agent, counts, errors)
    assert asyncio.run(python("print(6 * 7)")).strip() == "42"
    assert (counts["calls"], counts["failed"], errors) == (1, 0, [])
    assert "ZeroDivisionError" in asyncio.run(python("1 / 0")) and not errors  # the code's error: its output

    monkeypatch.setattr(Agent, "episode", lambda *a: (_ for _ in ()).throw(AttributeError("renamed")))
    with pytest.raises(AttributeError):
        asyncio.run(python("print(1)"))
    assert errors == ["AttributeError: renamed"] and counts["calls"] == 2


def test_two_calls_of_one_turn_share_the_interpreter_in_order(client, live_sessions, tiny_model_dir):
    """The model writes two calls in one turn (`x = 1`, then `print(x)`): they run one after another in that order
    in the trajectory's one interpreter (run together, the second opened an interpreter of its own and failed with
    a NameError, and the first session was never closed)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    cells = ["x = 1", "x = x + 1", "print(x)", "x = x * 10", "print(x)"]
    script = {0: ["".join(_call(c) for c in cells), _call("print(x)"), "done"]}
    counts = Counter()
    [episode] = python_episodes(client, 1, counts)
    py = episode.resources[0]
    runner = AgentRunner(scripted_generate(tok, script), tok, AgentLimits(max_turns=4, max_total_tokens=20000),
                         tools=episode.tools.schemas)
    text = tok.decode(runner.run([episode], seed=0).items[0].completion_ids)
    assert "NameError" not in text and py.opened == 1 and counts["calls"] == 6
    assert [line.removeprefix("tool: ") for line in text.splitlines() if line.startswith("tool: ")] == [
        "", "", "2", "", "20", "20"]
    assert live_sessions() == 0


def test_code_feedbacks_reward_is_the_last_attempts_whoever_ends_the_trajectory(client, tiny_model_dir):
    """The environments' contract: a step's reward is the trajectory's should it end after it. The same attempt
    (2 of 3 tests pass) earns 2/3 when the environment ends the episode, when tide ends it because the feedback
    does not fit max_total_tokens, when the turn ran out of tokens, and at the runner's max_turns (it earned 0
    whenever tide ended it)."""
    from transformers import AutoTokenizer

    from rollout.agent import CodeFeedback
    from rollout.agent.runner import EnvEpisode
    from tests.rollout.rollout_helpers import Turn

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    attempt = "```python\ndef f(a):\n    return a * 2\n```"
    columns = {"prompt": "Write f(a) = 2a.", "tests": ["assert f(1) == 2", "assert f(0) == 0", "assert f(2) == 5"]}
    room = len(tok.encode(attempt, add_special_tokens=False)) + 4
    cases = {"episode": (1, {}, attempt), "max_total_tokens": (3, {"max_total_tokens": room}, attempt),
             "length": (3, {}, Turn(attempt, finish="length")), "max_turns": (3, {"max_turns": 1}, attempt)}
    for finish, (env_turns, limits, turn) in cases.items():
        runner = AgentRunner(scripted_generate(tok, {0: [turn]}), tok,
                             AgentLimits(**({"max_turns": 3, "max_total_tokens": 5000} | limits)))
        [s] = runner.run([EnvEpisode(CodeFeedback(client, max_turns=env_turns), columns)], seed=0).items
        assert (s.finish_reason, round(s.reward, 4)) == (finish, round(2 / 3, 4))
