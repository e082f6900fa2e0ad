"""The multi-turn rollout: every trajectory of a batch goes turn by turn -- the engine samples its turn, its
episode replies -- until each ends.

An episode says what follows a model turn (rollout/agent/episodes.py): `ToolEpisode` runs the turn's tool calls,
`EnvEpisode` steps an Environment. A trajectory ends when its episode says so, when the model's turn ends without
a call (tools), at `max_turns`, when the model's turn ran out of tokens, or when the reply would pass
`max_total_tokens` or the engines' context. Whether the turn just sampled is the last (its length, max_turns) is
decided before the episode is asked, so that no tool runs for a reply nobody reads; an environment still steps on
that turn, since its step is what scores it. The sampled tokens are never re-encoded (rollout/agent/trajectory.py),
so what the trainer trains on is what the engine sampled, plus masked inserts.

Scheduling: every trajectory's turn is sampled with its own seed and token budget, so what a trajectory samples
does not depend on which others share an engine call. In lockstep the engine is called once per turn with every
live trajectory, after all replies of the turn are in. With `overlap`, the engine is called whenever it is idle
with the trajectories whose replies are in, while other trajectories' tools run: tool time hides behind
generation (scripts/bench_agent.py). Which trajectories share a call then depends on tool timings, and batch
composition can move float results in the last bits: deterministic runs use lockstep. The engine call itself
is synchronous (the rollout group's `generate`): trajectories that become ready during a call wait for the next
one, where vLLM's asynchronous engine would take them into the running batch.

Partial trajectories (`run_open` with a segment budget; orchestrator/agents/agent_partial.py): a trajectory that has
sampled `segment_tokens` tokens in this run is set aside at its next turn boundary, after its episode's reply is
inserted, and continued by a later run -- under the weights the engines serve then, its new tokens carrying that
version -- from the very ids it holds."""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from .. import routing_capture
from ..samples import Sample, Samples
from ..tasks.base import Problem
from .episodes import EnvEpisode, Episode, Reply, ToolEpisode  # noqa: F401  (the runner's interface)
from .rendering import encode_text
from .trajectory import NotAppendOnly, Trajectory, inserted_tokens, render

log = logging.getLogger(__name__)
# generate(problems, max_new_tokens, seed) -> one Sample per problem, in order
Generate = Callable[[list[Problem], int, int], Samples]


@dataclass(frozen=True)
class AgentLimits:
    max_turns: int = 4
    max_total_tokens: int = 1024  # prompt excluded: everything sampled and inserted after it
    max_tokens_per_turn: int = 256
    max_tool_response_tokens: int = 256
    context: int | None = None  # the engines' context (prompt included): a trajectory ends before it overflows


@dataclass
class OpenTrajectory:
    """A trajectory between turns: its episode (with the episode's own state), conversation and tokens."""

    index: int  # its place in the batch that opened it (with `seed`, what its turns' seeds derive from)
    episode: Episode
    messages: list[dict[str, Any]]
    traj: Trajectory
    prompt_messages: int = 0  # how many of `messages` the episode started from
    reward: float | None = None
    solved: bool = False
    finish: str = ""
    seed: int = 0  # the seed of the run that opened it
    rank: int = 0  # its place in the current run's engine calls
    to_end: bool = True  # the current run takes it to its end (no segment budget)
    sampled_at_start: int = 0  # its sampled tokens when the current run took it over

    def continued(self) -> "OpenTrajectory":
        """This trajectory to continue in a later sampling: the same episode (its state goes on), its conversation
        and tokens copied, so that the batch that set it aside keeps reading what it held then."""
        return replace(self, messages=list(self.messages), traj=self.traj.copy())


async def _close(episodes: list[Episode]) -> None:
    await asyncio.gather(*[ep.close() for ep in episodes if hasattr(ep, "close")])


