"""Tests mode outside Python: each test is a comparison, and the two sides are evaluated apart.

A test such as `add(2, 3) == 5` (or `assert.deepEqual(add(2, 3), 5)`, `assert_eq!(add(2, 3), 5)`, ...) is split
into the value under test (`add(2, 3)`, evaluated in a program with the solution) and the expected value (`5`,
evaluated earlier, in a container of its own, by a program without it). Each program writes one line per test,
`<index>\\t<ok|err>\\t<value in the language's canonical text form>`, to a file the service reads from outside;
the service compares the two texts. The expected values never exist inside the solution's container (they are
evaluated in another container, whose whole writable layer is gone before the solution's is made: no build
cache or temp file of theirs survives), so nothing the solution does -- exiting early, overriding equality, printing
verdicts, writing guesses into the values file, patching the harness -- can make a test pass without the right
value: a test with more than one record fails.

A test that compares nothing (`f(x) > 0`) cannot be judged this way and is refused with a message; Python's
tests mode (sandbox/harness/python_judge.py) judges any assertion.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass

from .models import RunRequest, RunResult

# Per language: calls whose two arguments are compared (with the index of the value under test first), calls
# that wrap a boolean expression, and infix equality operators (longest first).
_QUOTES = {"javascript": "'\"`", "typescript": "'\"`", "go": "'\"`", "rust": "\""}
_RULES: dict[str, tuple[dict[str, tuple[int, int]], tuple[str, ...], tuple[str, ...]]] = {
    "javascript": ({"assert.strictEqual": (0, 1), "assert.deepStrictEqual": (0, 1), "assert.equal": (0, 1),
                    "assert.deepEqual": (0, 1)}, ("assert", "assert.ok", "console.assert"), ("===", "==")),
    "c": ({}, ("assert",), ("==",)),
    "cpp": ({}, ("assert",), ("==",)),
    "java": ({"Objects.equals": (0, 1), "java.util.Objects.equals": (0, 1)}, ("assert",), ("==",)),
    "go": ({"reflect.DeepEqual": (0, 1)}, (), ("==",)),
    "rust": ({"assert_eq!": (0, 1)}, ("assert!",), ("==",)),
    "ruby": ({"assert_equal": (1, 0)}, ("assert",), ("==",)),
    "php": ({}, ("assert",), ("===", "==")),
    "perl": ({"is_deeply": (0, 1), "eq_deeply": (0, 1), "is": (0, 1)}, ("ok",), ("==", "eq")),
    "lua": ({"lu.assertEquals": (0, 1), "assertEquals": (0, 1)}, ("assert",), ("==",)),
    "r": ({"identical": (0, 1), "expect_equal": (0, 1), "expect_identical": (0, 1)}, ("stopifnot", "isTRUE"),
          ("==",)),
}
_RULES["typescript"] = _RULES["javascript"]
_OPERATOR_CHARS = set("=!<>")

FORMS = {
    "javascript": "`A === B`, `A == B`, assert.strictEqual/deepStrictEqual/equal/deepEqual(A, B)",
    "c": "`A == B` (optionally inside assert(...))",
    "java": "`A == B`, `A.equals(B)`, Objects.equals(A, B)",
    "go": "`A == B`, reflect.DeepEqual(A, B)",
    "rust": "`A == B`, assert_eq!(A, B), assert!(A == B)",
    "ruby": "`A == B`, assert_equal(expected, A)",
    "php": "`A === B`, `A == B`, `if (A !== B) { throw ...; }`",
    "perl": "`A == B`, `A eq B`, is_deeply(A, B), eq_deeply(A, B)",
    "lua": "`A == B`, lu.assertEquals(A, B)",
    "r": "`A == B`, identical(A, B), `if (!identical(A, B)) { quit('no', 1) }`",
    "bash": '`[ "$(f 1)" = 2 ]`, `[[ A == B ]]`, `test A = B`',
}
FORMS["typescript"], FORMS["cpp"] = FORMS["javascript"], FORMS["c"]


@dataclass(frozen=True)
class Split:
    value: str  # evaluated with the solution
    expected: str  # evaluated without it


def split_test(language: str, test: str) -> Split:
    """The two sides of a test, or ValueError naming the forms the language accepts."""
    found = _split_bash(test) if language == "bash" else _split_expr(language, test)
    if found is None or not found[0].strip() or not found[1].strip():
        raise ValueError(f"{language} test {test!r} compares no value with an expected value; write it as one of "
                         f"{FORMS[language]} (a predicate run beside the solution could be forged)")
    return Split(found[0].strip(), found[1].strip())


def _split_expr(language: str, test: str) -> tuple[str, str] | None:
    calls, wrappers, ops = _RULES[language]
    quotes = _QUOTES.get(language, "'\"")
    expr = _strip(test)
    # MultiPL-E's R and PHP form: `if (!identical(A, B)) { quit(...) }`, `if (A !== B) { throw ...; }`
    guard = re.fullmatch(r"if\s*\((.*)\)\s*\{[^{}]*\b(throw|quit|stop|die|exit)\b[^{}]*\}", expr, re.S)
    if guard:
        cond = guard.group(1).strip()
        if cond.startswith("!") and not cond.startswith("!="):
            expr = cond[1:].strip()
        else:
            hits = _operators(cond, ("!==", "!="), quotes)
            return (cond[:hits[0][0]], cond[hits[0][0] + len(hits[0][1]):]) if len(hits) == 1 else None
    for _ in range(3):  # assert(assert!(...)) is not a thing, but `assert((a == b))` is
        call = _call(expr, {**calls, **dict.fromkeys(wrappers)}, quotes)
        if call is None:
            break
        name, args = call
        if name in calls:
            i, j = calls[name]
            return (args[i], args[j]) if len(args) >= 2 else None
        if len(args) != 1:
            return None
        expr = _strip(args[0])
    while expr.startswith("(") and _closing(expr, 0, quotes) == len(expr) - 1:
        expr = expr[1:-1].strip()
    if language == "java":
        m = _method_equals(expr, quotes)
        if m:
            return m
    hits = _operators(expr, ops, quotes)
    if len(hits) != 1:
        return None
    at, op = hits[0]
    return expr[:at], expr[at + len(op):]


def _strip(s: str) -> str:
    return s.strip().rstrip(";").strip()


def _scan(s: str, quotes: str):
    """(index, char, depth) of every character outside string literals; depth counts open brackets."""
    depth, i, n = 0, 0, len(s)
    while i < n:
        c = s[i]
        if c in quotes or (c == "'" and "'" not in quotes and re.match(r"'(\\.|[^\\'])'", s[i:])):
            j = i + 1
            while j < n and s[j] != c:
                j += 2 if s[j] == "\\" else 1
            i = j + 1
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        yield i, c, depth
        i += 1


def _closing(s: str, open_at: int, quotes: str) -> int | None:
    for i, c, depth in _scan(s, quotes):
        if i > open_at and c in ")]}" and depth == 0:
            return i
    return None


def _call(expr: str, names: dict, quotes: str) -> tuple[str, list[str]] | None:
    m = re.match(r"([A-Za-z_][\w.:]*!?)\s*\(", expr)
    if not m or m.group(1) not in names:
        return None
    open_at = m.end() - 1
    if _closing(expr, open_at, quotes) != len(expr) - 1:
        return None
    return m.group(1), _top_commas(expr[open_at + 1:-1], quotes)


def _top_commas(s: str, quotes: str) -> list[str]:
    parts, start = [], 0
    for i, c, depth in _scan(s, quotes):
        if c == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return [p.strip() for p in parts]


def _method_equals(expr: str, quotes: str) -> tuple[str, str] | None:
    """Java's `A.equals(B)` with the call closing the expression."""
    last = None
    for i, c, depth in _scan(expr, quotes):
        if depth == 0 and expr.startswith(".equals(", i):
            last = i
    if last is None or _closing(expr, last + 7, quotes) != len(expr) - 1:
        return None
    return expr[:last], expr[last + 8:-1]


