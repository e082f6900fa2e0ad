"""Tools an agent may call: Python functions declared to the model as OpenAI function schemas, derived from their
signatures and docstrings by transformers' `get_json_schema` (the schema a chat template's `tools=` renders).

A user tool is `"package.module:function"` or `"path/to/file.py:function"` (found as reward functions are:
rollout/user_functions.py), sync or async. Every call ends as a `ToolOutcome`: its text for the model, or an error
the model reads (an unknown tool, arguments the signature does not take, an exception, a timeout) -- never an
exception out of the agent loop.

One trajectory's tools cannot starve another trajectory's: each ToolBox (one per trajectory) runs at most
`max_parallel_calls` of its calls at once, and its sync tools in threads of its own, as many. At its timeout a
sync call ends with an error, but Python cannot stop its thread: the thread stays the box's until the function
returns, so a tool that hangs slows only its own trajectory's later calls (they time out), never a neighbour's.
A tool that can hang should still be async or keep its own limit (the built-in `python` tool runs in the
sandbox, under the sandbox's limits, and ends its session when a call times out).

A stateful tool (`Tool.stateful`; the `python` tool, whose calls share one interpreter) takes a turn's calls one
after another, in the order the model wrote them; calls to stateless tools run concurrently."""
from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from ..user_functions import load_function
from .parsers import ToolCall

Failure = Literal["unknown_tool", "bad_arguments", "error", "timeout"]


@dataclass(frozen=True)
class Tool:
    name: str
    schema: dict[str, Any]  # {"type": "function", "function": {"name", "description", "parameters"}}
    fn: Callable[..., Any]
    stateful: bool = False  # its calls share state: a turn's calls run one after another, in the order written

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


def tool_from_function(fn: Callable[..., Any], name: str | None = None, stateful: bool = False) -> Tool:
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
    return Tool(schema["function"]["name"], schema, fn, stateful)


def load_tool(spec: str) -> Tool:
    """`"package.module:function"` or `"path/to/file.py:function"`, found as reward functions are
    (rollout/user_functions.py) -> Tool; ValueError naming the spec, the file or module, and why."""
    fn = load_function(spec, "tool")
    try:
        return tool_from_function(fn)
    except ValueError as e:
        raise ValueError(f"{spec!r}: {e}") from None


def _stringify(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        import json

        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


class ToolBox:
    """The tools of one trajectory, by name: each call bounded in time and in the length of what it returns, the
    trajectory's calls in number at once (module docstring)."""

    def __init__(self, tools: list[Tool], timeout_s: float = 30.0, max_chars: int = 20_000,
                 max_parallel_calls: int = 4) -> None:
        names = [t.name for t in tools]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"two tools are named {sorted(dup)}")
        if max_parallel_calls < 1:
            raise ValueError(f"max_parallel_calls {max_parallel_calls}: 1 or more")
        self.tools = {t.name: t for t in tools}
        self.timeout_s, self.max_chars, self.max_parallel_calls = timeout_s, max_chars, max_parallel_calls
        self._threads: ThreadPoolExecutor | None = None  # the sync tools' threads, made at the first such call

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    async def run(self, calls: Sequence[ToolCall]) -> list[ToolOutcome]:
        """A turn's calls, their outcomes in the calls' order: a stateful tool's calls one after another in the
        order written, the others concurrently; at most `max_parallel_calls` running at once."""
        slots = asyncio.Semaphore(self.max_parallel_calls)
        chains: dict[Any, list[int]] = {}
        for i, c in enumerate(calls):
            tool = self.tools.get(c.name)
            chains.setdefault(c.name if tool is not None and tool.stateful else i, []).append(i)

        async def chain(indices: list[int]) -> list[ToolOutcome]:
            out = []
            for i in indices:
                async with slots:
                    out.append(await self.call(calls[i]))
            return out

        outcomes: list[ToolOutcome] = [ToolOutcome("")] * len(calls)
        for indices, done in zip(chains.values(), await asyncio.gather(*[chain(ix) for ix in chains.values()])):
            for i, o in zip(indices, done):
                outcomes[i] = o
        return outcomes

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
            else:  # in the box's own threads (module docstring)
                running = asyncio.get_running_loop().run_in_executor(
                    self._pool(), functools.partial(tool.fn, **call.arguments))
                value = await asyncio.wait_for(running, self.timeout_s)
        except asyncio.TimeoutError as e:  # ours, or the tool's own (TimeoutError is asyncio's since 3.11)
            why = str(e) or f"it did not answer within {self.timeout_s:g} s"
            return ToolOutcome(f"error: {call.name} timed out: {why}", "timeout", time.monotonic() - t0)
        except Exception as e:
            return ToolOutcome(f"error: {call.name} raised {type(e).__name__}: {e}", "error", time.monotonic() - t0)
        return ToolOutcome(self.truncate(_stringify(value)), None, time.monotonic() - t0)

    def _pool(self) -> ThreadPoolExecutor:
        if self._threads is None:
            self._threads = ThreadPoolExecutor(self.max_parallel_calls, thread_name_prefix="tide-tool")
        return self._threads

    def close(self) -> None:
        """Let the sync tools' threads go once idle (one still in a hung tool ends when the tool returns), without
        waiting for them; a later call makes new threads."""
        threads, self._threads = self._threads, None
        if threads is not None:
            threads.shutdown(wait=False)

    def truncate(self, text: str) -> str:
        if len(text) <= self.max_chars:
            return text
        cut = len(text) - self.max_chars
        return text[:self.max_chars] + f"\n... ({cut} more characters cut)"
