"""Multi-turn rollouts (rollout/agent/runner.py) on the session's real engine: every trajectory's trained tokens
are exactly the engine's sampled tokens plus the inserted ones, with masks, versions and behaviour log-probs that
the engine itself reproduces; and the tool loop on scripted turns: calls, malformed calls and failing tools all
become messages and counts, never a stopped rollout."""
from __future__ import annotations

from collections import Counter

import pytest
import ray
from rollout_helpers import scripted_generate

from rollout.agent import GuessingGame, HermesParser, ToolBox, tool_from_function
from rollout.agent.runner import AgentLimits, AgentRunner, EnvEpisode, ToolEpisode, agent_metrics
from rollout.samples import Samples


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def test_guessing_games_on_the_engine_keep_every_sampled_token(rollout_engine, tokenizer):
    calls: list[tuple[list, Samples]] = []

    # the tiny random model seldom ends a turn on its own: a turn ends at its first digit (the stop token is kept
    # as sampled, and the template closes the turn), so that games go on for several turns
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]

    def generate(problems, max_new, seed):
        out = ray.get(rollout_engine.generate.remote(problems, 1, max_new, 1.0, seed, 1.0, 0, (), digits),
                      timeout=300)
        calls.append(([(p.task_id, tuple(p.prompt_ids)) for p in problems], out))
        return out

    runner = AgentRunner(generate, tokenizer, AgentLimits(max_turns=3, max_total_tokens=300, max_tokens_per_turn=24),
                         version=7)
    episodes = [EnvEpisode(GuessingGame(high=9, max_turns=3), {"secret": 1 + i % 9}) for i in range(6)]
    samples = runner.run(episodes, seed=11)
    assert len(samples) == 6 and len(calls) >= 2  # at least one trajectory went on to a second turn
    sampled_for = {key: s for keys, out in calls for key, s in zip(keys, out.items)}  # (trajectory, prefix) -> turn
    for traj in samples:
        pos = turns = 0
        while pos < len(traj.completion_ids):
            # the engine sampled this turn from exactly the trajectory so far: nothing decoded and re-encoded
            s = sampled_for[(str(traj.prompt_index), tuple(traj.prompt_ids + traj.completion_ids[:pos]))]
            n = len(s.completion_ids)
            assert traj.completion_ids[pos:pos + n] == s.completion_ids and traj.loss_mask[pos:pos + n] == [1] * n
            assert traj.logprobs[pos:pos + n] == s.logprobs and traj.versions[pos:pos + n] == [7] * n
            pos, turns = pos + n, turns + 1
            inserted = 0
            while pos + inserted < len(traj.loss_mask) and traj.loss_mask[pos + inserted] == 0:
                inserted += 1
            assert traj.versions[pos:pos + inserted] == [-1] * inserted
            assert traj.logprobs[pos:pos + inserted] == [0.0] * inserted
            pos += inserted
        assert 1 <= turns <= 3 and traj.finish_reason in ("episode", "length", "max_turns")
        assert traj.reward is not None and 0 <= traj.reward <= 1
    # the engine gives the sampled tokens of a whole multi-turn trajectory the log-probs it sampled them with
    multi = [s for s in samples if 0 in s.loss_mask]
    assert multi, "no trajectory had a second turn"
    rescored = ray.get(rollout_engine.score_sequences.remote([s.prompt_ids for s in multi],
                                                             [s.completion_ids for s in multi]), timeout=300)
    for s, lps in zip(multi, rescored):
        gaps = [abs(a - b) for a, b, m in zip(lps, s.logprobs, s.loss_mask) if m]
        assert max(gaps) <= 1e-4, max(gaps)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def fails(x: int) -> int:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError("boom")