def _operators(expr: str, ops: tuple[str, ...], quotes: str) -> list[tuple[int, str]]:
    hits, skip_to = [], -1
    for i, _c, depth in _scan(expr, quotes):
        if i < skip_to or depth != 0:
            continue
        for op in ops:
            if not expr.startswith(op, i):
                continue
            before, after = expr[i - 1:i], expr[i + len(op):i + len(op) + 1]
            if op.isalpha():
                ok = not re.match(r"\w", before) and not re.match(r"\w", after) and i > 0
            else:
                ok = before not in _OPERATOR_CHARS and after not in _OPERATOR_CHARS
            if ok:
                hits.append((i, op))
                skip_to = i + len(op)
                break
    return hits


def _bash_words(s: str) -> list[str]:
    """Shell words at the top level: whitespace outside quotes, $(...), ${...} and backquotes separates them."""
    words, cur, depth, i, n = [], "", 0, 0, len(s)
    while i < n:
        c = s[i]
        if c in "'\"`":
            j = i + 1
            while j < n and s[j] != c:
                j += 2 if (s[j] == "\\" and c != "'") else 1
            cur += s[i:j + 1]
            i = j + 1
            continue
        if c == "\\" and i + 1 < n:
            cur += s[i:i + 2]
            i += 2
            continue
        if c in "({":
            depth += 1
        elif c in ")}":
            depth -= 1
        if c.isspace() and depth == 0:
            if cur:
                words.append(cur)
            cur = ""
        else:
            cur += c
        i += 1
    if cur:
        words.append(cur)
    return words


