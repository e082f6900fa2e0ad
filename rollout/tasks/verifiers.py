"""Verifiers for math-style answers."""
from __future__ import annotations

import re
from bisect import bisect_left
from collections import defaultdict
from fractions import Fraction

_HASHES = re.compile(r"####\s*([^\n]*)")
_NUMBER = re.compile(r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:/\d+)?")


def exact_match(completion: str, answer: str) -> float:
    return float(completion.strip() == answer.strip())


def in_order_match(completion: str, answer: str) -> float:
    """The reference's whitespace-separated items that the completion writes in the reference's order (their
    longest common subsequence), over the longer of the two item counts: each item is credited on its own, so one
    slip costs its item rather than the rest of the answer, while skipped items earn nothing, repeated or extra
    items (a restated prompt, padding, counting past the end) each cost a share, and items out of order count
    only once in order. 1.0 only for the whole answer and nothing more."""
    want, got = answer.split(), completion.split()
    if not want:
        return exact_match(completion, answer)
    return _common_subsequence_length(want, got) / max(len(want), len(got))


def _common_subsequence_length(want: list[str], got: list[str]) -> int:
    """Hunt & Szymanski (1977, "A fast algorithm for computing longest common subsequences"): the LCS is the
    longest strictly increasing run of matching positions in `want`, taken in `got`'s order, each item's
    positions visited from last to first so that one item of `got` matches at most one of `want`; found by
    patience sorting in O((matches + n) log n) rather than the O(n x m) table."""
    positions: dict[str, list[int]] = defaultdict(list)
    for i, item in enumerate(want):
        positions[item].append(i)
    tails: list[int] = []  # tails[k]: the smallest last position of a common subsequence of length k + 1
    for item in got:
        for i in reversed(positions.get(item, ())):
            k = bisect_left(tails, i)
            if k == len(tails):
                tails.append(i)
            else:
                tails[k] = i
    return len(tails)


def last_boxed(text: str) -> str | None:
    r"""The contents of the last \boxed{...} (braces nested inside it kept), or None."""
    start = text.rfind("\\boxed")
    while start != -1:
        i = text.find("{", start)
        if i != -1 and not text[start + len("\\boxed"):i].strip():
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1:j]
        start = text.rfind("\\boxed", 0, start)
    return None


def extract_answer(text: str) -> str | None:
    r"""The final answer of a worked solution: the last \boxed{...}, else what follows the last `####`
    (GSM8K's marker), else the last number; None when there is none. Only the last candidate counts, so
    listing several answers gains nothing."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    marked = _HASHES.findall(text)
    if marked:
        return marked[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _number(text: str) -> Fraction | None:
    try:
        return Fraction(text.strip().replace(",", "").replace("$", ""))
    except (ValueError, ZeroDivisionError):
        return None


def numeric_match(completion: str, answer: str, rel_tol: float = 1e-6) -> float:
    """1.0 when the completion's answer (the whole completion if it is a number, else `extract_answer`'s) and
    the reference (likewise) are numbers (ints, decimals, fractions like 3/4) within rel_tol; exact match of
    the texts when the reference is not a number."""
    want = _number(answer)
    if want is None:
        extracted = extract_answer(answer)
        want = _number(extracted) if extracted is not None else None
    if want is None:
        return exact_match(completion, answer)
    got = _number(completion)
    if got is None:
        extracted = extract_answer(completion)
        got = _number(extracted) if extracted is not None else None
    return float(got is not None and abs(got - want) <= rel_tol * max(abs(want), 1))
