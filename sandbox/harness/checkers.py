"""Output checkers of judge mode (stdlib only: the judge driver runs this file inside the container too).

- exact: the output equals the expected one, ignoring trailing whitespace at line ends and trailing blank lines
  (what most online judges accept);
- tokens: the same whitespace-separated tokens;
- float: the same tokens, where a token that parses as a number on both sides may differ by abs_tol or by
  rel_tol times the expected value's magnitude (Codeforces' and DMOJ's floating checkers)."""
from __future__ import annotations

import math


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def exact(output: str, expected: str) -> bool:
    return _lines(output) == _lines(expected)


def tokens(output: str, expected: str) -> bool:
    return output.split() == expected.split()


def _number(token: str) -> float | None:
    try:
        value = float(token)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def floats(output: str, expected: str, abs_tol: float, rel_tol: float) -> bool:
    got, want = output.split(), expected.split()
    if len(got) != len(want):
        return False
    for g, w in zip(got, want):
        gv, wv = _number(g), _number(w)
        if gv is None or wv is None:
            if g != w:
                return False
        elif abs(gv - wv) > max(abs_tol, rel_tol * abs(wv)):
            return False
    return True


def check(kind: str, output: str, expected: str, abs_tol: float = 1e-6, rel_tol: float = 1e-6) -> bool:
    if kind == "exact":
        return exact(output, expected)
    if kind == "tokens":
        return tokens(output, expected)
    if kind == "float":
        return floats(output, expected, abs_tol, rel_tol)
    raise ValueError(f"unknown checker {kind!r}")
