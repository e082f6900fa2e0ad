"""LLM judges: the prompt a generative judge reads (a template with the question, the answer, the reference and a
rubric, rendered through the judge's own chat template) and the verdict read from what it writes: a number, a
letter or a JSON field. A verdict that cannot be read is None, never a guess; the served judge
(orchestrator/workers/served_models.py) counts it and gives it the configured `unreadable_reward`.

Pure text: the judge model runs in a rollout engine (rollout/engine.py) of its own."""
from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

Verdict = Literal["number", "letter", "json"]
FIELDS = ("question", "answer", "reference", "rubric")
# a number standing alone, or the score of "8/10" (its denominator is part of it, not a verdict of its own)
_NUMBER = re.compile(r"(?<![\w./])(-?\d+(?:\.\d+)?)(?:\s*/\s*\d+(?:\.\d+)?)?(?![\w/]|\.\d)")


class JudgeTemplateError(ValueError):
    """A template naming a field that is not given, or with broken braces."""


def check_template(template: str) -> None:
    """Refuses a template that names a field other than question, answer, reference and rubric."""
    import string

    try:
        named = {field for _, field, _, _ in string.Formatter().parse(template) if field is not None}
    except ValueError as e:
        raise JudgeTemplateError(f"template: {e} (a literal brace is written {{{{ or }}}})") from None
    unknown = sorted(named - set(FIELDS))
    if unknown:
        raise JudgeTemplateError(f"template: unknown field {{{unknown[0]}}}; the fields are "
                                 f"{', '.join('{' + f + '}' for f in FIELDS)}")
    if "answer" not in named:
        raise JudgeTemplateError("template: it never shows the judge the {answer}")


def question_text(prompt: str | Sequence[Mapping[str, Any]]) -> str:
    """A plain prompt as it is; a chat prompt's last user message."""
    if isinstance(prompt, str):
        return prompt
    users = [m for m in prompt if m.get("role") == "user"]
    return str((users or list(prompt))[-1].get("content", ""))


def render(template: str, prompt: str | Sequence[Mapping[str, Any]], answer: str, reference: Any,
           rubric: Sequence[str]) -> str:
    return template.format(question=question_text(prompt), answer=answer,
                           reference="" if reference is None else str(reference),
                           rubric="\n".join(f"- {item}" for item in rubric))


def judge_problem(text: str, chat: bool):
    """The judge's prompt as a problem for the policy's prompt renderer (orchestrator/workers/prompts.py): a user
    turn of its chat template (`chat`), or its text alone."""
    from rollout.tasks import Problem

    return Problem("judge", text, "", messages=({"role": "user", "content": text},) if chat else ())


def parse_verdict(text: str, verdict: Verdict, *, key: str = "score", letters: Mapping[str, float] | None = None,
                  scale: tuple[float, float] | None = None) -> float | None:
    """The judge's value, or None when `text` holds no readable verdict. number: the last number written, mapped
    from `scale` (lo, hi) onto [0, 1] when given (outside it: unreadable; "8/10" reads 8); letter: the last of
    `letters` written as a word of its own, its value; json: `key` of the last JSON object written, a number."""
    if verdict == "number":
        found = _NUMBER.findall(text)
        if not found:
            return None
        value = float(found[-1])
        if scale is None:
            return value
        lo, hi = scale
        return (value - lo) / (hi - lo) if lo <= value <= hi else None
    if verdict == "letter":
        letters = letters or {}
        if not letters:
            raise ValueError("verdict letter needs `letters`")
        pattern = r"(?<![A-Za-z0-9])(" + "|".join(re.escape(k) for k in sorted(letters, key=len, reverse=True)) \
            + r")(?![A-Za-z0-9])"
        found = re.findall(pattern, text)
        return float(letters[found[-1]]) if found else None
    if verdict == "json":
        decoder, value = json.JSONDecoder(), None
        for start in [i for i, ch in enumerate(text) if ch == "{"]:
            try:
                obj, _ = decoder.raw_decode(text[start:])
            except ValueError:
                continue
            got = obj.get(key) if isinstance(obj, dict) else None
            if isinstance(got, (int, float)) and not isinstance(got, bool):
                value = float(got)
        return value
    raise ValueError(f"unknown verdict {verdict!r}")
