"""A dataset's written tool-call demonstrations (`task.demonstrations_field`): per row, the chat messages that follow
the prompt, OpenAI style, read into the form the warm start lays out (orchestrator/agents/agent_rollout.py
`Agent.demonstrations`, as the tasks' own demonstrations are):

    [{"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                           "function": {"name": "calculator",
                                                                        "arguments": {"a": 12, "b": 34}}}]},
     {"role": "tool", "content": "408"},
     {"role": "assistant", "content": "408"}]

`arguments` is an object or a JSON string of one (OpenAI's wire form). A Parquet file (one Arrow schema for every
row) gives every message the keys any message has, and every call's arguments the keys any call's have, the absent
ones null: a null key is taken as absent (write arguments as JSON strings to keep a null). Which tools the calls name,
and whether their signatures take the arguments, is checked against `agent.tools` when the run starts."""
from __future__ import annotations

import json
from typing import Any

from .jsonl import TaskDataError

ROLES = ("assistant", "tool", "user")


def read_demonstration(value: Any, where: str) -> list[dict[str, Any]]:
    """One row's column as normalised messages; TaskDataError naming `where` (file, row, field), the message and
    what is wrong."""
    if value is None:
        raise TaskDataError(f"{where}: missing or null; every row needs a demonstration (the chat messages after the "
                            f"prompt: the assistant's turns and the tools' results)")
    if not isinstance(value, list) or not value:
        got = "an empty list" if isinstance(value, list) else type(value).__name__
        raise TaskDataError(f"{where}: a demonstration is a non-empty list of chat messages (the assistant's turns "
                            f"and the tools' results after the prompt), not {got}")
    messages = [_message(m, f"{where}: message {k}") for k, m in enumerate(value, 1)]
    if messages[0]["role"] != "assistant" or messages[-1]["role"] != "assistant":
        raise TaskDataError(f"{where}: a demonstration starts with the model's turn after the prompt and ends with "
                            f"its answer (an assistant message), not with a {messages[0]['role']!r} / "
                            f"{messages[-1]['role']!r} message")
    for k, (before, m) in enumerate(zip(messages, messages[1:]), 2):
        if m["role"] == "tool" and before["role"] != "tool" and not before.get("tool_calls"):
            raise TaskDataError(f"{where}: message {k}: a tool result follows an assistant message with "
                                f"`tool_calls` (or another tool result)")
    return messages


def _message(m: Any, where: str) -> dict[str, Any]:
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        role = m.get("role") if isinstance(m, dict) else type(m).__name__
        raise TaskDataError(f"{where}: a message is an object whose role is one of {', '.join(ROLES)}, not {role!r}")
    content = m.get("content")
    if m["role"] != "assistant":
        if not isinstance(content, str):
            raise TaskDataError(f"{where}: a {m['role']} message's content is a string (what the model reads), not "
                                f"{type(content).__name__}")
        return {"role": m["role"], "content": content}
    if content is not None and not isinstance(content, str):
        raise TaskDataError(f"{where}: an assistant message's content is a string or null, not "
                            f"{type(content).__name__}")
    calls = m.get("tool_calls") or []
    if not isinstance(calls, list):
        raise TaskDataError(f"{where}: tool_calls is a list of {{function: {{name, arguments}}}}, not "
                            f"{type(calls).__name__}")
    if not content and not calls:
        raise TaskDataError(f"{where}: an assistant message without content nor tool_calls")
    out: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if calls:
        out["tool_calls"] = [_call(c, f"{where}: tool call {i}") for i, c in enumerate(calls, 1)]
    return out


def _call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise TaskDataError(f"{where}: a tool call is {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                            f"\"arguments\": {{...}}}}}}, got {call!r}")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise TaskDataError(f"{where}: the arguments of {name!r} are a string that is not JSON ({e})") from None
    elif isinstance(arguments, dict):  # a table's union of every call's keys: the absent ones null
        arguments = {k: v for k, v in arguments.items() if v is not None}
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise TaskDataError(f"{where}: the arguments of {name!r} are an object (or its JSON string), not "
                            f"{type(arguments).__name__}")
    return {"type": "function", "function": {"name": name, "arguments": arguments}}
