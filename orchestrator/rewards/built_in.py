"""tide's built-in reward functions (`rewards: [{fn: <name>}]`), called tide's way: with the completions' texts
and each problem's reference answer as `answer` (orchestrator/rewards/functions.py calls them).

- `exact`: whole-string match; `numeric`: numbers with answer extraction (the last \\boxed{}, `####` or the last
  number; rollout/tasks/verifiers.py); `math`: Hugging Face `math-verify`, symbolic equivalence of the extracted
  answer;
- `code`: the fraction of the problem's tests the completion's code passes in the sandbox: a `tests` column of
  assertions, with an optional `language` column, and for Python the tests' own set-up run judge-side (a
  `test_setup` column, or MBPP's `test_imports` and `test_setup_code`) and the solution's names the tests may use
  (`solution_names`, or HumanEval's `entry_point`); or stdin/stdout problems, judged per case: a `cases` column
  (a list of {stdin, expected_stdout} or {input, output}, or CodeContests' {"input": [...], "output": [...]})
  with an optional `checker` column (exact | tokens | float | program, sandbox judge mode); or an `answer`
  holding the JSON spec {"language", "tests"} or {"language", "cases", "checker"}; None for a problem with none;
- `length`: Kimi k1.5's length reward (arXiv:2501.12599 section 2.3.3): within each prompt's samples,
  lam = 0.5 - (len - min_len) / (max_len - min_len) in tokens; a sample counts as correct when the weighted sum
  of the other functions exceeds 0.5 and gets lam, an incorrect one min(0, lam); computed on the driver after
  the others, for the samples they scored."""
from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

from rollout.tasks.verifiers import exact_match, numeric_match

BUILTINS = ("exact", "numeric", "math", "code", "length")
LENGTH = "length"
CORRECT_ABOVE = 0.5  # `length`: a sample whose other rewards sum above this counts as correct
_PLAIN_NUMBER = re.compile(r"-?\d+(\.\d+)?(/\d+)?")


def _exact(prompts, completions, answer, **_) -> list[float]:
    return [exact_match(c, str(a)) for c, a in zip(completions, answer)]


def _numeric(prompts, completions, answer, **_) -> list[float]:
    return [numeric_match(c, str(a)) for c, a in zip(completions, answer)]


def _math(prompts, completions, answer, **_) -> list[float]:
    return [_math_equivalent(c, str(a)) for c, a in zip(completions, answer)]


def _code(prompts, completions, answer, *, sandbox_url: str, tests=None, language=None, cases=None, checker=None,
          test_setup=None, test_imports=None, test_setup_code=None, solution_names=None, entry_point=None,
          **_) -> list[float | None]:
    from rollout.tasks.code import CODE_LIMITS, score_in_sandbox
    from sandbox.client import SandboxClient

    def column(values, i):
        return values[i] if values else None

    specs = [_code_spec(answer[i], column(tests, i), column(language, i), column(cases, i), column(checker, i),
                        _test_setup(column(test_setup, i), column(test_imports, i), column(test_setup_code, i)),
                        _solution_names(column(solution_names, i), column(entry_point, i)))
             for i in range(len(completions))]
    todo = [i for i, spec in enumerate(specs) if spec is not None]
    out: list[float | None] = [None] * len(completions)
    with SandboxClient(sandbox_url, token=os.environ.get("TIDE_SANDBOX_TOKEN")) as client:  # its connections
        scores = score_in_sandbox(client, [specs[i] for i in todo], [completions[i] for i in todo], CODE_LIMITS)
    for i, v in zip(todo, scores):
        out[i] = v
    return out


def _test_setup(setup: Any, imports: Any, setup_code: Any) -> str:
    imports = "\n".join(imports) if isinstance(imports, (list, tuple)) else imports or ""
    return "\n".join(part for part in (imports, setup_code or "", setup or "") if part)


def _solution_names(names: Any, entry_point: Any) -> list[str] | None:
    if names:
        return [names] if isinstance(names, str) else list(names)
    return [entry_point] if entry_point else None


def _code_spec(answer: Any, tests: Any, language: Any, cases: Any = None, checker: Any = None,
               test_setup: str = "", solution_names: list[str] | None = None) -> dict | None:
    if tests:
        spec = {"language": language or "python", "tests": list(tests)}
        if test_setup:
            spec["test_setup"] = test_setup
        if solution_names is not None:
            spec["solution_names"] = solution_names
        return spec
    if cases:
        cases = json.loads(cases) if isinstance(cases, str) else cases
        checker = json.loads(checker) if isinstance(checker, str) else checker
        return {"language": language or "python", "cases": cases, "checker": checker}
    try:
        spec = json.loads(answer) if isinstance(answer, str) else answer
    except ValueError:
        return None
    return spec if isinstance(spec, dict) and (spec.get("tests") or spec.get("cases")) else None


@functools.lru_cache(maxsize=65536)
def _math_equivalent(completion: str, reference: str) -> float:
    """math-verify's verdict (about 1 ms per pair here, so pairs are cached in the worker: samples of one prompt
    repeat); two plain numbers are compared exactly without it, as it would compare them."""
    a, b = _plain_number(completion), _plain_number(reference)
    if a is not None and b is not None:
        return float(a == b)
    from math_verify import parse, verify

    gold, got = parse(reference), parse(completion)
    return float(bool(gold) and bool(got) and verify(gold, got))


def _plain_number(text: str) -> Fraction | None:
    text = text.strip()
    if not _PLAIN_NUMBER.fullmatch(text):
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


BUILTIN_FNS: dict[str, Callable] = {"exact": _exact, "numeric": _numeric, "math": _math, "code": _code}



def length_values(rewards: list[float | None], lengths: Sequence[int], groups: Sequence[int]) -> list[float | None]:
    import torch

    from trainer.losses import length_reward

    if len(lengths) != len(rewards) or len(groups) != len(rewards):
        raise ValueError("the `length` reward needs every completion's length and group")
    kept = [i for i, r in enumerate(rewards) if r is not None]
    out: list[float | None] = [None] * len(rewards)
    if kept:
        lam = length_reward(torch.tensor([lengths[i] for i in kept]),
                            torch.tensor([rewards[i] > CORRECT_ABOVE for i in kept]),
                            torch.tensor([groups[i] for i in kept]))
        for i, v in zip(kept, lam.tolist()):
            out[i] = v
    return out
