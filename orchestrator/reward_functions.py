"""Pluggable rewards (`rewards:` a list of `{fn, weight}`): built-in verifiers and users' functions, called the
way TRL calls reward functions: `fn(prompts, completions, **columns) -> list[float | None]`, one value per
completion, None where the function does not apply. `prompts` are the problems' chat messages (or prompt
strings), `columns` the problems' dataset columns plus `answer`. A user function is imported from the
environment or the directory tide runs in.

A sample's reward is the weighted sum of the values that are not None; a sample every function skips gets no
reward and is left out of training (`None`). Functions run batched in a worker process (they cannot touch the
driver's state, and a hung one is stopped after `reward_timeout_s`); coroutine functions are awaited there.

Built-ins: `exact` (whole-string match), `numeric` (numbers with answer extraction: the last \\boxed{}, `####`
or the last number), `math` (Hugging Face `math-verify`: symbolic equivalence of the extracted answer), `code`
(the fraction of the problem's tests the completion's code passes in the sandbox: a `tests` column of
assertions, with an optional `language` column; or stdin/stdout problems, judged per case: a `cases` column
(a list of {stdin, expected_stdout} or {input, output}, or CodeContests' {"input": [...], "output": [...]})
with an optional `checker` column (exact | tokens | float | program, sandbox judge mode); or an `answer`
holding the JSON spec {"language", "tests"} or {"language", "cases", "checker"}; None for a problem with none), `length` (Kimi k1.5's length reward, arXiv:2501.12599 section 2.3.3: within
each prompt's samples, lam = 0.5 - (len - min_len) / (max_len - min_len) in tokens; a sample counts as correct
when the weighted sum of the other functions exceeds 0.5 and gets lam, an incorrect one min(0, lam); computed
on the driver after the others, for the samples they scored)."""
from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import json
import math
import multiprocessing
import os
import re
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollout.tasks.verifiers import exact_match, numeric_match

BUILTINS = ("exact", "numeric", "math", "code", "length")
LENGTH = "length"
CORRECT_ABOVE = 0.5  # `length`: a sample whose other rewards sum above this counts as correct
_PLAIN_NUMBER = re.compile(r"-?\d+(\.\d+)?(/\d+)?")


class RewardSpec(BaseModel):
    """One entry of the YAML `rewards:` list."""

    model_config = ConfigDict(extra="forbid")

    fn: str  # a built-in name, or "package.module:function"
    weight: float = 1.0
    name: str | None = None  # in metrics as reward/<name>; default: the built-in's or the function's name

    @property
    def label(self) -> str:
        return self.name or self.fn.rpartition(":")[2]


class RewardFunctionError(RuntimeError):
    """A reward function that cannot be loaded, raised, hung, or returned something other than one number or None
    per completion; the message names it."""


def _exact(prompts, completions, answer, **_) -> list[float]:
    return [exact_match(c, a) for c, a in zip(completions, answer)]


def _numeric(prompts, completions, answer, **_) -> list[float]:
    return [numeric_match(c, a) for c, a in zip(completions, answer)]


def _math(prompts, completions, answer, **_) -> list[float]:
    return [_math_equivalent(c, a) for c, a in zip(completions, answer)]


def _code(prompts, completions, answer, *, sandbox_url: str, tests=None, language=None, cases=None, checker=None,
          **_) -> list[float | None]:
    from rollout.tasks.code import score_in_sandbox
    from sandbox.client import SandboxClient

    def column(values, i):
        return values[i] if values else None

    specs = [_code_spec(answer[i], column(tests, i), column(language, i), column(cases, i), column(checker, i))
             for i in range(len(completions))]
    todo = [i for i, spec in enumerate(specs) if spec is not None]
    out: list[float | None] = [None] * len(completions)
    client = SandboxClient(sandbox_url, token=os.environ.get("TIDE_SANDBOX_TOKEN"))
    scores = score_in_sandbox(client, [specs[i] for i in todo], [completions[i] for i in todo], _code_limits())
    for i, v in zip(todo, scores):
        out[i] = v
    return out


def _code_spec(answer: Any, tests: Any, language: Any, cases: Any = None, checker: Any = None) -> dict | None:
    if tests:
        return {"language": language or "python", "tests": list(tests)}
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


_BUILTIN_FNS: dict[str, Callable] = {"exact": _exact, "numeric": _numeric, "math": _math, "code": _code}


def _code_limits():
    from sandbox.models import Limits

    return Limits(timeout_s=5.0, memory_mb=256, output_kb=64)  # the code task's own limits


