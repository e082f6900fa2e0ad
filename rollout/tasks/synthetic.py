"""Synthetic verifiable tasks with exact-match rewards: small enough for a tiny model to learn on a CPU."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from .base import Problem
from .verifiers import exact_match, in_order_match


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
class MultiplyTask(_GeneratedTask):
    """`a*b=` -> the product, operands of `max_digits` digits: beyond a tiny model's own arithmetic, within reach
    with a `python` tool. Warm-start demonstrations call the tool and answer with what it printed."""

    max_digits: int = 3
    name: str = "multiply"

    def _problem(self, rng: random.Random) -> Problem:
        lo, hi = 10 ** (self.max_digits - 1), 10**self.max_digits - 1
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        text = f"{a}*{b}="
        return Problem(self.name, text, str(a * b), messages=({"role": "user", "content": text},))

    def sft_conversations(self, seed: int, n: int) -> list[list[dict]]:
        """The call in OpenAI's structured form (`tool_calls`): the agent writes it as its parser reads it."""
        rng = _rng(seed, 2)
        out = []
        for _ in range(n):
            p = self._problem(rng)
            code = f"print({p.prompt.rstrip('=')})"
            out.append([dict(p.messages[0]),
                        {"role": "assistant", "content": "",
                         "tool_calls": [{"type": "function", "function": {"name": "python", "arguments": {"code": code}}}]},
                        {"role": "tool", "content": p.answer},
                        {"role": "assistant", "content": p.answer}])
        return out

    def corpus(self) -> str:
        call = '<tool_call>{"name": "python", "arguments": {"code": "print(12*34)"}}</tool_call>'
        return "".join(f"{i}*{i}={i * i}\n" for i in range(10)) + call + "\nuser: assistant: tool: \n"


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


@dataclass
class CountTask(_GeneratedTask):
    """`count A to B:` -> `A A+1 ... B`: `length` consecutive numbers of `max_digits` digits each, one space
    apart. The tiny model's byte-level tokenizer spends a token per character, so an answer is length x
    (max_digits + 1) tokens with its end-of-sequence token (300 three-digit numbers: 1200): reasoning-length
    completions built from a step a tiny model learns (the previous number plus one). Scored by `in_order_match`:
    the share of the numbers written in the answer's order, each credited on its own, so a sample that slips once
    loses that number rather than the rest of the answer, while skipped, repeated or extra numbers never pay."""

    length: int = 300
    max_digits: int = 3
    sft_skip: float = 0.0  # the warm start's demonstrations skip the next number with this probability
    name: str = "count"

    def __post_init__(self) -> None:
        if self.length > 9 * 10 ** (self.max_digits - 1):
            raise ValueError(f"count: {self.length} consecutive numbers do not fit in {self.max_digits} digits")

    def _problem(self, rng: random.Random) -> Problem:
        first = rng.randint(10 ** (self.max_digits - 1), 10**self.max_digits - self.length)
        last = first + self.length - 1
        return Problem(self.name, f"count {first} to {last}:", " ".join(map(str, range(first, last + 1))))

    def score(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[float]:
        return [in_order_match(c, p.answer) for p, c in zip(problems, completions)]

    def sft_examples(self, seed: int, n: int) -> list[tuple[str, str]]:
        """The reference answers, or with `sft_skip` a sloppy teacher's: after each number it writes, the next is
        skipped with probability sft_skip (never the last, so every demonstration still ends at B). A warm start
        on them counts correctly but skips about sft_skip / (1 + sft_skip) of the answer, each skip a choice the
        reward's per-number credit charges for."""
        if not self.sft_skip:
            return super().sft_examples(seed, n)
        rng, skips = _rng(seed, 2), _rng(seed, 3)  # the exact demonstrations' prompts, skips drawn apart
        out = []
        for _ in range(n):
            problem = self._problem(rng)
            numbers = problem.answer.split()
            written, i = [], 0
            while i < len(numbers):
                written.append(numbers[i])
                i += 2 if i + 2 < len(numbers) and skips.random() < self.sft_skip else 1
            out.append((problem.prompt, " ".join(written)))
        return out

    def corpus(self) -> str:
        return "count 100 to 109: " + " ".join(map(str, range(100, 110))) + "\n"


# Short on purpose: a tiny model's byte-level tokenizer spends a token per character, and every turn's feedback
# stays in the context
def guess_prompt(high: int) -> str:
    return f"Guess my number, 1 to {high}. I say higher or lower."


def guess_feedback(guess: int, secret: int) -> str:
    return "higher" if guess < secret else "lower"


@dataclass
class GuessTask(_GeneratedTask):
    """The guessing game's problems (rollout/agent/environments.py GuessingGame, with `agent.environment: guess`):
    a secret number in 1..high per problem. Scored on its own (without the agent), a completion must name the
    secret in one guess. Warm-start demonstrations play games by guessing uniformly among the numbers the
    feedback so far allows."""

    high: int = 20
    name: str = "guess"
    max_turns: int = 8  # the demonstrations' length bound (the agent's max_turns)

    def _problem(self, rng: random.Random) -> Problem:
        secret = rng.randint(1, self.high)
        text = guess_prompt(self.high)
        return Problem(self.name, text, str(secret), messages=({"role": "user", "content": text},),
                       columns={"secret": secret, "high": self.high})

    def sft_conversations(self, seed: int, n: int) -> list[list[dict[str, str]]]:
        """n games played by a policy that never contradicts the feedback, the first message being the prompt."""
        rng = _rng(seed, 2)
        games = []
        for _ in range(n):
            secret, lo, hi = rng.randint(1, self.high), 1, self.high
            messages = [{"role": "user", "content": guess_prompt(self.high)}]
            for _turn in range(self.max_turns):
                guess = rng.randint(lo, hi)
                messages.append({"role": "assistant", "content": str(guess)})
                if guess == secret:
                    break
                lo, hi = (guess + 1, hi) if guess < secret else (lo, guess - 1)
                messages.append({"role": "user", "content": guess_feedback(guess, secret)})
            if messages[-1]["role"] != "assistant":
                messages.pop()
            games.append(messages)
        return games

    def corpus(self) -> str:
        lines = [guess_prompt(self.high)] + [guess_feedback(g, g + 1) + " " + guess_feedback(g + 1, g)
                                             for g in range(1, self.high)]
        return "\n".join(lines) + "\nuser: assistant: system: tool: \n"
