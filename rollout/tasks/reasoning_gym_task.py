"""reasoning-gym's procedural tasks (`task.name: reasoning_gym`): `size` problems of the named `dataset`
generated with `seed` and `config` (the dataset's own options), each prompt the dataset's question, scored by
the dataset's own `score_answer`. The held-out problems of the eval phase come from the same generator with
another seed."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from .base import Problem
from .jsonl import ShuffledProblems, TaskDataError

HELD_OUT_SEED_OFFSET = 1_000_003


def _generate(dataset: str, size: int, seed: int, config: dict[str, Any]):
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(dataset, size=size, seed=seed, **config)
    except Exception as e:  # unknown dataset names and bad options come as several exception types
        raise TaskDataError(f"reasoning-gym dataset {dataset!r} with config {config}: {type(e).__name__}: {e}") from None


@dataclass
class ReasoningGymTask(ShuffledProblems):
    dataset: str
    size: int = 1000
    seed: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    name: str = "reasoning_gym"
    _problems: list[Problem] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._data = _generate(self.dataset, self.size, self.seed, self.config)
        self._problems = self._as_problems(self._data, "train")

    def _as_problems(self, data, split: str) -> list[Problem]:
        return [Problem(self.dataset, entry["question"], str(entry["answer"]), columns={"rg_split": split,
                                                                                      "rg_index": i})
                for i, entry in enumerate(data)]

    def score(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[float]:
        out = []
        for p, completion in zip(problems, completions):
            data = self._data if p.columns.get("rg_split") == "train" else self._held_out_data
            entry = data[p.columns["rg_index"]]
            out.append(float(data.score_answer(answer=completion.strip(), entry=entry)))
        return out

    def held_out(self, seed: int, n: int) -> list[Problem]:
        self._held_out_data = _generate(self.dataset, n, self.seed + HELD_OUT_SEED_OFFSET, self.config)
        return self._as_problems(self._held_out_data, "eval")