def load_reward_function(fn: str) -> Callable:
    """A built-in by name or `package.module:function`; checked to take (prompts, completions, **columns)."""
    if fn in _BUILTIN_FNS:
        return _BUILTIN_FNS[fn]
    if os.getcwd() not in sys.path:  # `tide` is a console script: the directory it runs in is not on the path
        sys.path.append(os.getcwd())
    module_name, sep, attr = fn.partition(":")
    if not sep or not module_name or not attr:
        raise RewardFunctionError(f"reward {fn!r}: not a built-in ({', '.join(BUILTINS)}) nor "
                                  f"'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # an import error of any kind inside the user's module
        raise RewardFunctionError(f"reward {fn!r}: cannot import {module_name}: {type(e).__name__}: {e}") from None
    func = getattr(module, attr, None)
    if not callable(func):
        raise RewardFunctionError(f"reward {fn!r}: {module_name} has no function {attr!r}")
    _check_signature(fn, func)
    return func


def _check_signature(label: str, func: Callable) -> None:
    """Every column is passed as a keyword, so the function needs a **kwargs (it may also name columns)."""
    try:
        sig = inspect.signature(func)
        sig.bind_partial(["p"], ["c"])
        ok = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise RewardFunctionError(f"reward {label!r}: must accept (prompts, completions, **columns); its signature "
                                  f"is {inspect.signature(func)}")


def _call(fn: str, prompts: list, completions: list[str], columns: dict[str, list], options: dict) -> list:
    """In the worker process: load and call one function on the whole batch (`options`: a built-in's settings,
    e.g. the sandbox's address for `code`)."""
    func = load_reward_function(fn)
    result = func(prompts, completions, **columns, **options)
    if inspect.isawaitable(result):
        result = asyncio.run(_await(result))
    return list(result) if isinstance(result, (list, tuple)) else result


def _ready() -> bool:
    return True


async def _await(awaitable):
    return await awaitable


@dataclass
class ScoredBatch:
    rewards: list[float | None]  # None: every function skipped the sample (left out of training)
    per_function: dict[str, float]  # reward/<label>: mean over the samples the function scored


class RewardFunctions:
    """The configured functions with a worker process pool; `close()` stops the workers."""

    def __init__(self, specs: Sequence[RewardSpec], timeout_s: float = 60.0, workers: int = 1,
                 sandbox_url: str | None = None) -> None:
        if not specs:
            raise ValueError("no reward functions")
        labels = [s.label for s in specs]
        if len(set(labels)) != len(labels):
            raise RewardFunctionError(f"rewards: two functions would both report as reward/<name> for "
                                      f"{sorted({x for x in labels if labels.count(x) > 1})}: give them `name`s")
        self.length = [s for s in specs if s.fn == LENGTH]
        self.specs = [s for s in specs if s.fn != LENGTH]  # called in the workers
        if len(self.length) > 1 or (self.length and not self.specs):
            raise RewardFunctionError("rewards: `length` shapes the other rewards: give it once, beside at least "
                                      "one other function")
        for s in self.specs:
            load_reward_function(s.fn)  # import errors and wrong signatures stop the run before it starts
        if any(s.fn == "code" for s in self.specs) and not sandbox_url:
            raise RewardFunctionError("reward 'code' needs a sandbox: none is running or configured (sandbox.url)")
        self._options = {"code": {"sandbox_url": sandbox_url}}
        self.timeout_s, self.workers = timeout_s, workers
        self._pool = self._new_pool()

    def _new_pool(self) -> ProcessPoolExecutor:
        """Started and warmed up (every worker has imported this module) before any timeout applies."""
        # spawn: the driver holds threads (Ray, progress bars); a forked child could inherit a held lock
        pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
        for f in [pool.submit(_ready) for _ in range(self.workers)]:
            f.result()
        return pool

    def score(self, prompts: list, completions: list[str], columns: dict[str, list[Any]],
              lengths: Sequence[int] = (), groups: Sequence[int] = ()) -> ScoredBatch:
        """`lengths` (completion tokens) and `groups` (the prompt of each completion) are what `length` needs."""
        n = len(completions)
        values: dict[str, list] = {}
        futures = {s.label: self._pool.submit(_call, s.fn, prompts, completions, columns, self._options.get(s.fn, {}))
                   for s in self.specs}
        for spec in self.specs:
            try:
                got = futures[spec.label].result(timeout=self.timeout_s)
            except FutureTimeout:
                self._restart_pool()
                raise RewardFunctionError(f"reward {spec.label!r} ({spec.fn}) did not return within "
                                          f"reward_timeout_s = {self.timeout_s:g}") from None
            except RewardFunctionError:
                raise
            except Exception as e:
                raise RewardFunctionError(f"reward {spec.label!r} ({spec.fn}) raised {type(e).__name__}: {e}") from None
            values[spec.label] = _validated(spec, got, n)
        rewards: list[float | None] = []
        for i in range(n):
            scored = [(s.weight, values[s.label][i]) for s in self.specs if values[s.label][i] is not None]
            rewards.append(sum(w * v for w, v in scored) if scored else None)
        for spec in self.length:
            values[spec.label] = _length_values(rewards, lengths, groups)
            rewards = [r if v is None else r + spec.weight * v for r, v in zip(rewards, values[spec.label])]
        per_function = {}
        for s in self.specs + self.length:
            vs = [v for v in values[s.label] if v is not None]
            if vs:
                per_function[f"reward/{s.label}"] = sum(vs) / len(vs)
        return ScoredBatch(rewards, per_function)

    def _restart_pool(self) -> None:
        """A hung function keeps its worker busy: the pool's processes are ended and a fresh pool replaces it."""
        for proc in list(getattr(self._pool, "_processes", {}).values()):
            proc.kill()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = self._new_pool()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _length_values(rewards: list[float | None], lengths: Sequence[int], groups: Sequence[int]) -> list[float | None]:
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


def _validated(spec: RewardSpec, got: Any, n: int) -> list[float | None]:
    if not isinstance(got, list) or len(got) != n:
        size = len(got) if isinstance(got, list) else type(got).__name__
        raise RewardFunctionError(f"reward {spec.label!r} ({spec.fn}) returned {size} values for {n} completions")
    out: list[float | None] = []
    for i, v in enumerate(got):
        if v is None:
            out.append(None)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out.append(float(v))
        else:
            raise RewardFunctionError(f"reward {spec.label!r} ({spec.fn}) returned {v!r} for completion {i}: "
                                      f"a finite number or None is required")
    return out
