"""User data: a JSONL file of {"prompt": ..., "answer": ...} lines, scored by exact or numeric match."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from .base import Problem
from .verifiers import numeric_match


class TaskDataError(ValueError):
    pass


def load_jsonl(path: str | Path) -> list[Problem]:
    path = Path(path)
    if not path.is_file():
        raise TaskDataError(f"task data file not found: {path}")
    problems = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskDataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or "answer" not in row:
            raise TaskDataError(f'{path}:{lineno}: expected {{"prompt": str, "answer": ...}}')
        problems.append(Problem(str(row.get("task_id", path.stem)), row["prompt"], str(row["answer"])))
    if not problems:
        raise TaskDataError(f"{path}: no problems")
    return problems


class ShuffledProblems:
    """A fixed list of problems handed out through an epoch-wise shuffled cursor (a pure function of the seed and
    the iteration, so a resumed run sees the prompts an uninterrupted one would)."""

    _problems: list[Problem]
    _order_key: tuple[int, int] | None = None
    _order: list[int] = []

    def problems(self, seed: int, iteration: int, n: int) -> list[Problem]:
        """Epoch-wise shuffled cursor: iteration i takes items [i*n, (i+1)*n) of the shuffled stream (each
        epoch's order shuffled once, a pure function of (seed, epoch))."""
        out, total = [], len(self._problems)
        for k in range(iteration * n, (iteration + 1) * n):
            epoch, pos = divmod(k, total)
            out.append(self._problems[self._epoch_order(seed, epoch)[pos]])
        return out

    def _epoch_order(self, seed: int, epoch: int) -> list[int]:
        if self._order_key != (seed, epoch):
            order = list(range(len(self._problems)))
            random.Random(hash((seed, epoch)) & 0xFFFFFFFF).shuffle(order)
            self._order_key, self._order = (seed, epoch), order
        return self._order

    def sft_problems(self, seed: int, n: int) -> list[Problem]:
        rng = random.Random(seed)
        return [rng.choice(self._problems) for _ in range(n)]

    def sft_examples(self, seed: int, n: int) -> list[tuple[str, str]]:
        return [(p.prompt, p.answer) for p in self.sft_problems(seed, n)]

    def score(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[float]:
        return [numeric_match(c, p.answer) for p, c in zip(problems, completions)]

    def corpus(self) -> str:
        return "\n".join(p.prompt + "".join(m["content"] for m in p.messages) + p.answer for p in self._problems)


@dataclass
class JsonlTask(ShuffledProblems):
    path: str
    name: str = "jsonl"
    _problems: list[Problem] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._problems = load_jsonl(self.path)
