"""Chat-format prompts: a problem whose prompt is a list of messages is rendered for the engines with the
tokenizer's chat template (`tokenizer.apply_chat_template(..., add_generation_prompt=True)`), after
`model.system_prompt` is put first where the messages bring no system message of their own.

`model.chat_template`: `auto` (the tokenizer's own template), `none` (no template: the messages' contents one
per line, for base models) or the path of a .jinja file that replaces the tokenizer's."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Sequence

from orchestrator.config import ConfigError
from rollout.tasks import Problem, Task


class PromptRenderer:
    def __init__(self, tokenizer, chat_template: str = "auto", system_prompt: str | None = None) -> None:
        self.tokenizer, self.mode, self.system_prompt = tokenizer, chat_template, system_prompt
        self.template = (Path(chat_template).expanduser().read_text() if chat_template not in ("auto", "none")
                         else getattr(tokenizer, "chat_template", None))

    def render(self, problem: Problem) -> Problem:
        if not problem.messages:
            return problem
        messages = list(problem.messages)
        if self.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        if self.mode == "none":
            return replace(problem, prompt="\n".join(m["content"] for m in messages))
        if not self.template:
            raise ConfigError("model.chat_template is 'auto' but the model's tokenizer has no chat template: set "
                              "model.chat_template to a .jinja file, or to 'none' for a base model")
        return replace(problem, prompt=self.tokenizer.apply_chat_template(
            messages, chat_template=self.template, tokenize=False, add_generation_prompt=True))


class RenderedTask:
    """`task` with every problem it hands out (training, warm start, eval) rendered by `renderer`."""

    def __init__(self, task: Task, renderer: PromptRenderer) -> None:
        self.task, self.renderer, self.name = task, renderer, task.name

    def problems(self, seed: int, iteration: int, n: int) -> list[Problem]:
        return [self.renderer.render(p) for p in self.task.problems(seed, iteration, n)]

    def score(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[float]:
        return self.task.score(problems, completions)

    def corpus(self) -> str:
        return self.task.corpus()

    def sft_examples(self, seed: int, n: int) -> list[tuple[str, str]]:
        if hasattr(self.task, "sft_problems"):
            return [(self.renderer.render(p).prompt, p.answer) for p in self.task.sft_problems(seed, n)]
        return self.task.sft_examples(seed, n)

    def held_out(self, seed: int, n: int) -> list[Problem] | None:
        inner = getattr(self.task, "held_out", None)
        problems = inner(seed, n) if inner else None
        return None if problems is None else [self.renderer.render(p) for p in problems]