def turn_seed(seed: int, trajectory: int, turn: int) -> int:
    """The sampling seed of one turn of one trajectory: what it samples does not depend on which others are still
    running, how they are batched or how many engines share them."""
    digest = hashlib.blake2b(f"agent/{seed}/{trajectory}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**62 - 1)


class AgentRunner:
    """Runs a batch of episodes to their ends on `generate`. `overlap`: a trajectory whose reply came back joins
    the next engine call at once, while other trajectories' tools still run (the engine generates whatever is
    ready); without it every live trajectory advances one turn per engine call, in lockstep, so that which
    trajectories share an engine call is fixed by the episodes alone (deterministic runs)."""

    def __init__(self, generate: Generate, tokenizer, limits: AgentLimits, tools: list[dict] | None = None,
                 version: int = 0, overlap: bool = False, template_kwargs: dict[str, Any] | None = None) -> None:
        self.generate, self.tokenizer, self.limits = generate, tokenizer, limits
        self.tools, self.version, self.overlap = tools, version, overlap
        self.template_kwargs = template_kwargs  # the chat template's variables (model.chat_template_kwargs)
        # generate_s: seconds the engines were busy; tool_s: seconds at least one tool call or environment step
        # was running (in lockstep the two add up to the rollout; overlapped, they run at the same time)
        self.timings = Counter()
        self.outcomes: list[tuple[int, bool]] = []  # (model turns, solved) of every trajectory of the last run

    def open(self, episodes: Sequence[Episode], seed: int) -> list[OpenTrajectory]:
        """Start a trajectory per episode (its prompt rendered with the tools' schemas)."""
        out = []
        for i, ep in enumerate(episodes):
            messages = ep.start()
            prompt = render(self.tokenizer, messages, self.tools, True, self.template_kwargs)
            out.append(OpenTrajectory(i, ep, messages, Trajectory(prompt), len(messages), seed=seed, rank=i))
        return out

    def run_open(self, live: Sequence[OpenTrajectory],
                 segment_tokens: int | None = None) -> tuple[list[OpenTrajectory], list[OpenTrajectory]]:
        """Advance `live` (in this order in every engine call): (ended, set aside). A trajectory whose `to_end` is
        False is set aside at the first turn boundary after it sampled `segment_tokens` tokens in this run; an
        ended one's resources are closed, a set-aside one's kept."""
        self.timings.clear()
        for rank, x in enumerate(live):
            x.rank, x.sampled_at_start = rank, sum(x.traj.mask)
        done, aside = asyncio.run(self._run(list(live), segment_tokens))
        return sorted(done, key=lambda x: x.rank), sorted(aside, key=lambda x: x.rank)

    def run(self, episodes: Sequence[Episode], seed: int, task_ids: Sequence[str] | None = None,
            groups: Sequence[int] | None = None) -> Samples:
        """One trajectory per episode, as Samples whose completion is everything after the first prompt, with
        its loss mask and versions; `reward` is the episode's own (environments) or None (score it after), `text`
        the model's last turn (what a scorer reads) and `conversation` every message after the prompt.
        `groups[i]`: the prompt episode i answers (its Sample.prompt_index; default i). An episode's resources
        (its python session) are closed as soon as its trajectory ends."""
        done, _ = self.run_open(self.open(episodes, seed))
        self.outcomes = [(x.traj.turns, x.solved) for x in done]
        return Samples([self.sample(x, task_ids[x.index] if task_ids else str(x.index),
                                    groups[x.index] if groups else x.index) for x in done])

    async def _run(self, live: list[OpenTrajectory],
                   segment_tokens: int | None) -> tuple[list[OpenTrajectory], list[OpenTrajectory]]:
        # every trajectory's environment step may wait on I/O at once (the default pool has 6 threads); tool calls
        # run in their own tool box's threads (rollout/agent/tools.py), so that no trajectory holds what another needs
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(min(256, len(live) + 2)))
        waiting, replying, done, aside, closing = list(live), {}, [], [], []
        engine: asyncio.Task | None = None
        batch: list[OpenTrajectory] = []
        self._busy, self._busy_since = 0, 0.0
        try:
            while waiting or replying or engine:
                if engine is None and waiting and (self.overlap or not replying):
                    batch, waiting = sorted(waiting, key=lambda x: x.rank), []
                    engine = asyncio.create_task(self._generate(batch))
                finished, _ = await asyncio.wait([*replying, *([engine] if engine else [])],
                                                 return_when=asyncio.FIRST_COMPLETED)
                if engine in finished:
                    for x, s in zip(batch, engine.result().items, strict=True):
                        x.traj.add_sampled(list(s.completion_ids), list(s.logprobs), self.version)
                        if s.routed_experts is not None:
                            x.traj.routing = routing_capture.extend_record(x.traj.routing, s.routed_experts)
                        x.messages.append({"role": "assistant", "content": s.text})
                        x.finish = s.finish_reason
                        replying[asyncio.create_task(self._reply(x, self._ending(x)))] = x
                    engine = None
                for task in [t for t in finished if t in replying]:
                    x = replying.pop(task)
                    if self._advance(x, task.result()):
                        spent = sum(x.traj.mask) - x.sampled_at_start
                        if not x.to_end and segment_tokens is not None and spent >= segment_tokens:
                            aside.append(x)  # its resources stay open: a later run continues it
                        else:
                            waiting.append(x)
                    else:
                        done.append(x)
                        closing.append(asyncio.create_task(_close([x.episode])))  # its session, now
        finally:
            for task in replying:
                task.cancel()
            if engine is not None:
                await asyncio.gather(engine, return_exceptions=True)  # a thread in the engine's call: let it end
            kept = {id(x) for x in done} | {id(x) for x in aside}
            await asyncio.gather(*closing, _close([x.episode for x in live if id(x) not in kept]))
        return done, aside

    async def _generate(self, batch: list[OpenTrajectory]) -> Samples:
        t0 = time.monotonic()
        try:
            return await asyncio.to_thread(self.generate, [
                Problem(task_id=str(x.index), prompt="", answer="", prompt_ids=tuple(x.traj.all_ids),
                        seed=turn_seed(x.seed, x.index, x.traj.turns), max_new_tokens=self._budget(x)) for x in batch],
                self.limits.max_tokens_per_turn, batch[0].seed)
        finally:
            self.timings["generate_s"] += time.monotonic() - t0

    def _ending(self, x: OpenTrajectory) -> str:
        """Why the trajectory ends after the turn it just sampled, whatever its episode replies; or ""."""
        return "length" if x.finish == "length" else "max_turns" if x.traj.turns >= self.limits.max_turns else ""

    async def _reply(self, x: OpenTrajectory, ending: str) -> Reply:
        if self._busy == 0:
            self._busy_since = time.monotonic()
        self._busy += 1
        try:
            return await x.episode.respond(x.messages[-1]["content"], ending)
        finally:
            self._busy -= 1
            if self._busy == 0:
                self.timings["tool_s"] += time.monotonic() - self._busy_since

    def _advance(self, x: OpenTrajectory, reply: Reply) -> bool:
        """Take an episode's reply to the trajectory's last turn: True when the trajectory goes on."""
        if reply.reward is not None:
            x.reward = reply.reward
        x.solved = x.solved or reply.solved
        why = "episode" if reply.done else self._ending(x)
        if not why:
            why = self._insert(x, reply.messages)
        if why:
            x.finish = why
        return not why

    def _budget(self, x: OpenTrajectory) -> int:
        room = [self.limits.max_tokens_per_turn, self.limits.max_total_tokens - len(x.traj.ids)]
        if self.limits.context:
            room.append(self.limits.context - len(x.traj.all_ids))
        return max(1, min(room))

    def _insert(self, x: OpenTrajectory, new: list[dict[str, Any]]) -> str:
        """Append the reply's tokens; the reason the trajectory ends instead, or ""."""
        new = [self._clip(m) for m in new]
        try:
            ids = inserted_tokens(self.tokenizer, x.messages, new, x.traj.last_turn, self.tools, self.template_kwargs)
        except NotAppendOnly as e:
            log.warning("trajectory %d ends: %s", x.index, e)
            return "template"
        if len(x.traj.ids) + len(ids) >= self.limits.max_total_tokens:
            return "max_total_tokens"
        if self.limits.context and len(x.traj.all_ids) + len(ids) >= self.limits.context:
            return "context"
        x.traj.add_inserted(ids)
        x.messages.extend(new)
        return ""

    def _clip(self, message: dict[str, Any]) -> dict[str, Any]:
        """A tool's result cut to its first max_tool_response_tokens tokens; an environment's reply to its first
        line (what happened) and its last tokens (where errors and verdicts are). Counted and cut as the rendering
        encodes contents (rollout/agent/rendering.py)."""
        ids = encode_text(self.tokenizer, message["content"])  # as the rendering encodes it: text, never control
        n = self.limits.max_tool_response_tokens
        if len(ids) <= n:
            return message
        if message.get("role") == "tool":
            return {**message, "content": self.tokenizer.decode(ids[:n]) + f"\n... ({len(ids) - n} tokens cut)"}
        head = message["content"].split("\n", 1)[0]
        keep = max(0, n - len(encode_text(self.tokenizer, head)))
        tail = self.tokenizer.decode(ids[len(ids) - keep:]) if keep else ""
        return {**message, "content": f"{head}\n... ({len(ids) - keep} tokens cut)\n{tail}"}

    @staticmethod
    def sample(x: OpenTrajectory, task_id: str, prompt_index: int) -> Sample:
        """The trajectory so far as a Sample: its completion everything after the first prompt, with its loss mask
        and versions; `text` the model's last turn."""
        t = x.traj
        after_prompt = x.messages[x.prompt_messages:]
        last = next((m["content"] for m in reversed(after_prompt) if m["role"] == "assistant"), "")
        return Sample(prompt_index=prompt_index, task_id=task_id, prompt_ids=list(t.prompt_ids),
                      completion_ids=list(t.ids), logprobs=list(t.logprobs),
                      text=last, reward=x.reward, finish_reason=x.finish, loss_mask=list(t.mask),
                      versions=list(t.versions), conversation=after_prompt,
                      routed_experts=routing_capture.fit_record(t.routing, len(t.all_ids) - 1))