def test_tool_calls_malformed_calls_and_failing_tools_become_messages(tokenizer):
    """Scripted model turns (a test double for the engine's sampling only), the real parser, tools and template."""
    script = {0: ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', "<tool_call>{oops</tool_call>",
                  "The answer."],
              1: ['<tool_call>{"name": "fails", "arguments": {"x": 1}}</tool_call>', "done"]}
    generate = scripted_generate(tokenizer, script)

    counts = Counter()
    box = ToolBox([tool_from_function(add), tool_from_function(fails)])
    runner = AgentRunner(generate, tokenizer, AgentLimits(max_turns=5, max_total_tokens=2000), tools=box.schemas)
    episodes = [ToolEpisode([{"role": "user", "content": q}], HermesParser(), box, counts) for q in ("2+3?", "go")]
    samples = runner.run(episodes, seed=0).items
    assert [s.finish_reason for s in samples] == ["episode", "episode"]
    assert counts == Counter(calls=2, parse_errors=1, failed_error=1)
    text0 = tokenizer.decode(samples[0].completion_ids)
    assert "tool: 5" in text0 and "could not be read" in text0 and text0.count("assistant: ") == 2
    assert "RuntimeError: boom" in tokenizer.decode(samples[1].completion_ids)
    for s in samples:  # inserted tokens carry no log-prob and no version
        assert all((m == 1) == (v == 0) for m, v in zip(s.loss_mask, s.versions))
    lat = [x for ep in episodes for x in ep.latencies]
    m = agent_metrics(Samples(samples), counts, lat)
    assert (m["tools/call_frequency"], m["tools/failure_frequency"], m["tools/parse_errors"]) == (1.0, 0.5, 0.5)
    assert (m["turns/mean"], m["turns/max"]) == (2.5, 3.0) and len(lat) == 2
    share = sum(x == 0 for s in samples for x in s.loss_mask) / sum(len(s.loss_mask) for s in samples)
    assert m["masked_token_share"] == share and 0 < share < 1


def test_overlap_generates_for_some_while_others_tools_run_and_samples_the_same(tokenizer):
    """With `overlap`, the engine is called for trajectories whose tools answered while another's tool still runs
    (recorded, not timed), and every trajectory comes out token for token as in lockstep: each turn has its own
    seed and budget, whatever shares its engine call. Trajectories' sessions close as each ends."""
    import asyncio
    import threading

    running: set[int] = set()
    lock = threading.Lock()
    slow_done = threading.Event()

    async def lookup(key: int) -> int:
        """Look a number up (slowly for key 0, a stand-in for a remote API).

        Args:
            key: which number
        """
        with lock:
            running.add(key)
        if key == 0:
            for _ in range(400):  # until the others have had two more engine calls, 4 s at most
                if slow_done.is_set():
                    break
                await asyncio.sleep(0.01)
        with lock:
            running.discard(key)
        return key * 10

    call = '<tool_call>{"name": "lookup", "arguments": {"key": %d}}</tool_call>'
    script = {i: [call % i, call % i, f"{i}0"] for i in range(4)}

    def run(overlap: bool):
        inner, calls = scripted_generate(tokenizer, script), []

        def generate(problems, max_new, seed):
            with lock:
                calls.append(([int(p.task_id) for p in problems], sorted(running)))
                if overlap and sum(1 for _, busy in calls if 0 in busy) >= 2:
                    slow_done.set()
            return inner(problems, max_new, seed)

        class Closing:
            closed: list[int] = []

            def __init__(self, i):
                self.i = i

            async def close(self):
                Closing.closed.append(self.i)

        box = ToolBox([tool_from_function(lookup)])
        episodes = [ToolEpisode([{"role": "user", "content": str(i)}], HermesParser(), box, Counter(), [Closing(i)])
                    for i in range(4)]
        runner = AgentRunner(generate, tokenizer, AgentLimits(max_turns=4, max_total_tokens=2000), tools=box.schemas,
                             overlap=overlap)
        samples = runner.run(episodes, seed=3).items
        return samples, calls, Closing.closed, runner.timings

    slow_done.clear()
    locked, locked_calls, _, _ = run(overlap=False)
    assert all(busy == [] for _, busy in locked_calls)  # lockstep: no engine call while a tool runs
    slow_done.clear()
    overlapped, calls, closed, timings = run(overlap=True)
    assert any(0 in busy and 0 not in batch for batch, busy in calls), calls  # others generated meanwhile
    assert closed[-1] == 0 and sorted(closed) == [0, 1, 2, 3]  # each closed when it ended, the slow one last
    for a, b in zip(locked, overlapped, strict=True):
        assert (a.completion_ids, a.loss_mask, a.logprobs, a.text) == (b.completion_ids, b.loss_mask, b.logprobs, b.text)
    assert timings["generate_s"] > 0 and timings["tool_s"] > 0


