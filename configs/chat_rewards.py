"""A user reward function for configs/chat_dataset.yaml, written the way TRL's are: called by keyword with the
batch's prompts and completions (chat messages here: each completion is [{"role": "assistant", "content": ...}]),
every dataset column under its own name, and TRL's other keywords, which **kwargs takes; one float (or None) per
completion."""
from __future__ import annotations


def answer_only(completions, op, **kwargs):
    """1.0 when the completion is a bare number (no words around it), None on subtraction problems, so that
    only sums are shaped (an example of a function that applies to part of the data)."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [None if o == "-" else float(t.strip().lstrip("-").isdigit()) for t, o in zip(texts, op)]
