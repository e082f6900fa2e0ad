"""A run that cannot learn, said out loud: when every prompt's samples got one same reward for
`logging.no_signal_after` iterations in a row, group-relative advantages (GRPO, Shao et al. 2024, arXiv:2402.03300,
eq. 3; Dr. GRPO, RLOO likewise) are all zero and the policy gradient with them: the loss is 0 and nothing changes.
A reward function that cannot score what the model writes (TRL's `accuracy_reward` parses LaTeX answers: on plain
numbers it returns 0 for every completion) looks exactly like that, and a run of it would otherwise go on silently.

The warning names the reward functions whose values never changed over those iterations and shows one sample's
completion and columns (what the functions read), on the console and as status.json `warning`; the first iteration
with a spread again clears it."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rollout.samples import Samples
from rollout.tasks import Problem

SHOWN_CHARS = 200  # of a completion, and of each column's value, in the warning


@dataclass
class SignalWatch:
    after: int  # iterations in a row without a reward spread in any group before the warning; 0: never
    streak: list[int] = field(default_factory=list)  # the iterations of the current streak
    seen: dict[str, set] = field(default_factory=dict)  # each reward function's values over the streak
    warning: str | None = None

    def observe(self, iteration: int, problems: Sequence[Problem], samples: Samples,
                values: Mapping[str, Sequence[float | None]]) -> bool:
        """Take an iteration's scored samples and each reward function's values (by the name its metrics carry);
        True when `warning` changed (set, or cleared by a spread)."""
        if not self.after:
            return False
        if has_spread(samples):
            self.streak, self.seen = [], {}
            changed, self.warning = self.warning is not None, None
            return changed
        self.streak.append(iteration)
        for name, vs in values.items():
            self.seen.setdefault(name, set()).update(v for v in vs if v is not None)
        if len(self.streak) < self.after or self.warning is not None:
            return False
        self.warning = self._explain(problems, samples)
        return True

    def _explain(self, problems: Sequence[Problem], samples: Samples) -> str:
        first, last = self.streak[0], self.streak[-1]
        constant = {name: next(iter(vs)) for name, vs in self.seen.items() if len(vs) == 1}
        if constant:
            which = "; ".join(f"{name} returned {value:g} for every sample" for name, value in constant.items())
        else:
            which = ("no reward function returned one constant value: the rewards differ between prompts only, "
                     "never among one prompt's samples")
        sample = next((s for s in samples if s.reward is not None), samples.items[0] if len(samples) else None)
        shown = "" if sample is None else (f" One sample of iteration {last}: completion "
                                           f"{_clip(sample.text)}; columns {_columns(problems[sample.prompt_index])}.")
        span = f"iteration {first}" if first == last else f"iterations {first}-{last}"
        return (f"{span}: every prompt's samples got the same reward (zero_std_groups 1.0), so "
                f"the advantages and the policy gradient are zero and the policy learns nothing. {which}.{shown} "
                f"Check that the reward functions can score what the model writes against these columns (TRL's "
                f"accuracy_reward, for one, parses LaTeX answers such as \\boxed{{42}}: plain numbers score 0), "
                f"or that the task is within the model's reach (a warm start, an easier task, more samples per "
                f"prompt).")


def has_spread(samples: Samples) -> bool:
    """Whether some prompt's scored samples got different rewards (with one sample per prompt: whether the
    batch's did, what a baseline across prompts would see)."""
    groups = [rs for group in samples.groups().values() if (rs := [s.reward for s in group if s.reward is not None])]
    if groups and all(len(rs) == 1 for rs in groups):
        return len({rs[0] for rs in groups}) > 1
    return any(len(set(rs)) > 1 for rs in groups)


def _clip(value: object) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def _columns(problem: Problem) -> str:
    columns = {"answer": problem.answer, **problem.columns} if problem.answer_field is None else problem.columns
    return "{" + ", ".join(f"{k}: {_clip(v)}" for k, v in columns.items()) + "}"