def agent_metrics(samples: Samples, counts: Counter, latencies: Sequence[float],
                  outcomes: Sequence[tuple[int, bool]] = ()) -> dict[str, float]:
    """One iteration's agent metrics, under TRL's names where it has them (`tools/call_frequency`,
    `tools/failure_frequency`): calls, parse errors and calls cut short by the token limit (not run) per trajectory,
    the share of calls that failed, timeouts,
    tool latency p50/p95, turns per trajectory (mean, max) and the share of completion tokens tide inserted; with
    environments' `outcomes` (turns, solved) per trajectory, the solved share and the mean turns of a solved one
    (NaN when none was)."""
    n = max(len(samples), 1)
    calls = counts.get("calls", 0)
    failed = sum(v for k, v in counts.items() if k.startswith("failed_"))
    turns = [sum(1 for a, b in zip([0] + s.loss_mask, s.loss_mask) if b == 1 and a != 1) for s in samples
             if s.loss_mask]
    tokens = sum(len(s.loss_mask or []) for s in samples)
    lat = sorted(latencies)

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else 0.0
    return {"tools/call_frequency": calls / n, "tools/failure_frequency": failed / calls if calls else 0.0,
            "tools/parse_errors": counts.get("parse_errors", 0) / n,
            "tools/truncated_calls": counts.get("truncated_calls", 0) / n,
            "tools/timeouts": float(counts.get("failed_timeout", 0)),
            "tools/latency_p50_s": pct(0.5), "tools/latency_p95_s": pct(0.95),
            "turns/mean": sum(turns) / len(turns) if turns else 0.0, "turns/max": float(max(turns, default=0)),
            "masked_token_share": sum(m == 0 for s in samples for m in (s.loss_mask or [])) / tokens if tokens else 0.0,
            **_outcome_metrics(outcomes)}


def _outcome_metrics(outcomes: Sequence[tuple[int, bool]]) -> dict[str, float]:
    if not outcomes:
        return {}
    solved = [turns for turns, ok in outcomes if ok]
    return {"env/solved": len(solved) / len(outcomes),
            "env/turns_solved": sum(solved) / len(solved) if solved else float("nan")}

