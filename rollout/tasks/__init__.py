"""Prompt sources and verifiers."""
from .base import Problem, Task
from .jsonl import JsonlTask, TaskDataError, load_jsonl
from .synthetic import AdditionTask, ReverseTask
from .verifiers import exact_match, numeric_match

__all__ = ["Problem", "Task", "JsonlTask", "TaskDataError", "load_jsonl", "AdditionTask", "ReverseTask",
           "exact_match", "numeric_match", "make_task"]


def make_task(name: str, **kwargs) -> Task:
    if name == "addition":
        return AdditionTask(max_digits=kwargs.get("max_digits", 2))
    if name == "reverse":
        return ReverseTask(length=kwargs.get("length", 3))
    if name == "jsonl":
        return JsonlTask(path=kwargs["path"])
    if name == "code":
        from .code import CodeTask  # needs the sandbox service

        return CodeTask(**{k: v for k, v in kwargs.items() if k in ("sandbox_url",)})
    raise ValueError(f"unknown task {name!r}")
