"""`model.chat_template_kwargs` reach the chat template in every rendering tide makes -- rollout prompts,
evaluation's held-out prompts, the warm start (reference answers and an agent's demonstrations), the log-prob
probe, an agent's trajectories (its prompt and what it inserts after each reply) -- and the arguments tide sets
itself are refused by name. A Qwen3-like template writes an empty think block at the start of the model's turn
when `enable_thinking` is false (after the generation prompt, and in the turn just written, as Qwen3's does for
the last one); each path is rendered with and without the variable. No engines, no trainer."""
from __future__ import annotations

import inspect

import pytest

from orchestrator.config.schema import ConfigError, parse_config
from rollout.tasks import GuessTask, Problem
from rollout.tasks.jsonl import ShuffledProblems
from tests.rollout.rollout_helpers import chatml_tokenizer, scripted_generate

THINKING = ("{% set empty = '<think>\n\n</think>\n\n' if enable_thinking is defined and enable_thinking is false "
            "else '' %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['role'] == 'assistant' %}{{ empty }}{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{{ empty }}{% endif %}")
NO_THINKING = {"enable_thinking": False}
THINK, EMPTY_THINK, TURN = "<think>", "<think>\n\n</think>\n\n", "<|im_start|>assistant\n"


class _ChatTask(ShuffledProblems):
    """Chat-message prompts with reference answers and a held-out set, as a dataset task has them."""

    name = "chat"

    def __init__(self) -> None:
        self._problems = [Problem(f"q{i}", "", str(i + 2), messages=({"role": "user", "content": f"{i} plus 2?"},))
                          for i in range(4)]

    def held_out(self, seed: int, n: int) -> list[Problem]:
        return self._problems[:n]


class _Trainer:
    """The warm start's trainer: records what it is given."""

    def __init__(self) -> None:
        self.batches = []

    def train_step(self, batch, mode: str, lr: float) -> dict[str, float]:
        self.batches.append(batch)
        return {"loss": 1.0}

    def reset_optimizer(self) -> None:
        pass

    def snapshot_reference(self) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer():
    tok = chatml_tokenizer()
    tok.chat_template = THINKING
    return tok


def _rendered_prompts(tokenizer, kwargs: dict) -> dict[str, list[str]]:
    """Every prompt the single-completion paths render, by path, decoded."""
    from orchestrator.iteration.evaluation import held_out_problems
    from orchestrator.iteration.logprob_check import probe_problems
    from orchestrator.workers.prompts import PromptRenderer, RenderedTask
    from orchestrator.iteration.warmup import warm_start
    from trainer.config import TrainerConfig

    task = RenderedTask(_ChatTask(), PromptRenderer(tokenizer, "auto", template_kwargs=kwargs))
    trainer = _Trainer()
    warm_start(trainer, task, TrainerConfig(warmup_sft_steps=1, warmup_sft_batch=2), seed=0)
    decode = tokenizer.decode
    return {"rollout": [decode(p.prompt_ids) for p in task.problems(0, 1, 2)],
            "evaluation": [decode(p.prompt_ids) for p in held_out_problems(task, 0, 2)],
            "warm start": [decode(s.prompt_ids) for b in trainer.batches for s in b.sequences],
            "log-prob probe": [decode(p.prompt_ids) for p in probe_problems(task, 0, 2)]}


def test_every_prompt_path_renders_with_the_kwargs(tokenizer):
    plain, kwargs = _rendered_prompts(tokenizer, {}), _rendered_prompts(tokenizer, NO_THINKING)
    for path in plain:
        assert plain[path] and all(text.endswith(TURN) and THINK not in text for text in plain[path]), path
        assert kwargs[path] and all(text.endswith(f"{TURN}{EMPTY_THINK}") for text in kwargs[path]), (path, kwargs)


def _agent(tokenizer, kwargs: dict):
    from orchestrator.agents.agent_rollout import Agent
    from rollout.agent.config import AgentConfig

    return Agent(AgentConfig(environment="guess", max_turns=4), tokenizer, THINKING, None, 8, None, "guess",
                 context=None, template_kwargs=kwargs)


def _agent_renderings(tokenizer, kwargs: dict) -> dict[str, str]:
    """An agent's trajectory (prompt, and the tokens inserted after the game's reply) and a warm-start
    demonstration, decoded."""
    problem = GuessTask(high=20).problems(seed=0, iteration=1, n=1)[0]
    secret = problem.columns["secret"]
    wrong = secret % 20 + 1
    agent, end = _agent(tokenizer, kwargs), tokenizer.convert_tokens_to_ids("<|im_end|>")
    played = agent.rollout(scripted_generate(tokenizer, {0: [str(wrong), str(secret)]}, end), [problem], 1, seed=0,
                           version=0).samples.items[0]
    inserted = [t for t, m in zip(played.completion_ids, played.loss_mask) if not m]
    game = [{"role": "user", "content": problem.messages[0]["content"]}, {"role": "assistant", "content": str(wrong)},
            {"role": "user", "content": "higher" if wrong < secret else "lower"},
            {"role": "assistant", "content": str(secret)}]
    demo = agent.demonstrations([game], [end])[0]
    demo_inserted = [t for t, m in zip(demo.completion_ids, demo.loss_mask) if not m]
    return {"agent prompt": tokenizer.decode(played.prompt_ids), "agent reply": tokenizer.decode(inserted),
            "demonstration prompt": tokenizer.decode(demo.prompt_ids),
            "demonstration reply": tokenizer.decode(demo_inserted)}


def test_agent_trajectories_and_demonstrations_render_with_the_kwargs(tokenizer):
    plain, kwargs = _agent_renderings(tokenizer, {}), _agent_renderings(tokenizer, NO_THINKING)
    for path in plain:
        assert plain[path].endswith(TURN) and THINK not in plain[path], (path, plain[path])
        assert kwargs[path].endswith(f"{TURN}{EMPTY_THINK}"), (path, kwargs[path])


def _config(**model) -> dict:
    return {"name": "t", "iterations": 1, "model": model}


def test_kwargs_tide_sets_itself_are_refused_by_name():
    assert parse_config(_config(chat_template_kwargs=NO_THINKING)).model.chat_template_kwargs == NO_THINKING
    with pytest.raises(ConfigError) as e:
        parse_config(_config(chat_template_kwargs={"enable_thinking": False, "tools": [], "tokenize": True}))
    assert "model.chat_template_kwargs.tools: tide sets it itself (the agent's tool schemas" in str(e.value)
    assert "model.chat_template_kwargs.tokenize: tide sets it itself" in str(e.value)
    assert "enable_thinking:" not in str(e.value)


def test_every_argument_of_apply_chat_template_is_refused():
    """apply_chat_template's own parameters never reach the template: each is refused, none passed through."""
    from transformers import PreTrainedTokenizerBase

    named = [p.name for p in inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.values()
             if p.kind is p.POSITIONAL_OR_KEYWORD and p.name != "self"]
    for name in named + ["messages"]:
        with pytest.raises(ConfigError, match=f"model.chat_template_kwargs.{name}: tide sets it itself"):
            parse_config(_config(chat_template_kwargs={name: True}))


def test_kwargs_without_a_template_are_refused(tokenizer):
    from orchestrator.workers.prompts import PromptRenderer

    with pytest.raises(ConfigError, match=r"model.chat_template_kwargs \(enable_thinking\) .* 'none'"):
        PromptRenderer(tokenizer, "none", template_kwargs=NO_THINKING)
