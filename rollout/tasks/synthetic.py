"""Synthetic verifiable tasks with exact-match rewards: small enough for a tiny model to learn on a CPU."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from .base import Problem
from .verifiers import exact_match


def _rng(seed: int, *stream: int) -> random.Random:
    # A pure function of (seed, stream): the problems of iteration i never depend on earlier draws.
    return random.Random(hash((seed, *stream)) & 0xFFFFFFFFFFFF)


class _GeneratedTask:
    """Problems drawn from `_problem(rng)`, scored by exact match against the reference answer."""

    def _problem(self, rng: random.Random) -> Problem:
        raise NotImplementedError

    def problems(self, seed: int, iteration: int, n: int) -> list[Problem]:
        rng = _rng(seed, 1, iteration)
        return [self._problem(rng) for _ in range(n)]

    def score(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[float]:
        return [exact_match(c, p.answer) for p, c in zip(problems, completions)]

    def sft_examples(self, seed: int, n: int) -> list[tuple[str, str]]:
        rng = _rng(seed, 2)
        return [(p.prompt, p.answer) for p in (self._problem(rng) for _ in range(n))]


@dataclass
class AdditionTask(_GeneratedTask):
    """`a+b=` -> `a+b` in decimal, operands with up to `max_digits` digits."""

    max_digits: int = 2
    name: str = "addition"

    def _problem(self, rng: random.Random) -> Problem:
        hi = 10**self.max_digits - 1
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        return Problem(self.name, f"{a}+{b}=", str(a + b))

    def corpus(self) -> str:
        return "".join(f"{i}+{i}={2 * i}\n" for i in range(10)) + "0123456789+=\n"


@dataclass
class ReverseTask(_GeneratedTask):
    """`reverse abc:` -> `cba` over a small alphabet."""

    length: int = 3
    alphabet: str = "abcde"
    name: str = "reverse"

    def _problem(self, rng: random.Random) -> Problem:
        s = "".join(rng.choice(self.alphabet) for _ in range(self.length))
        return Problem(self.name, f"reverse {s}:", s[::-1])

    def corpus(self) -> str:
        return f"reverse {self.alphabet}:{self.alphabet[::-1]}\n"
