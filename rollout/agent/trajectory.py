"""Multi-turn trajectories, token-in/token-out: the model's tokens are kept exactly as sampled, never decoded and
re-encoded; only the messages tide inserts (tool results, environment feedback) are tokenised, as the suffix the
chat template adds after the model's turn.

The suffix is found by rendering: with the template, the conversation up to and including the model's turn (P)
and the same conversation with the new messages and the next generation prompt (F). F must start with P (the
template only appends; otherwise `NotAppendOnly`, naming the template's change). The inserted tokens are then
(1) what the template puts after the model's last sampled token that the model did not sample itself -- e.g.
the "\\n" a ChatML template writes after `<|im_end|>`, where generation stopped; dropping it is the
re-tokenisation drift of veRL #6501 / TRL #5224 -- and (2) F minus P. Renderings keep what tools and
environments return as data: their text never becomes a control token (rollout/agent/rendering.py).

Per token: the loss mask (1 for sampled tokens, 0 for the prompt and inserted tokens), the behaviour log-prob
(sampled tokens; 0.0 elsewhere) and the policy version that produced it (-1 for tokens no policy produced)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .rendering import render


class NotAppendOnly(ValueError):
    """The chat template rewrote earlier turns when a message was added (e.g. it strips past reasoning)."""


@dataclass
class Trajectory:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)  # everything after the prompt, in order
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0
    # the experts a mixture-of-experts model routed each position to [positions, layers, top_k] (the engine's turn
    # records merged: rollout/routing_capture.extend_record); None for a dense model
    routing: Any = None

    def add_sampled(self, ids: list[int], logprobs: list[float], version: int) -> None:
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} sampled tokens with {len(logprobs)} log-probs")
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += logprobs
        self.versions += [version] * len(ids)
        self.turns += 1

    def add_inserted(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def copy(self) -> "Trajectory":
        """The trajectory so far, as lists of its own: what this copy is extended with leaves the original as it
        was (a batch that set it aside still reads the tokens it had then)."""
        return Trajectory(list(self.prompt_ids), list(self.ids), list(self.mask), list(self.logprobs),
                          list(self.versions), self.turns, self.routing)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.ids

    @property
    def last_turn(self) -> list[int]:
        """The tokens of the last sampled turn: the run of mask-1 tokens at the end."""
        n = len(self.mask)
        while n and self.mask[n - 1] == 1:
            n -= 1
        return self.ids[n:]

    @property
    def masked_share(self) -> float:
        """The share of the completion's tokens that tide inserted (not trained on)."""
        return 1 - sum(self.mask) / len(self.mask) if self.mask else 0.0


def inserted_tokens(tokenizer, messages: list[dict[str, Any]], new_messages: list[dict[str, Any]],
                    sampled: list[int], tools: list[dict] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """The tokens to append after the model's `sampled` turn (the last of `messages`, an assistant message with
    its text) so that the trajectory continues as the template renders `messages + new_messages` with a
    generation prompt; see the module's docstring. `template_kwargs`: the template's variables."""
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("the last message must be the model's (assistant) turn the tokens were sampled for")
    before = render(tokenizer, messages[:-1], tools, True, template_kwargs)  # what the model continued from
    turn = render(tokenizer, messages, tools, False, template_kwargs)
    full = render(tokenizer, messages + new_messages, tools, True, template_kwargs)
    for shorter, longer, what in ((before, turn, "the model's turn"), (turn, full, "the new messages")):
        if longer[:len(shorter)] != shorter:
            at = next(i for i, (a, b) in enumerate(zip(shorter, longer)) if a != b) if any(
                a != b for a, b in zip(shorter, longer)) else len(longer)
            raise NotAppendOnly(
                f"the chat template rewrites the conversation when {what} is added (first differing token at "
                f"{at}: {tokenizer.decode(shorter[at:at + 8])!r} -> {tokenizer.decode(longer[at:at + 8])!r}); "
                f"tide continues trajectories only under templates that append")
    rendered_turn = turn[len(before):]
    return _trailer(rendered_turn, sampled) + full[len(turn):]


def _trailer(rendered_turn: list[int], sampled: list[int]) -> list[int]:
    """What the template writes after the model's last sampled token that the model did not sample: the template's
    rendering of the turn from just after the last occurrence of the sampled sequence's final token."""
    if not sampled:
        return rendered_turn
    last = sampled[-1]
    positions = [i for i, t in enumerate(rendered_turn) if t == last]
    if not positions:
        raise NotAppendOnly(f"the template's rendering of the model's turn does not hold its last sampled token "
                            f"({last}): where the turn ends cannot be told, so the trajectory cannot continue "
                            f"without re-encoding it")
    return rendered_turn[positions[-1] + 1:]


def demonstration(tokenizer, messages: list[dict[str, Any]], prompt_messages: int, end_of_turn: list[int],
                  tools: list[dict] | None = None, template_kwargs: Mapping[str, Any] | None = None) -> Trajectory:
    """A written conversation laid out token for token as a rollout would lay it out (for supervised warm starts):
    the first `prompt_messages` messages as the prompt, each assistant turn as the model would sample it -- its
    rendering through the end-of-turn token (`end_of_turn`: the template's, or EOS), mask 1 -- and everything else
    inserted exactly as `inserted_tokens` inserts it during rollouts, mask 0."""
    traj = Trajectory(render(tokenizer, messages[:prompt_messages], tools, True, template_kwargs))
    k = prompt_messages
    while k < len(messages):
        if messages[k].get("role") != "assistant":
            raise ValueError(f"demonstration message {k} is a {messages[k].get('role')!r} message where the model's "
                             f"turn is due")
        rendered = render(tokenizer, messages[:k + 1], tools, False, template_kwargs)
        if rendered[:len(traj.all_ids)] != traj.all_ids:
            raise NotAppendOnly("the chat template rewrites earlier turns of the demonstration")
        turn = rendered[len(traj.all_ids):]
        ends = [i for i, t in enumerate(turn) if t in end_of_turn]
        sampled = turn[:ends[-1] + 1] if ends else turn
        traj.add_sampled(sampled, [0.0] * len(sampled), -1)
        j = k + 1
        while j < len(messages) and messages[j].get("role") != "assistant":
            j += 1
        if j < len(messages):
            traj.add_inserted(inserted_tokens(tokenizer, messages[:k + 1], messages[k + 1:j], sampled, tools,
                                              template_kwargs))
        k = j
    return traj
