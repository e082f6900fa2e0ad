"""Tasks: where prompts come from and how completions are scored.

A task hands out `Problem`s deterministically from (seed, iteration) so that a resumed run sees exactly
the prompts an uninterrupted one would, and scores completions with a verifier returning rewards in [0, 1].
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable


@dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str  # the text the engines continue (for chat messages: their rendering by the chat template)
    answer: str  # reference answer, or a JSON test spec for coding tasks
    messages: tuple[dict, ...] = ()  # a chat-format prompt ({role, content} each), rendered into `prompt`
    columns: dict[str, Any] = field(default_factory=dict, compare=False)  # a dataset row's other fields
    # the prompt's token ids, set when the driver renders it (orchestrator/workers/prompts.py); empty: the engines
    # tokenise `prompt` themselves
    prompt_ids: tuple[int, ...] = ()
    # dataset rows: the column path `answer` was read from (`task.answer_field`); `columns` then hold the whole
    # row but its prompt column, the answer under its own name, as TRL passes a row to reward functions. None:
    # tasks that are not datasets, whose reward functions get `answer` beside `columns`
    answer_field: str | None = None
    # Set by multi-turn rollouts (rollout/agent/runner.py), which continue each trajectory on its own terms: the
    # request's sampling seed (None: derived from the call's seed and the prompt's index) and token budget (None:
    # the call's max_new_tokens)
    seed: int | None = field(default=None, compare=False)
    max_new_tokens: int | None = field(default=None, compare=False)


@runtime_checkable
class Task(Protocol):
    name: str

    def problems(self, seed: int, iteration: int, n: int) -> list[Problem]:
        """n problems for this iteration; a pure function of (seed, iteration, n)."""

    def score(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[float]:
        """One reward in [0, 1] per (problem, completion) pair."""

    def corpus(self) -> str:
        """Representative text (prompts and answers) used to train the tiny tokenizer."""

    def sft_examples(self, seed: int, n: int) -> list[tuple[str, str]]:
        """(prompt, completion) pairs for the optional supervised warm start."""