def _call(name: str, **arguments) -> str:
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def test_a_turn_the_trajectory_ends_after_runs_no_tool(tokenizer):
    """Whether a turn is the last (its tokens ran out, max_turns) is decided before its calls would run: no tool
    runs for a reply nobody reads, and a call the token limit cut short is counted as truncated, not as the
    model's parse error."""
    from rollout_helpers import Turn

    ran = []

    def count(tag: str) -> str:
        """Count a call.

        Args:
            tag: which call
        """
        ran.append(tag)
        return "counted"

    script = {0: [Turn(_call("count", tag="cut") + '<tool_call>{"name": "count", "argu', finish="length")],
              1: [_call("count", tag="t1"), _call("count", tag="last")],
              2: [_call("count", tag="t2"), "the answer is 4"],  # an answer on the last turn ends it as its own
              3: [Turn("the answer is", finish="length")]}
    counts = Counter()
    box = ToolBox([tool_from_function(count)])
    runner = AgentRunner(scripted_generate(tokenizer, script), tokenizer,
                         AgentLimits(max_turns=2, max_total_tokens=2000), tools=box.schemas)
    episodes = [ToolEpisode([{"role": "user", "content": str(i)}], HermesParser(), box, counts) for i in range(4)]
    samples = runner.run(episodes, seed=0).items
    assert [s.finish_reason for s in samples] == ["length", "max_turns", "episode", "length"]
    assert sorted(ran) == ["t1", "t2"]  # neither the cut turn's complete call nor the last turn's ran
    assert (counts["calls"], counts["truncated_calls"], counts["parse_errors"]) == (2, 1, 0)
    m = agent_metrics(Samples(samples), counts, [])
    assert (m["tools/truncated_calls"], m["tools/parse_errors"], m["tools/call_frequency"]) == (0.25, 0.0, 0.5)


def test_a_stateful_tools_calls_of_one_turn_run_in_order_one_at_a_time(tokenizer):
    """Calls to a stateful tool (one interpreter) run one after another in the order the model wrote them, however
    long each takes; a stateless tool's run together."""
    import asyncio
    import time

    events: list[str] = []

    async def cell(code: str, seconds: float) -> str:
        """Run a cell.

        Args:
            code: the cell
            seconds: how long it takes
        """
        events.append(f"start {code}")
        await asyncio.sleep(seconds)
        events.append(f"end {code}")
        return code

    async def lookup(key: str, seconds: float) -> str:
        """Look a key up.

        Args:
            key: the key
            seconds: how long it takes
        """
        await asyncio.sleep(seconds)
        return key

    turn = (_call("cell", code="x = 1", seconds=0.3) + _call("lookup", key="a", seconds=0.3)
            + _call("cell", code="print(x)", seconds=0.0) + _call("lookup", key="b", seconds=0.3))
    box = ToolBox([tool_from_function(cell, stateful=True), tool_from_function(lookup)])
    counts = Counter()
    runner = AgentRunner(scripted_generate(tokenizer, {0: [turn, "done"]}), tokenizer,
                         AgentLimits(max_turns=3, max_total_tokens=4000), tools=box.schemas)
    episode = ToolEpisode([{"role": "user", "content": "0"}], HermesParser(), box, counts)
    t0 = time.monotonic()
    sample = runner.run([episode], seed=0).items[0]
    assert events == ["start x = 1", "end x = 1", "start print(x)", "end print(x)"]
    assert counts["calls"] == 4 and time.monotonic() - t0 < 0.55  # the lookups ran beside the cells (0.3 s each)
    text = tokenizer.decode(sample.completion_ids)
    assert text.index("tool: x = 1") < text.index("tool: a") < text.index("tool: print(x)") < text.index("tool: b")


