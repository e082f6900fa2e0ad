"""A small coding task: write a Python function; reward = fraction of its tests that pass in the sandbox.

Problems are generated from a few parameterised families, so a tiny model can learn them on a CPU. Scoring
goes through `sandbox.client` only (the service runs elsewhere: `tide-sandbox serve`, or a cluster Service).
"""
from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from sandbox.client import SandboxClient
from sandbox.models import Limits, RunRequest, RunResult, Status

from .base import Problem

_FENCE = re.compile(r"```[\w+#.-]*[ \t]*\n(.*?)```", re.S)  # any language tag: ```python, ```cpp, ```c++


def _rng(seed: int, *stream: int) -> random.Random:
    # Seeded with a string (hashed with SHA-512 by random): the same in every process, unlike hash() of a
    # tuple holding a str, which PYTHONHASHSEED changes per process.
    return random.Random("code/" + "/".join(map(str, (seed, *stream))))


@dataclass(frozen=True)
class _Spec:
    prompt: str
    reference: str
    tests: list[str]


def _linear(r: random.Random) -> _Spec:
    a, b = r.randint(2, 9), r.randint(-9, 9)
    xs = r.sample(range(-20, 21), 4)
    return _Spec(f"Write a Python function f(x) that returns {a}*x + {b}.", f"def f(x):\n    return {a} * x + {b}\n",
                 [f"assert f({x}) == {a * x + b}" for x in xs])


def _sum_multiples(r: random.Random) -> _Spec:
    k = r.randint(2, 5)
    cases = [[r.randint(0, 30) for _ in range(r.randint(0, 6))] for _ in range(4)]
    return _Spec(f"Write a Python function f(xs) that returns the sum of the numbers in the list xs divisible by {k}.",
                 f"def f(xs):\n    return sum(x for x in xs if x % {k} == 0)\n",
                 [f"assert f({c}) == {sum(x for x in c if x % k == 0)}" for c in cases])


def _repeat(r: random.Random) -> _Spec:
    k = r.randint(2, 4)
    words = r.sample(["ab", "xyz", "q", "", "hello", "tide"], 4)
    return _Spec(f"Write a Python function f(s) that returns the string s repeated {k} times.",
                 f"def f(s):\n    return s * {k}\n", [f"assert f({w!r}) == {w * k!r}" for w in words])


def _count(r: random.Random) -> _Spec:
    c = r.choice("aeiost")
    words = ["".join(r.choice("aeiostx") for _ in range(r.randint(0, 8))) for _ in range(4)]
    return _Spec(f"Write a Python function f(s) that returns how many times the letter '{c}' occurs in s.",
                 f"def f(s):\n    return s.count({c!r})\n", [f"assert f({w!r}) == {w.count(c)}" for w in words])


