"""Users' datasets (`task.name: dataset`): a local .jsonl, .json, .parquet or .csv file read with the `datasets`
library (never the hub), one problem per row: `prompt_field` (a string, or chat messages {role, content}) and
`answer_field`, each a column's name or a dotted path into nested columns (`reward_model.ground_truth`, veRL's
parquet layout). Every column but the prompt's travels with the problem (the answer's too, under its own name:
reward functions get the row as TRL gives it). Scored by numeric match with answer extraction
(`verifiers.numeric_match`); the rows of `eval_path` are the eval phase's held-out problems."""
from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import DATASET_FORMATS
from .base import Problem
from .demonstrations import read_demonstration
from .jsonl import ShuffledProblems, TaskDataError


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path).expanduser()
    if not path.is_file():
        raise TaskDataError(f"task data file not found: {path}")
    fmt = DATASET_FORMATS.get(path.suffix)
    if fmt is None:
        raise TaskDataError(f"{path}: unsupported format (use {', '.join(DATASET_FORMATS)})")
    from datasets import disable_progress_bars, load_dataset

    disable_progress_bars()
    try:
        data = load_dataset(fmt, data_files=str(path), split="train")
    except Exception as e:  # the datasets library's parse errors come in many types
        raise TaskDataError(f"{path}: cannot be read as {fmt}: {e}") from None
    return data.to_list()


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()  # what `field_value` gives for a path that leads nowhere (a null is a value)


def field_value(row: Mapping[str, Any], path: str) -> Any:
    """The value at a column path: a column's name, or names joined by dots into nested dicts
    (`reward_model.ground_truth`); a column whose own name holds the dots is taken first. MISSING where a key
    is absent or a value on the way is not a dict."""
    if path in row:
        return row[path]
    value: Any = row
    for key in path.split("."):
        if not isinstance(value, Mapping) or key not in value:
            return MISSING
        value = value[key]
    return value


def _missing_field(where: str, path: str, row: Mapping[str, Any]) -> TaskDataError:
    """The error for a path that leads nowhere, naming the deepest dict it reached and that dict's keys."""
    parts = path.split(".")
    reached, holder = "the row", row
    for depth in range(1, len(parts)):
        inner = field_value(row, ".".join(parts[:depth]))
        if not isinstance(inner, Mapping):
            break
        reached, holder = repr(".".join(parts[:depth])), inner
    return TaskDataError(f"{where}: field {path!r} is missing or null ({reached} has "
                         f"{', '.join(map(repr, sorted(holder)))}; task.prompt_field / task.answer_field name the "
                         f"columns, dots reach into nested ones)")


def problems_from_rows(rows: list[dict[str, Any]], path: str | Path, prompt_field: str,
                       answer_field: str) -> list[Problem]:
    if not rows:
        raise TaskDataError(f"{path}: no rows")
    out = []
    for i, row in enumerate(rows, 1):
        where = f"{path}: row {i}"
        for name in (prompt_field, answer_field):
            value = field_value(row, name)
            if value is MISSING or value is None:
                raise _missing_field(where, name, row)
        prompt = field_value(row, prompt_field)
        messages: tuple[dict, ...] = ()
        if isinstance(prompt, list):
            if not prompt or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                     and isinstance(m.get("content"), str) for m in prompt):
                raise TaskDataError(f"{where}: field {prompt_field!r} must be a string or a list of "
                                    f"{{role, content}} messages")
            messages, prompt = tuple({"role": m["role"], "content": m["content"]} for m in prompt), ""
        elif not isinstance(prompt, str):
            raise TaskDataError(f"{where}: field {prompt_field!r} must be a string or a list of {{role, content}} "
                                f"messages, not {type(prompt).__name__}")
        # TRL (1.16, GRPOTrainer._calculate_rewards) passes every column but "prompt" to reward functions
        columns = {k: v for k, v in row.items() if k != prompt_field}
        out.append(Problem(Path(path).stem, prompt, str(field_value(row, answer_field)), messages, columns,
                           answer_field=answer_field))
    return out


@dataclass
class DatasetTask(ShuffledProblems):
    path: str
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    eval_path: str | None = None
    demonstrations_field: str | None = None  # the column of each row's written demonstration (demonstrations.py)
    name: str = "dataset"
    _problems: list[Problem] = field(default_factory=list, repr=False)
    _demonstrations: list[list[dict[str, Any]]] = field(default_factory=list, repr=False)  # one per problem

    def __post_init__(self) -> None:
        rows = load_rows(self.path)
        self._problems = problems_from_rows(rows, self.path, self.prompt_field, self.answer_field)
        if self.demonstrations_field is not None:
            self._demonstrations = [self._demonstration(row, p, i)
                                    for i, (row, p) in enumerate(zip(rows, self._problems), 1)]

    def _load(self, path: str) -> list[Problem]:
        return problems_from_rows(load_rows(path), path, self.prompt_field, self.answer_field)

    def _demonstration(self, row: Mapping[str, Any], problem: Problem, i: int) -> list[dict[str, Any]]:
        """The row's prompt messages followed by its written demonstration."""
        where = f"{self.path}: row {i}: field {self.demonstrations_field!r} (task.demonstrations_field)"
        value = field_value(row, self.demonstrations_field)
        if value is MISSING:
            raise TaskDataError(f"{where}: no such column; the row's columns: {', '.join(map(repr, sorted(row)))} "
                                f"(every row needs a demonstration; dots reach into nested columns)")
        prompt = list(problem.messages) or [{"role": "user", "content": problem.prompt}]
        if any(m["role"] == "assistant" for m in prompt):
            raise TaskDataError(f"{where}: the row's prompt holds an assistant message, which the warm start would "
                                f"train on as the model's turn; a demonstration's prompt ends before the model's "
                                f"first turn")
        return prompt + read_demonstration(value, where)

    def sft_conversations(self, seed: int, n: int) -> list[list[dict[str, Any]]] | None:
        """n rows' prompts with their written demonstrations, drawn as the warm start draws rows; None without
        `demonstrations_field` (the warm start then trains on the reference answers)."""
        if not self._demonstrations:
            return None
        rng = random.Random(seed)
        return [self._demonstrations[rng.randrange(len(self._demonstrations))] for _ in range(n)]

    def demonstration_rows(self) -> list[tuple[str, list[dict[str, Any]]]]:
        """Every row's demonstration with where it is written (what the start-up check names)."""
        return [(f"{self.path}: row {i}: field {self.demonstrations_field!r}", d)
                for i, d in enumerate(self._demonstrations, 1)]

    def held_out(self, seed: int, n: int) -> list[Problem] | None:
        """The first n rows of `eval_path`; None without one (the eval phase then draws from the training
        stream's seed-disjoint problems)."""
        return self._load(self.eval_path)[:n] if self.eval_path else None
