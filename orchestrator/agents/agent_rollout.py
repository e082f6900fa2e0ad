"""The `agent:` section in the loop: each iteration's rollout as multi-turn trajectories (rollout/agent/) on the
run's engines, `n_samples` per prompt (a prompt's trajectories form its group).

- tools: every trajectory is a conversation starting from the problem's prompt (after `model.system_prompt`), with
  the tools' schemas passed to the chat template; `python` gets a sandbox session of the trajectory's own, closed
  when it ends. The model's last turn is what the task's scorer or `rewards:` score.
- environment: the environment starts the conversation from the problem's columns and scores the trajectory
  itself (`guess` with task.name guess, `code_feedback` with task.name code or a dataset with `prompt` and `tests`).

Every token keeps the policy version that sampled it: the iteration whose weights the engines serve (the run's
iteration - 1; the inserted tokens -1)."""
from __future__ import annotations

import inspect
import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrator.config.schema import ConfigError
from orchestrator.workers.prompts import with_system_prompt
from orchestrator.rewards.phase import RewardPhase
from rollout.agent import (AgentLimits, AgentRunner, CodeFeedback, EnvEpisode, Episode, GuessingGame, PythonSession,
                           Tool, ToolBox, ToolCall, ToolEpisode, agent_metrics, demonstration, get_parser,
                           load_tool)
from rollout.agent.config import AgentConfig
from rollout.samples import Samples
from rollout.tasks import Problem
from trainer.batch import TokenDistribution, TrainSequence


@dataclass
class Rollout:
    """One iteration's samples; for an agent, with its metrics and the rollout's time split into the engine's
    turns (`generate`) and the tools' or environment's replies (`tools`), in seconds."""

    samples: Samples
    metrics: dict[str, float] = field(default_factory=dict)
    parts: dict[str, float] = field(default_factory=dict)


