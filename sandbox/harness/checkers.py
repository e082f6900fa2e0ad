"""Output checkers of judge mode (stdlib only: the judge driver runs this file inside the container too).

- exact: the output equals the expected one, ignoring trailing whitespace at line ends and trailing blank lines
  (what most online judges accept);
- tokens: the same whitespace-separated tokens;
- float: the same tokens, where a token that parses as a number on both sides may differ by abs_tol or by
  rel_tol times the expected value's magnitude (testlib's rcmp and DMOJ's floats checkers), except that a token
  the expected output writes as an integer (`-?[0-9]+`) must be the same integer, written as one (`9.87654e+08`
  is not 987654321, nor is 123456689 within 1e-6 of 123456789): an answer written exactly is checked exactly.
  `exact_integers=False` gives every number the tolerance, as testlib and DMOJ do."""
from __future__ import annotations

import math
import re

_INTEGER = re.compile(r"[+-]?[0-9]+")


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


def floats(output: str, expected: str, abs_tol: float, rel_tol: float, exact_integers: bool = True) -> bool:
    got, want = output.split(), expected.split()
    if len(got) != len(want):
        return False
    for g, w in zip(got, want):
        if exact_integers and _INTEGER.fullmatch(w):
            if not (_INTEGER.fullmatch(g) and int(g) == int(w)):
                return False
            continue
        gv, wv = _number(g), _number(w)
        if gv is None or wv is None:
            if g != w:
                return False
        elif abs(gv - wv) > max(abs_tol, rel_tol * abs(wv)):
            return False
    return True


def check(kind: str, output: str, expected: str, abs_tol: float = 1e-6, rel_tol: float = 1e-6,
          exact_integers: bool = True) -> bool:
    if kind == "exact":
        return exact(output, expected)
    if kind == "tokens":
        return tokens(output, expected)
    if kind == "float":
        return floats(output, expected, abs_tol, rel_tol, exact_integers)
    raise ValueError(f"unknown checker {kind!r}")