def _split_bash(test: str) -> tuple[str, str] | None:
    words = _bash_words(_strip(test))
    if words[:1] == ["test"]:
        inner = words[1:]
    elif len(words) >= 2 and (words[0], words[-1]) in (("[", "]"), ("[[", "]]")):
        inner = words[1:-1]
    else:
        return None
    if len(inner) == 3 and inner[1] in ("=", "=="):
        return inner[0], inner[2]
    return None


# ------------------------------------------------------------------ the values files

def parse_values(data: bytes, n: int) -> dict[int, tuple[bool, str] | None]:
    """index -> (evaluated, text) from a values file; None where an index has more than one record (a program
    that writes its guesses beside the harness's record gets no test from it). Other lines are ignored."""
    out: dict[int, tuple[bool, str] | None] = {}
    for line in data.decode("utf-8", "replace").split("\n"):
        parts = line.split("\t", 2)
        if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in ("ok", "err"):
            continue
        i = int(parts[0])
        if i >= n:
            continue
        out[i] = None if i in out else (parts[1] == "ok", parts[2])
    return out


@dataclass(frozen=True)
class Verdicts:
    passed: int
    failures: list[str]  # one line per failed test, for the run's stderr


def judge(tests: list[str], expected: dict[int, tuple[bool, str] | None],
          got: dict[int, tuple[bool, str] | None]) -> Verdicts:
    passed, failures = 0, []
    for i, test in enumerate(tests):
        want, have = expected.get(i), got.get(i)
        if want is None or not want[0]:
            why = "its expected value could not be evaluated"
        elif i in got and have is None:
            why = "more than one value was recorded for it"
        elif have is None:
            why = "no value (the program ended before it)"
        elif not have[0]:
            why = "it raised an error"
        elif have[1] != want[1]:
            why = f"got {_clip(have[1])}, expected {_clip(want[1])}"
        else:
            passed += 1
            continue
        failures.append(f"tide: test {i} failed: {_clip(test, 200)}: {why}")
    return Verdicts(passed, failures)


def _clip(s: str, n: int = 300) -> str:
    return s if len(s) <= n else s[:n] + "..."


def read_values(directory: str, name: str, max_bytes: int) -> bytes:
    """A values file from the host side of the sandbox's overlay, without following a symlink or waiting on a
    FIFO the code inside may have put in its place; b"" when it is missing or not a regular file."""
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return b""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
    except OSError:
        return b""
    finally:
        os.close(dfd)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return b""
        return f.read(max_bytes)


# ------------------------------------------------------------------ expected values and verdicts

VALUES_PATH = "/work/.tide_values"  # where the solution's program records its values
EXPECTED_DIR = ".tide_expected"  # under /work of the expected values' own container


@dataclass(frozen=True)
class Expected:
    values: dict[int, tuple[bool, str] | None]
    error: str = ""  # why the expected program did not run to its end, for the run's stderr


def expected_key(language: str, image: str, req: RunRequest) -> str:
    """What determines a request's expected values (language, image, tests, files): the n samples of one prompt
    share their tests, so their expected program runs once."""
    what = [language, image, req.tests, sorted(req.files.items()), sorted(req.binary_files.items())]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()


def valued(result: RunResult, tests: list[str], expected: Expected,
           got: dict[int, tuple[bool, str] | None]) -> RunResult:
    """The run's result with its tests counted; why each failed goes to the end of stderr."""
    v = judge(tests, expected.values, got)
    notes = ([expected.error] if expected.error else []) + v.failures
    stderr = result.stderr
    if notes:
        stderr += ("" if not stderr or stderr.endswith("\n") else "\n") + "\n".join(notes) + "\n"
    return result.model_copy(update={"tests_passed": v.passed, "tests_total": len(tests), "stderr": stderr})
