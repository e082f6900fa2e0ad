"""Verifiers for math-style answers."""
from __future__ import annotations

from fractions import Fraction


def exact_match(completion: str, answer: str) -> float:
    return float(completion.strip() == answer.strip())


def numeric_match(completion: str, answer: str, rel_tol: float = 1e-6) -> float:
    """1.0 when both parse as numbers (ints, decimals, fractions like 3/4) and agree within rel_tol."""
    try:
        got, want = Fraction(completion.strip().replace(",", "")), Fraction(answer.strip().replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return exact_match(completion, answer)
    return float(abs(got - want) <= rel_tol * max(abs(want), 1))
