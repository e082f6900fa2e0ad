"""What follows a model turn: an episode reads the turn and replies.

    episode.start() -> the messages the trajectory starts from
    await episode.respond(assistant_text, ending) -> Reply(messages, done, reward, solved)

`ending` is "" while the trajectory may go on, or why tide ends it after this turn whatever the episode says
("length": the turn ran out of tokens; "max_turns"). The runner decides that before it asks (rollout/agent/
runner.py), so an episode never acts on a turn whose reply nobody will read:

- `ToolEpisode` parses the turn's tool calls and runs them (results as `tool` messages; a malformed call or a
  failed tool becomes an error message the model reads, and is counted); it ends at the first turn without a call.
  On an ending turn it runs nothing: a call the token limit cut short is counted as `truncated_calls`, other
  unreadable calls as parse errors, as on any turn.
- `EnvEpisode` steps an Environment (rollout/agent/environments.py) on every turn, an ending one included: the
  environment's reward is that of the trajectory should it end after the step (its contract), so what a trajectory
  earns does not depend on who ended it. The reply's messages are dropped when the trajectory ends."""
from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .environments import Environment
from .parsers import ToolParser
from .tools import ToolBox


@dataclass(frozen=True)
class Reply:
    messages: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    reward: float | None = None  # set by episodes that score themselves (environments)
    solved: bool = False  # an environment's episode ended in success (counted in env/solved, env/turns_solved)


class Episode(Protocol):
    def start(self) -> list[dict[str, Any]]: ...

    async def respond(self, assistant_text: str, ending: str = "") -> Reply: ...


class EnvEpisode:
    def __init__(self, env: Environment, columns: dict[str, Any]) -> None:
        self.env, self.columns = env, columns

    def start(self) -> list[dict[str, Any]]:
        return self.env.reset(self.columns)

    async def respond(self, assistant_text: str, ending: str = "") -> Reply:
        step = await asyncio.to_thread(self.env.step, assistant_text)  # a sandbox call must not hold the others
        return Reply(step.messages, step.done, step.reward, step.solved)


class ToolEpisode:
    """A conversation in which the model may call tools; it ends at the first turn without a call."""

    def __init__(self, messages: list[dict[str, Any]], parser: ToolParser, tools: ToolBox,
                 counts: Counter, resources: Sequence[Any] = ()) -> None:
        self.messages, self.parser, self.tools, self.counts = messages, parser, tools, counts
        self.resources = list(resources)  # closed when the trajectory ends (e.g. its python tool's session)
        self.latencies: list[float] = []

    async def close(self) -> None:
        await asyncio.gather(*[r.close() for r in self.resources])
        self.tools.close()

    def start(self) -> list[dict[str, Any]]:
        return list(self.messages)

    async def respond(self, assistant_text: str, ending: str = "") -> Reply:
        turn = self.parser.parse(assistant_text)
        cut = int(ending == "length" and turn.truncated)
        self.counts["truncated_calls"] += cut
        self.counts["parse_errors"] += len(turn.errors) - cut
        if not turn.calls and not turn.errors:  # the model answered: the conversation's own end, unless the
            return Reply(done=ending != "length")  # answer itself was cut short
        if ending:
            return Reply()
        outcomes = await self.tools.run(turn.calls)
        self.counts["calls"] += len(outcomes)
        for o in outcomes:
            self.latencies.append(o.latency_s)
            if o.failure:
                self.counts[f"failed_{o.failure}"] += 1
        texts = [o.text for o in outcomes] + [f"error: the tool call could not be read: {e}" for e in turn.errors]
        return Reply([{"role": "tool", "content": t} for t in texts])
