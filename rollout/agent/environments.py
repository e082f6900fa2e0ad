"""Multi-turn environments that are not tool calls: the model answers, the environment replies (feedback, a new
observation) and says when the episode ends and what it earned.

    env.reset(problem_columns) -> messages to start from
    env.step(assistant_text) -> Step(messages to append, reward, done, solved)

The contract of `step`, for every environment: `reward` is what the trajectory has earned should it end right after
this step, whoever ends it -- the environment (`done`), or tide at its limits (the turn ran out of tokens,
max_turns, max_total_tokens, the engines' context, a template that rewrites). The runner steps the environment on
every model turn, the one it ends the trajectory after included, keeps the last step's reward as the trajectory's,
and drops that step's messages when the trajectory does not go on (rollout/agent/episodes.py). So what an attempt
earns never depends on what cut the trajectory.

`GuessingGame` is PipelineRL's: a secret number in 1..N, "higher"/"lower" after each guess, and a reward that
falls with the number of guesses (1 on the first, falling linearly to 1/max_turns on the last allowed one, 0 when
never found), so that a policy learns to bisect rather than only to find.

`CodeFeedback` is code with execution feedback: the model's code runs against the problem's tests in the sandbox
(tests mode, verdicts the code cannot forge); the failing tests go back to the model, which tries again, up to
`max_turns`. The reward is the last attempt's pass fraction, as the `code` reward gives a single attempt: every
step returns its attempt's fraction."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Step:
    messages: list[dict[str, str]] = field(default_factory=list)
    reward: float = 0.0  # the trajectory's, should it end after this step (the module's contract)
    done: bool = False
    solved: bool = False  # the episode ended in success (the number found, every test passed)


class Environment(Protocol):
    def reset(self, columns: dict[str, Any]) -> list[dict[str, str]]: ...

    def step(self, assistant_text: str) -> Step: ...


_INT = re.compile(r"-?\d+")


@dataclass
class GuessingGame:
    high: int = 100
    max_turns: int = 8
    secret: int = 0
    turns: int = 0

    def reset(self, columns: dict[str, Any]) -> list[dict[str, str]]:
        from rollout.tasks.synthetic import guess_prompt

        self.high = columns.get("high", self.high)
        secret = columns.get("secret")
        if not isinstance(secret, int) or not 1 <= secret <= self.high:
            raise ValueError(f"the guessing game needs a `secret` column: an integer in 1..{self.high}, got {secret!r}")
        self.secret, self.turns = secret, 0
        return [{"role": "user", "content": guess_prompt(self.high)}]

    def step(self, assistant_text: str) -> Step:
        from rollout.tasks.synthetic import guess_feedback

        self.turns += 1
        found = _INT.findall(assistant_text)
        last_turn = self.turns >= self.max_turns
        if not found:
            return Step([{"role": "user", "content": "Answer with one number."}], 0.0, last_turn)
        guess = int(found[-1])
        if guess == self.secret:
            return Step([], self.reward(self.turns), True, solved=True)
        return Step([{"role": "user", "content": guess_feedback(guess, self.secret)}], 0.0, last_turn)

    def reward(self, turns: int) -> float:
        """1 for a first-guess find, falling by 1/max_turns per extra guess."""
        return 1.0 - (turns - 1) / self.max_turns


@dataclass
class CodeFeedback:
    client: Any  # sandbox.client.SandboxClient
    max_turns: int = 3
    limits: Any = None  # sandbox.models.Limits; None: the code reward's (rollout.tasks.code.CODE_LIMITS)
    max_feedback_chars: int = 1500
    tests: list[str] = field(default_factory=list)
    language: str = "python"
    turns: int = 0

    def reset(self, columns: dict[str, Any]) -> list[dict[str, str]]:
        tests, prompt = columns.get("tests"), columns.get("prompt")
        if not tests or not isinstance(prompt, str):
            raise ValueError("code with feedback needs `prompt` (the problem's text) and `tests` columns")
        self.tests, self.language, self.turns = list(tests), columns.get("language") or "python", 0
        return [{"role": "user", "content": prompt}]

    def step(self, assistant_text: str) -> Step:
        from rollout.tasks.code import CODE_LIMITS, extract_code, pass_fraction

        self.turns += 1
        r = self.client.run(self.language, extract_code(assistant_text), tests=self.tests,
                            limits=self.limits or CODE_LIMITS)
        fraction = pass_fraction(r)
        if fraction == 1.0 or self.turns >= self.max_turns:
            return Step([], fraction, True, solved=fraction == 1.0)
        passed, total = r.tests_passed or 0, r.tests_total or len(self.tests)
        detail = (r.stderr or r.stdout).strip()[-self.max_feedback_chars:]
        why = "" if r.status.value == "ok" else f" ({r.status.value.replace('_', ' ')})"
        return Step([{"role": "user", "content": f"{total - passed} of {total} tests failed{why}. Fix the code.\n"
                                                 f"{detail}"}], fraction, False)