def _clamp(r: random.Random) -> _Spec:
    lo = r.randint(-10, 0)
    hi = lo + r.randint(1, 15)
    xs = [lo - 5, lo, (lo + hi) // 2, hi + 3]
    return _Spec(f"Write a Python function f(x) that returns x limited to the range [{lo}, {hi}].",
                 f"def f(x):\n    return max({lo}, min({hi}, x))\n",
                 [f"assert f({x}) == {max(lo, min(hi, x))}" for x in xs])


FAMILIES: tuple[Callable[[random.Random], _Spec], ...] = (_linear, _sum_multiples, _repeat, _count, _clamp)


def extract_code(completion: str) -> str:
    """The first fenced code block if there is one, else the whole completion."""
    m = _FENCE.search(completion)
    return m.group(1) if m else completion


def judge_cases(cases: Any) -> list[dict]:
    """stdin/stdout cases in the shapes datasets carry them: a list of {stdin, expected_stdout} or {input, output},
    or CodeContests' {"input": [...], "output": [...]}."""
    if isinstance(cases, dict):
        cases = [{"stdin": i, "expected_stdout": o} for i, o in zip(cases["input"], cases["output"], strict=True)]
    return [{"stdin": c.get("stdin", c.get("input", "")), "expected_stdout": c.get("expected_stdout", c.get("output"))}
            for c in cases]


CODE_LIMITS = Limits(timeout_s=5.0, memory_mb=256, output_kb=64)  # what a code reward's run may use


def pass_fraction(res: RunResult) -> float:
    """The fraction of its tests (tests mode) or cases (judge mode) a run passed; a sandbox fault, not the
    program's, raises."""
    if res.status is Status.internal_error:
        raise RuntimeError(f"sandbox internal error: {res.stderr[:500]}")
    passed, total = (res.cases_passed, res.cases_total) if res.cases_total else (res.tests_passed, res.tests_total)
    return (passed or 0) / total if total else 0.0


def score_in_sandbox(client: SandboxClient, specs: Sequence[dict], completions: Sequence[str],
                     limits: Limits) -> list[float]:
    """The fraction of its spec's tests ({"language", "tests", optional "test_setup" and "solution_names"}) or
    stdin/stdout cases ({"language", "cases", "checker"}: judge mode) each completion's code passes, run in the
    sandbox as one batch; a sandbox fault (not the program's) raises."""
    reqs = []
    for spec, completion in zip(specs, completions):
        common = dict(language=spec.get("language") or "python", code=extract_code(completion), limits=limits)
        if spec.get("cases"):
            reqs.append(RunRequest(**common, cases=judge_cases(spec["cases"]), checker=spec.get("checker") or {}))
        else:
            reqs.append(RunRequest(**common, tests=list(spec["tests"]), test_setup=spec.get("test_setup") or "",
                                   solution_names=spec.get("solution_names")))
    return [pass_fraction(res) for res in client.run_batch(reqs)]


@dataclass
class CodeTask:
    sandbox_url: str = "http://127.0.0.1:8600"
    token: str | None = field(default_factory=lambda: os.environ.get("TIDE_SANDBOX_TOKEN"))
    timeout_s: float = CODE_LIMITS.timeout_s
    memory_mb: int = CODE_LIMITS.memory_mb
    name: str = "code"
    _client: SandboxClient | None = field(default=None, init=False, repr=False)

    @property
    def client(self) -> SandboxClient:
        if self._client is None:
            self._client = SandboxClient(self.sandbox_url, token=self.token)
        return self._client

    def _problem(self, rng: random.Random) -> Problem:
        spec = rng.choice(FAMILIES)(rng)
        answer = json.dumps({"language": "python", "tests": spec.tests, "reference": spec.reference})
        return Problem(self.name, spec.prompt + "\n", answer)

    def problems(self, seed: int, iteration: int, n: int) -> list[Problem]:
        rng = _rng(seed, 1, iteration)
        return [self._problem(rng) for _ in range(n)]

    def score(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[float]:
        return score_in_sandbox(self.client, [json.loads(p.answer) for p in problems], completions,
                                CODE_LIMITS.model_copy(update={"timeout_s": self.timeout_s,
                                                               "memory_mb": self.memory_mb}))

    def corpus(self) -> str:
        rng = _rng(0, 3)
        specs = [fam(rng) for fam in FAMILIES for _ in range(3)]
        return "".join(s.prompt + "\n" + s.reference for s in specs)

    def sft_conversations(self, seed: int, n: int) -> list[list[dict[str, str]]]:
        """The warm start of `agent.environment: code_feedback`: each problem answered right in one turn."""
        return [[{"role": "user", "content": p}, {"role": "assistant", "content": c}]
                for p, c in self.sft_examples(seed, n)]

    def sft_examples(self, seed: int, n: int) -> list[tuple[str, str]]:
        rng = _rng(seed, 2)
        out = []
        for _ in range(n):
            p = self._problem(rng)
            out.append((p.prompt, json.loads(p.answer)["reference"]))
        return out
