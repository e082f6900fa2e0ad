"""Tool-call parsers: the model's text of one turn -> the calls it makes, the text around them, and what could not
be parsed. A malformed call is never dropped silently and never raises: it comes back as an error the agent loop
turns into a message to the model (and a counted metric), as a tool error would.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn (Qwen2.5/Qwen3,
  Hermes; vLLM's and veRL's `hermes` parser);
- `llama3_json`: the turn is one JSON object `{"name": ..., "parameters": {...}}` (Llama 3.1/3.2's JSON tool
  calling; `arguments` accepted too), optionally after `<|python_tag|>`, several separated by `;`.

`arguments` given as a JSON string (OpenAI's wire form) are decoded; anything but an object is an error."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    content: str  # the turn's text outside its tool calls
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one per call that could not be read, saying why
    # the text ends inside a call (its last error): what a turn cut by the token limit leaves
    truncated: bool = False


class ToolParser(Protocol):
    name: str

    def parse(self, text: str) -> ParsedTurn: ...

    def format(self, calls: list[ToolCall]) -> str:
        """The text of a turn making `calls`, as this parser reads it back (written demonstrations)."""


def _call(obj: Any, arguments_key: str) -> ToolCall | str:
    """A ToolCall from a decoded JSON value, or why it is not one."""
    if not isinstance(obj, dict):
        return f"a tool call must be a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return "a tool call needs a \"name\" string"
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as e:
            return f"the arguments of {name!r} are a string that is not JSON ({e})"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f"the arguments of {name!r} must be a JSON object, got {type(args).__name__}"
    return ToolCall(name, args)


def _clip(text: str, n: int = 200) -> str:
    return text if len(text) <= n else text[:n] + "..."


class HermesParser:
    name = "hermes"
    _OPEN, _CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        content, calls, errors = [], [], []
        rest = text
        while True:
            start = rest.find(self._OPEN)
            if start < 0:
                content.append(rest)
                break
            content.append(rest[:start])
            end = rest.find(self._CLOSE, start + len(self._OPEN))
            if end < 0:
                errors.append(f"a {self._OPEN} without its {self._CLOSE} (was the turn cut short?): "
                              f"{_clip(rest[start:])!r}")
                return ParsedTurn("".join(content).strip(), calls, errors, truncated=True)
            body = rest[start + len(self._OPEN):end].strip()
            rest = rest[end + len(self._CLOSE):]
            if self._OPEN in body:
                errors.append(f"a {self._OPEN} inside another: {_clip(body)!r}")
                continue
            try:
                obj = json.loads(body)
            except ValueError as e:
                errors.append(f"a tool call that is not JSON ({e}): {_clip(body)!r}")
                continue
            got = _call(obj, "arguments")
            (calls if isinstance(got, ToolCall) else errors).append(got)
        stray = "".join(content)
        if self._CLOSE in stray:
            errors.append(f"a {self._CLOSE} without its {self._OPEN}")
        return ParsedTurn("".join(content).strip(), calls, errors)

    def format(self, calls: list[ToolCall]) -> str:
        return "".join(self._OPEN + json.dumps({"name": c.name, "arguments": c.arguments}) + self._CLOSE
                       for c in calls)


class Llama3JsonParser:
    name = "llama3_json"
    _TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedTurn:
        body = text.strip()
        tagged = body.startswith(self._TAG)
        if tagged:
            body = body[len(self._TAG):].strip()
        if not body.startswith("{"):
            if tagged:
                return ParsedTurn("", [], [f"{self._TAG} followed by no JSON tool call: {_clip(body)!r}"])
            return ParsedTurn(text.strip())  # plain text: no call
        calls, errors = [], []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError as e:
                errors.append(f"a tool call that is not JSON ({e}): {_clip(body[pos:])!r}")
                # the text ran out inside the object (not a wrong character before its end)
                return ParsedTurn("", calls, errors, truncated=e.pos >= len(body) or _unclosed(body[pos:]))
            got = _call(obj, "parameters")
            (calls if isinstance(got, ToolCall) else errors).append(got)
            pos = end
            sep = re.match(r"\s*;?\s*", body[pos:])
            pos += sep.end() if sep else 0
        return ParsedTurn("", calls, errors)

    def format(self, calls: list[ToolCall]) -> str:
        return "; ".join(json.dumps({"name": c.name, "parameters": c.arguments}) for c in calls)


def _unclosed(text: str) -> bool:
    """A JSON text cut short: more brackets opened than closed outside strings."""
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
    return depth > 0 or in_string


PARSERS: dict[str, type] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def get_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; tide has {sorted(PARSERS)}")
    return PARSERS[name]()
