"""Prompts as the engines see them. Every problem is rendered to token ids here, once, on the driver, so that
training, warm start, probe and eval prompts are tokenised the same way and never re-tokenised by the engines:

- a problem whose prompt is a list of chat messages goes through the tokenizer's chat template
  (`apply_chat_template(..., add_generation_prompt=True)`), after `model.system_prompt` is put first where the
  messages bring no system message of their own; the rendered text is tokenised without adding special tokens,
  as transformers does for `apply_chat_template(tokenize=True)` (a template that writes BOS gets it once);
- a plain text prompt is tokenised as vLLM tokenises a text prompt (special tokens added: BOS where the
  tokenizer adds one).

`model.chat_template`: `auto` (the tokenizer's own template), `none` (no template: the messages' contents one
per line, for base models) or the path of a .jinja file that replaces the tokenizer's. `model.chat_template_kwargs`
are the template's variables in every rendering here, as in the agent's (rollout/agent/rendering.py).

`rollout.max_prompt_tokens`: a longer prompt is skipped (`overlong_prompts: skip`, dropped from its batch) or
truncated to its last `max_prompt_tokens` tokens (`truncate`: the end of a chat prompt holds the question and
the generation prompt); both are counted (`prompts_skipped`, `prompts_truncated` in metrics).

The end-of-turn token of a chat template (what follows an assistant message: `<|im_end|>`, `<|eot_id|>`, ...) is
found by rendering a conversation; the engines stop on it and warm-start completions of chat prompts end with
it (plain prompts' with the end-of-sequence token)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from orchestrator.config.schema import ConfigError
from rollout.tasks import Problem, Task

Overlong = Literal["skip", "truncate"]
_MARK = "\x00tide-end-of-turn-probe\x00"


@dataclass
class RenderCounts:
    truncated: int = 0
    skipped: int = 0

    def metrics(self) -> dict[str, int]:
        return {"prompts_truncated": self.truncated, "prompts_skipped": self.skipped}


def with_system_prompt(messages, system_prompt: str | None) -> list[dict]:
    """`messages` with `model.system_prompt` put first, where they bring no system message of their own."""
    messages = list(messages)
    if system_prompt and (not messages or messages[0]["role"] != "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


class PromptRenderer:
    def __init__(self, tokenizer, chat_template: str = "auto", system_prompt: str | None = None,
                 max_prompt_tokens: int | None = None, overlong: Overlong = "skip",
                 template_kwargs: Mapping[str, Any] | None = None) -> None:
        self.tokenizer, self.mode, self.system_prompt = tokenizer, chat_template, system_prompt
        self.max_prompt_tokens, self.overlong = max_prompt_tokens, overlong
        self.template = (Path(chat_template).expanduser().read_text() if chat_template not in ("auto", "none")
                         else getattr(tokenizer, "chat_template", None))
        self.template_kwargs = dict(template_kwargs or {})
        if self.template_kwargs and chat_template == "none":
            raise ConfigError(f"model.chat_template_kwargs ({', '.join(self.template_kwargs)}) are variables of a "
                              f"chat template, and model.chat_template 'none' renders with none: remove them, or "
                              f"set model.chat_template to 'auto' or a .jinja file")

    def _uses_template(self, problem: Problem) -> bool:
        return bool(problem.messages) and self.mode != "none"

    def text(self, problem: Problem) -> str:
        if not problem.messages:
            return problem.prompt
        messages = with_system_prompt(problem.messages, self.system_prompt)
        if self.mode == "none":
            return "\n".join(m["content"] for m in messages)
        if not self.template:
            raise ConfigError("model.chat_template is 'auto' but the model's tokenizer has no chat template: set "
                              "model.chat_template to a .jinja file, or to 'none' for a base model")
        return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=True, **self.template_kwargs)

    def render(self, problem: Problem) -> tuple[Problem | None, bool]:
        """(the problem with its rendered text and token ids, whether they were truncated); None when skipped."""
        text = self.text(problem)
        ids = self.tokenizer(text, add_special_tokens=not self._uses_template(problem)).input_ids
        limit = self.max_prompt_tokens
        if limit is not None and len(ids) > limit:
            if self.overlong == "skip":
                return None, False
            return replace(problem, prompt=text, prompt_ids=tuple(ids[-limit:])), True
        return replace(problem, prompt=text, prompt_ids=tuple(ids)), False

    def render_all(self, problems: Sequence[Problem]) -> tuple[list[Problem], RenderCounts]:
        out, counts = [], RenderCounts()
        for p in problems:
            rendered, truncated = self.render(p)
            if rendered is None:
                counts.skipped += 1
            else:
                counts.truncated += truncated
                out.append(rendered)
        return out, counts

    def end_of_turn_ids(self) -> list[int]:
        """The special token a chat template writes right after an assistant message's content ([] for no
        template, or a template that writes none)."""
        return list(self._end_of_turn)

    @functools.cached_property
    def _end_of_turn(self) -> tuple[int, ...]:
        # Found once per renderer: every warm-start and probe completion of a chat prompt ends with it.
        if self.mode == "none" or not self.template:
            return ()
        try:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}],
                chat_template=self.template, tokenize=False, **self.template_kwargs)
        except Exception:  # a template that refuses this conversation: no end-of-turn token known
            return ()
        _, found, after = text.partition(_MARK)
        ids = self.tokenizer(after, add_special_tokens=False).input_ids if found else []
        return tuple(ids[:1]) if ids and ids[0] in self._special_ids() else ()

    def _special_ids(self) -> set[int]:
        # Special tokens in the tokenizer's map, and added tokens flagged special (Llama 3's <|eot_id|> is one
        # of these, in no special-tokens map).
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        return set(self.tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}

    def completion_ids(self, problem: Problem, completion: str) -> list[int]:
        """A reference completion as the policy would end it: the end-of-turn token after a chat prompt, the
        end-of-sequence token otherwise."""
        end = (self.end_of_turn_ids() if self._uses_template(problem) else []) or [self.tokenizer.eos_token_id]
        return self.tokenizer(completion, add_special_tokens=False).input_ids + end


class RenderedTask:
    """`task` with every problem it hands out (training, warm start, probe, eval) rendered by `renderer`."""

    def __init__(self, task: Task, renderer: PromptRenderer) -> None:
        self.task, self.renderer, self.name = task, renderer, task.name

    def rendered_problems(self, seed: int, iteration: int, n: int) -> tuple[list[Problem], RenderCounts]:
        return self.renderer.render_all(self.task.problems(seed, iteration, n))

    def problems(self, seed: int, iteration: int, n: int) -> list[Problem]:
        return self.rendered_problems(seed, iteration, n)[0]

    def score(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[float]:
        return self.task.score(problems, completions)

    def corpus(self) -> str:
        return self.task.corpus()

    def sft_pairs(self, seed: int, n: int) -> list[tuple[Problem, list[int]]]:
        """Rendered reference problems with their completions' token ids (overlong ones skipped)."""
        if hasattr(self.task, "sft_problems"):
            pairs = [(p, p.answer) for p in self.task.sft_problems(seed, n)]
        else:
            pairs = [(Problem("sft", prompt, completion), completion)
                     for prompt, completion in self.task.sft_examples(seed, n)]
        out = []
        for problem, completion in pairs:
            rendered, _ = self.renderer.render(problem)
            if rendered is not None:
                out.append((replace(rendered, answer=completion), self.renderer.completion_ids(problem, completion)))
        return out

    def sft_examples(self, seed: int, n: int) -> list[tuple[str, str]]:
        return [(p.prompt, p.answer) for p, _ in self.sft_pairs(seed, n)]

    def held_out(self, seed: int, n: int) -> list[Problem] | None:
        inner = getattr(self.task, "held_out", None)
        problems = inner(seed, n) if inner else None
        return None if problems is None else self.renderer.render_all(problems)[0]