class Agent:
    def __init__(self, cfg: AgentConfig, tokenizer, chat_template: str | None, system_prompt: str | None,
                 max_new_tokens: int, sandbox_url: str | None, task_name: str, context: int | None = None,
                 deterministic: bool = True, template_kwargs: dict[str, Any] | None = None) -> None:
        if not chat_template:
            raise ConfigError("agent: multi-turn trajectories are rendered with a chat template; the model's "
                              "tokenizer has none and model.chat_template names none (set it to a .jinja file)")
        if cfg.environment == "guess" and task_name != "guess":
            raise ConfigError(f"agent.environment guess plays the problems of task.name guess, not {task_name!r}")
        if cfg.environment == "code_feedback" and task_name not in ("code", "dataset", "jsonl"):
            raise ConfigError(f"agent.environment code_feedback needs coding problems with tests (task.name code, or "
                              f"a dataset with `prompt` and `tests` columns), not task.name {task_name!r}")
        self.cfg, self.system_prompt = cfg, system_prompt
        self.overlap = (not deterministic) if cfg.overlap is None else cfg.overlap
        tokenizer.chat_template = chat_template  # the one template every rendering uses (model.chat_template)
        self.template_kwargs = dict(template_kwargs or {})  # and its variables (model.chat_template_kwargs)
        self.tokenizer = tokenizer
        self.limits = AgentLimits(max_turns=cfg.max_turns, max_total_tokens=cfg.max_total_tokens,
                                  max_tokens_per_turn=cfg.max_tokens_per_turn or max_new_tokens,
                                  max_tool_response_tokens=cfg.max_tool_response_tokens, context=context)
        self.parser = get_parser(cfg.tool_parser)
        try:
            self.user_tools: list[Tool] = [load_tool(spec) for spec in cfg.tools if spec != "python"]
        except ValueError as e:
            raise ConfigError(f"agent.tools: {e}") from None
        self.client = None
        if cfg.uses_sandbox:
            from sandbox.client import SandboxClient

            if not sandbox_url:
                raise ConfigError("agent: the python tool and code_feedback need the sandbox service")
            self.client = SandboxClient(sandbox_url)
        python = [PythonSession(None).tool()] if "python" in cfg.tools else []
        self.declared: dict[str, Tool] = {t.name: t for t in python + self.user_tools}  # what the model is told of
        self.schemas = [t.schema for t in self.declared.values()] or None

    @property
    def scores_itself(self) -> bool:
        return self.cfg.environment is not None

    def close(self) -> None:
        if self.client is not None:
            self.client.close()

    def rollout(self, generate: Callable[[list[Problem], int, int], Samples], problems: list[Problem],
                n_samples: int, seed: int, version: int) -> Rollout:
        """`generate(problems, max_new_tokens, seed)`: one completion per problem from the engines."""
        counts: Counter = Counter()
        episodes, groups = [], []
        for g, p in enumerate(problems):
            for _ in range(n_samples):
                episodes.append(self.episode(p, counts))
                groups.append(g)
        runner = self.runner(generate, version)
        samples = runner.run(episodes, seed, task_ids=[problems[g].task_id for g in groups], groups=groups)
        latencies = [t for ep in episodes for t in getattr(ep, "latencies", [])]
        metrics = agent_metrics(samples, counts, latencies, runner.outcomes if self.scores_itself else ())
        return Rollout(samples, metrics, {"generate": runner.timings["generate_s"], "tools": runner.timings["tool_s"]})

    def demonstrations(self, conversations: list[list[dict[str, str]]], end_of_turn: list[int]) -> list[TrainSequence]:
        """Written conversations (the first message the prompt) as warm-start sequences laid out as rollouts lay
        out trajectories: the model's turns trained on, the rest masked."""
        out = []
        for messages in conversations:
            messages = with_system_prompt([self._as_written(m) for m in messages], self.system_prompt)
            prompt = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
            t = demonstration(self.tokenizer, messages, prompt, end_of_turn or [self.tokenizer.eos_token_id],
                              self.schemas, self.template_kwargs)
            out.append(TrainSequence(t.prompt_ids, t.ids, loss_mask=[float(m) for m in t.mask]))
        return out

    def check_demonstrations(self, labelled: Sequence[tuple[str, list[dict[str, Any]]]]) -> None:
        """Refuses (ConfigError) written demonstrations, each with where it is written, that call a tool this agent
        does not have or with arguments its signature does not take: the warm start would teach calls that fail."""
        tools = ", ".join(self.declared) or f"none (agent.environment {self.cfg.environment})"
        todo = ("set trainer.warmup_sft_steps: 0 (no warm start), add the tool to agent.tools, or give demonstrations "
                "that call your tools (task.name dataset with task.demonstrations_field: docs/agents.md)")
        for where, messages in labelled:
            for call in (c for m in messages for c in m.get("tool_calls") or ()):
                name, arguments = call["function"]["name"], call["function"]["arguments"]
                shown = _shown_call(name, arguments)
                tool = self.declared.get(name)
                if tool is None:
                    raise ConfigError(f"trainer.warmup_sft_steps: the warm start's demonstrations call a tool the "
                                      f"agent does not have: {where} calls {shown}; agent.tools: {tools}. To "
                                      f"train on calls that can succeed, {todo}")
                try:
                    inspect.signature(tool.fn).bind(**arguments)
                except TypeError as e:
                    raise ConfigError(f"trainer.warmup_sft_steps: {where} calls {shown}, which {name}"
                                      f"{inspect.signature(tool.fn)} does not take ({e}); correct the "
                                      f"demonstration's arguments, or {todo}") from None

    def _as_written(self, message: dict[str, Any]) -> dict[str, Any]:
        """A demonstration's assistant message with OpenAI `tool_calls` as the text the model writes for them
        (what agent.tool_parser reads back)."""
        if message.get("role") != "assistant" or not message.get("tool_calls"):
            return message
        calls = [ToolCall(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
        return {"role": "assistant", "content": (message.get("content") or "") + self.parser.format(calls)}

    def runner(self, generate: Callable[[list[Problem], int, int], Samples], version: int) -> AgentRunner:
        """A runner of this agent's trajectories on `generate`, their sampled tokens marked `version`."""
        return AgentRunner(generate, self.tokenizer, self.limits, self.schemas, version, self.overlap,
                           self.template_kwargs)

    @staticmethod
    def continue_episode(episode: Episode, counts: Counter) -> None:
        """An episode set aside by a partial rollout, continued in a later sampling: its tool calls are counted and
        timed in that sampling's metrics."""
        if isinstance(episode, ToolEpisode):
            episode.counts, episode.latencies = counts, []

    def episode(self, problem: Problem, counts: Counter) -> Episode:
        if self.cfg.environment is not None:
            return _SystemFirst(EnvEpisode(self._environment(), env_columns(problem)), self.system_prompt)
        messages = with_system_prompt(problem.messages or [{"role": "user", "content": problem.prompt}],
                                      self.system_prompt)
        resources, tools = [], list(self.user_tools)
        if "python" in self.cfg.tools:
            py = PythonSession(self.client, {"memory_mb": self.cfg.python.memory_mb}, self.cfg.python.session_ttl_s,
                               self.cfg.python.cell_timeout_s)
            resources.append(py)
            tools.insert(0, py.tool())
        # a tool's output is cut to max_tool_response_tokens by the runner; the characters' bound keeps a flood
        # from being tokenised whole first
        box = ToolBox(tools, timeout_s=self.cfg.tool_timeout_s, max_chars=16 * self.cfg.max_tool_response_tokens,
                      max_parallel_calls=self.cfg.max_parallel_calls)
        return ToolEpisode(messages, self.parser, box, counts, resources)

    def _environment(self):
        if self.cfg.environment == "guess":
            return GuessingGame(max_turns=self.cfg.max_turns)
        return CodeFeedback(self.client, max_turns=self.cfg.max_turns)


def _shown_call(name: str, arguments: dict[str, Any], limit: int = 120) -> str:
    text = f"{name}({', '.join(f'{k}={v!r}' for k, v in arguments.items())})"
    return text if len(text) <= limit else text[:limit] + "...)"


class _SystemFirst:
    """An environment's episode with `model.system_prompt` put before the messages it starts from."""

    def __init__(self, episode: EnvEpisode, system_prompt: str | None) -> None:
        self.episode, self.system_prompt = episode, system_prompt

    def start(self) -> list[dict[str, Any]]:
        return with_system_prompt(self.episode.start(), self.system_prompt)

    async def respond(self, assistant_text: str, ending: str = ""):
        return await self.episode.respond(assistant_text, ending)


def env_columns(problem: Problem) -> dict[str, Any]:
    """What an environment starts from: the problem's columns, its prompt's text, and a coding problem's test spec
    (the code task's answer is a JSON object with `tests`)."""
    prompt = problem.messages[-1]["content"] if problem.messages else problem.prompt
    columns: dict[str, Any] = {"prompt": prompt, "answer": problem.answer}
    try:
        spec = json.loads(problem.answer)
    except (TypeError, ValueError):
        spec = None
    if isinstance(spec, dict):
        columns |= {k: spec[k] for k in ("tests", "language") if k in spec}
    return columns | dict(problem.columns)


def episode_rewards(samples: Samples) -> RewardPhase:
    """The reward phase of environments that scored their trajectories themselves."""
    values = [s.reward for s in samples]
    if any(v is None for v in values):
        raise RuntimeError("an environment ended a trajectory without a reward")
    return RewardPhase({"reward_mean": sum(values) / len(values) if values else float("nan")},
                       values={"the environment": values})


def engine_turns(engines, sampling: TokenDistribution) -> Callable[[list[Problem], int, int], Samples]:
    """The runner's `generate` on the run's engines: one completion per trajectory, from the run's distribution."""
    return lambda problems, max_new_tokens, seed: engines.generate(problems, 1, max_new_tokens, sampling, seed)
