"""A user reward function for configs/chat_dataset.yaml, written the way TRL's are: called with the batch's
prompts and completions and every dataset column as a keyword; one float (or None) per completion."""
from __future__ import annotations


def answer_only(prompts, completions, op, **columns):
    """1.0 when the completion is a bare number (no words around it), None on subtraction problems, so that
    only sums are shaped (an example of a function that applies to part of the data)."""
    return [None if o == "-" else float(c.strip().lstrip("-").isdigit()) for c, o in zip(completions, op)]