def test_one_trajectorys_slow_calls_leave_a_neighbours_call_alone(tokenizer):
    """A trajectory whose sync tool blocks (each call past the tool timeout, its thread held after it) makes many
    calls in one turn: its calls run at most max_parallel_calls at once, in threads of its own, and a neighbour's
    quick call is answered at once, not queued behind them (which made it time out)."""
    import threading
    import time

    release = threading.Event()
    lock = threading.Lock()
    running = [0, 0]  # now, most at once

    def stall(n: int) -> str:
        """Block.

        Args:
            n: which call
        """
        with lock:
            running[0] += 1
            running[1] = max(running)
        release.wait(3.0)
        with lock:
            running[0] -= 1
        return "late"

    def quick() -> str:
        """Answer at once."""
        return "quick"

    script = {0: ["".join(_call("stall", n=k) for k in range(8)), "done"], 1: [_call("quick"), "done"]}
    counts = Counter()
    episodes = []
    for i in range(2):
        box = ToolBox([tool_from_function(stall), tool_from_function(quick)], timeout_s=1.0, max_parallel_calls=3)
        episodes.append(ToolEpisode([{"role": "user", "content": str(i)}], HermesParser(), box, counts))
    runner = AgentRunner(scripted_generate(tokenizer, script), tokenizer,
                         AgentLimits(max_turns=3, max_total_tokens=9000), tools=episodes[0].tools.schemas)
    try:
        t0 = time.monotonic()
        samples = runner.run(episodes, seed=0).items
        took = time.monotonic() - t0
    finally:
        release.set()
    assert "tool: quick" in tokenizer.decode(samples[1].completion_ids)
    assert episodes[1].latencies[0] < 0.5  # not queued behind the neighbour's blocked threads
    assert counts["failed_timeout"] == 8 and running[1] <= 3  # the slow trajectory held at most its 3 threads
    assert took < 8  # the rollout did not wait for the hung threads (8 calls x 3 s)


def test_the_guessing_games_reward_is_what_it_earned_whoever_ends_the_game(tokenizer):
    """The environments' contract (rollout/agent/environments.py), for `guess`: a step's reward is the game's
    should it end after the step. A find in a turn cut by the token limit earns what a find earns; a game tide
    ends before a find (max_turns, max_total_tokens, a turn cut short) earns 0, as a game never won does."""
    from rollout_helpers import Turn

    def play(turns, **limits):
        runner = AgentRunner(scripted_generate(tokenizer, {0: turns}), tokenizer,
                             AgentLimits(**({"max_turns": 8, "max_total_tokens": 2000} | limits)))
        [s] = runner.run([EnvEpisode(GuessingGame(high=9, max_turns=8), {"secret": 3})], seed=0).items
        return s.finish_reason, s.reward

    found = GuessingGame(max_turns=8).reward(2)
    assert play(["5", "3"]) == ("episode", found)
    assert play(["5", Turn("3", finish="length")]) == ("episode", found)  # stepped, and it found the number
    assert play(["5", Turn("4", finish="length")]) == ("length", 0.0)
    assert play(["5", "4", "2"], max_turns=2) == ("max_turns", 0.0)
    room = len(tokenizer.encode("5", add_special_tokens=False)) + 2
    assert play(["5", "3"], max_total_tokens=room) == ("max_total_tokens", 0.0)
