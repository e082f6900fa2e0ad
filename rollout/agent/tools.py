"""Tools an agent may call: Python functions declared to the model as OpenAI function schemas, derived from their
signatures and docstrings by transformers' `get_json_schema` (the schema a chat template's `tools=` renders).

A user tool is `"package.module:function"`, sync or async. Every call ends as a `ToolOutcome`: its text for the
model, or an error the model reads (an unknown tool, arguments the signature does not take, an exception, a
timeout) -- never an exception out of the agent loop. A sync tool runs in a worker thread; at its timeout the
call ends with an error, but Python cannot stop the thread, so a tool that can hang should be async or keep its
own limit (the built-in `python` tool runs in the sandbox, under the sandbox's)."""
from __future__ import annotations

import asyncio
import importlib
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from .parsers import ToolCall

Failure = Literal["unknown_tool", "bad_arguments", "error", "timeout"]


@dataclass(frozen=True)
class Tool:
    name: str
    schema: dict[str, Any]  # {"type": "function", "function": {"name", "description", "parameters"}}
    fn: Callable[..., Any]

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)


@dataclass(frozen=True)
class ToolOutcome:
    text: str  # what the model reads (the result, or the error)
    failure: Failure | None = None
    latency_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.failure is None


def tool_from_function(fn: Callable[..., Any], name: str | None = None) -> Tool:
    """A Tool from a typed, documented function (transformers' rules: every argument typed and described in a
    Google-style docstring); ValueError naming the function and what its declaration lacks."""
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(fn)
    except Exception as e:  # transformers raises its own DocstringParsingException/TypeHintParsingException
        raise ValueError(f"tool {getattr(fn, '__qualname__', fn)!r} cannot be declared to the model: {e} "
                         f"(type every argument and describe it in a Google-style docstring)") from None
    if name:
        schema["function"]["name"] = name
    return Tool(schema["function"]["name"], schema, fn)


def load_tool(spec: str) -> Tool:
    """`"package.module:function"` -> Tool; ValueError naming what is missing."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"tool {spec!r}: write it as \"package.module:function\"")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"tool {spec!r}: cannot import {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"tool {spec!r}: {module_name!r} has no function {attr!r}")
    return tool_from_function(fn)


def _stringify(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        import json

        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


class ToolBox:
    """The tools of one agent, by name, with each call bounded in time and in the length of what it returns."""

    def __init__(self, tools: list[Tool], timeout_s: float = 30.0, max_chars: int = 20_000) -> None:
        names = [t.name for t in tools]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"two tools are named {sorted(dup)}")
        self.tools = {t.name: t for t in tools}
        self.timeout_s, self.max_chars = timeout_s, max_chars

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    async def call(self, call: ToolCall) -> ToolOutcome:
        t0 = time.monotonic()
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolOutcome(f"error: no tool named {call.name!r}; the tools are {sorted(self.tools)}",
                               "unknown_tool")
        try:
            inspect.signature(tool.fn).bind(**call.arguments)
        except TypeError as e:
            return ToolOutcome(f"error: {call.name} does not take these arguments ({e})", "bad_arguments",
                               time.monotonic() - t0)
        try:
            if tool.is_async:
                value = await asyncio.wait_for(tool.fn(**call.arguments), self.timeout_s)
            else:
                value = await asyncio.wait_for(asyncio.to_thread(tool.fn, **call.arguments), self.timeout_s)
        except asyncio.TimeoutError as e:  # ours, or the tool's own (TimeoutError is asyncio's since 3.11)
            why = str(e) or f"it did not answer within {self.timeout_s:g} s"
            return ToolOutcome(f"error: {call.name} timed out: {why}", "timeout", time.monotonic() - t0)
        except Exception as e:
            return ToolOutcome(f"error: {call.name} raised {type(e).__name__}: {e}", "error", time.monotonic() - t0)
        return ToolOutcome(self.truncate(_stringify(value)), None, time.monotonic() - t0)

    def truncate(self, text: str) -> str:
        if len(text) <= self.max_chars:
            return text
        cut = len(text) - self.max_chars
        return text[:self.max_chars] + f"\n... ({cut} more characters cut)"
