"""Prompt sources and verifiers."""
from __future__ import annotations

from ..config import TaskConfig
from .base import Problem, Task
from .jsonl import JsonlTask, TaskDataError, load_jsonl
from .synthetic import AdditionTask, CountTask, GuessTask, MultiplyTask, ReverseTask
from .verifiers import exact_match, in_order_match, numeric_match

__all__ = ["Problem", "Task", "JsonlTask", "TaskDataError", "load_jsonl", "AdditionTask", "CountTask", "GuessTask", "MultiplyTask", "ReverseTask",
           "exact_match", "in_order_match", "numeric_match", "make_task"]


def make_task(cfg: TaskConfig, sandbox_url: str | None = None, seed: int = 0) -> Task:
    """The task the YAML `task:` section names; `sandbox_url` is where the code task's sandbox listens; `seed`
    the run's (reasoning-gym's generator seed unless `task.seed` sets one)."""
    if cfg.name == "addition":
        return AdditionTask(max_digits=cfg.max_digits)
    if cfg.name == "reverse":
        return ReverseTask(length=cfg.length)
    if cfg.name == "count":
        return CountTask(length=cfg.length, max_digits=cfg.max_digits, sft_skip=cfg.sft_skip)
    if cfg.name == "multiply":
        return MultiplyTask(max_digits=cfg.max_digits)
    if cfg.name == "guess":
        return GuessTask(high=cfg.high)
    if cfg.name == "jsonl":
        return JsonlTask(path=cfg.path)
    if cfg.name == "dataset":
        from .dataset import DatasetTask  # imports the datasets library

        return DatasetTask(path=cfg.path, prompt_field=cfg.prompt_field, answer_field=cfg.answer_field,
                           eval_path=cfg.eval_path, demonstrations_field=cfg.demonstrations_field)
    if cfg.name == "reasoning_gym":
        from .reasoning_gym_task import ReasoningGymTask  # imports reasoning_gym

        return ReasoningGymTask(cfg.dataset, cfg.size, seed if cfg.seed is None else cfg.seed, dict(cfg.config))
    if cfg.name == "code":
        from .code import CodeTask  # needs the sandbox client

        if not sandbox_url:
            raise ValueError("task 'code' needs a sandbox service: set sandbox.url or let tide start one")
        return CodeTask(sandbox_url=sandbox_url)
    raise ValueError(f"unknown task {cfg.name!r}")
