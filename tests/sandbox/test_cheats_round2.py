"""The second cheat corpus, by class (issue 32): what one phase of a request leaves for the next, names and
comparisons the solution decides in Python's judge, control-flow exceptions, tolerances where the answer is
exact, state that crosses requests, and the limits of sessions and fetched files. Each class has several
members; every cheat scores 0 and the honest solution beside it passes."""
from __future__ import annotations

import base64
import threading
import time

import pytest

pytestmark = [pytest.mark.root, pytest.mark.timeout(240)]

MARKER = "tideExpectedMarker"
# Everything the solution's container holds outside /proc and /sys that the expected phase could have written:
# file names and contents with the marker. The solution's own sources never hold it joined (`tideExpec""ted...`).
PROBE = ("find /tmp /work /dev/shm /var/tmp 2>/dev/null | grep tideExpec''tedMarker; "
         "grep -rl tideExpec''tedMarker /tmp /work /dev/shm /var/tmp 2>/dev/null | sed s/^/CONTENT:/; echo PROBED")

# Per language: a test whose expected side writes the marker where a toolchain or a program could leave it (and
# holds it in its source, so a build cache of the expected program holds it too), and a solution that runs the
# probe before answering honestly. The expected phase used to run in the solution's container: Go's build cache
# under $HOME/.cache, files in /tmp, /work and /dev/shm all reached the solution.
LEFTOVERS = {
    "go": (["add(20, 22) == 42 + len(strings.Repeat(\"" + MARKER + "\", 0)) + func() int { os.WriteFile(\"/tmp/"
            + MARKER + "\", []byte(\"" + MARKER + "\"), 0o644); os.WriteFile(\"/dev/shm/" + MARKER
            + "\", nil, 0o644); return 0 }()"],
           "import (\n\t\"fmt\"\n\t\"os/exec\"\n)\n\nfunc init() {\n\tout, _ := exec.Command(\"sh\", \"-c\", `" + PROBE
           + "`).CombinedOutput()\n\tfmt.Print(string(out))\n}\n\nfunc add(a, b int) int { return a + b }"),
    "rust": (["add(20, 22) == 42 + { std::fs::write(\"/tmp/" + MARKER + "\", \"" + MARKER + "\").ok(); "
              "std::fs::write(\"/work/" + MARKER + "\", \"x\").ok(); 0 }"],
             "fn add(a: i64, b: i64) -> i64 { std::process::Command::new(\"sh\").args([\"-c\", \"" + PROBE
             + "\"]).status().ok(); a + b }"),
    "java": (["Solution.add(20, 22) == 42 + (new java.io.File(\"/tmp/" + MARKER + "\").mkdir() ? 0 : 0)"
              " + \"" + MARKER + "\".length() * 0"],
             "class Solution { static { try { new ProcessBuilder(\"sh\", \"-c\", \"" + PROBE
             + "\").inheritIO().start().waitFor(); } catch (Exception e) {} }\n"
             "  static Integer add(int a, int b) { return a + b; } }"),
    "javascript": (["add(20, 22) === 42 + (require('fs').mkdirSync('/tmp/.cache/" + MARKER + "', {recursive: true}),"
                    " require('fs').writeFileSync('/work/note', '" + MARKER + "'), 0)"],
                   "require('child_process').execSync(\"" + PROBE + "\", {stdio: 'inherit'});\n"
                   "function add(a, b) { return a + b; }"),
    "c": (["add(20, 22) == 42 + (fopen(\"/tmp/" + MARKER + "\", \"w\") ? 0 : 0) + (fopen(\"/dev/shm/x\", \"w\") ?"
           " fputs(\"" + MARKER + "\", fopen(\"/dev/shm/x\", \"w\")) * 0 : 0)"],
          "#include <stdlib.h>\n__attribute__((constructor)) static void probe(void) { system(\"" + PROBE + "\"); }\n"
          "int add(int a, int b) { return a + b; }"),
}


@pytest.mark.parametrize("language", sorted(LEFTOVERS))
def test_nothing_of_the_expected_phase_reaches_the_solution(client, require_language, language):
    require_language(language)
    tests, probe = LEFTOVERS[language]
    r = client.run(language, probe, tests=tests, limits={"timeout_s": 10})
    assert r.tests_passed == 1 and "PROBED" in r.stdout, r  # the probe ran and the expected values evaluated
    assert MARKER not in r.stdout and "CONTENT:" not in r.stdout, r.stdout


def test_a_relinked_go_build_cache_finds_no_expected_program(client, require_language):
    """The reported exploit's first step: the Go build cache holds nothing compiled from the expected side (the
    marker is joined at run time: a constant would put it in the solution's own archive)."""
    require_language("go")
    probe = ("import (\n\t\"fmt\"\n\t\"os\"\n\t\"path/filepath\"\n\t\"strings\"\n)\n\n"
             "func init() {\n\tn := 0\n\tfilepath.Walk(os.Getenv(\"HOME\"), func(p string, info os.FileInfo, err error)"
             " error {\n\t\tif err == nil && !info.IsDir() {\n\t\t\tb, _ := os.ReadFile(p)\n"
             "\t\t\tif strings.Contains(string(b), strings.Join([]string{\"tideGoExpec\", \"tedSide\"}, \"\")) {\n\t\t\t\tn++\n\t\t\t}\n\t\t}\n"
             "\t\treturn nil\n\t})\n\tfmt.Println(\"expected archives:\", n)\n}\n\nfunc add(a, b int) int { return a + b }")
    r = client.run("go", probe, tests=["add(1, 2) == 3 + len(strings.Repeat(\"tideGoExpectedSide\", 0))"])
    assert r.tests_passed == 1 and "expected archives: 0" in r.stdout, r


# ------------------------------------------------------------------ Python: names, comparisons, control flow

def _python(client, code, tests, **kw):
    return client.run("python", code, tests=tests, limits={"timeout_s": 5}, **kw)


NAME_CASES = {  # tests that rely on names given elsewhere, a cheat that defines them, the honest solution
    "math (MBPP's import in test_setup)": (
        ["assert math.isclose(area(2), 12.566, rel_tol=0.001)"], "import math",
        "class math:\n    isclose = staticmethod(lambda *a, **k: True)\ndef area(r): return 0",
        "import math\ndef area(r): return math.pi * r * r"),
    "math (no set-up given)": (
        ["assert math.isclose(area(2), 12.566, rel_tol=0.001)"], "",
        "class math:\n    isclose = staticmethod(lambda *a, **k: True)\ndef area(r): return 0",
        "import math\ndef area(r): return math.pi * r * r"),
    "re": (["assert re.fullmatch(r'[0-9]+', digits('a1b2'))"], "",
           "class re:\n    fullmatch = staticmethod(lambda *a: True)\ndef digits(s): return 'x'",
           "def digits(s): return ''.join(c for c in s if c.isdigit())"),
    "collections.Counter from the set-up": (
        ["assert Counter(letters('aab')) == Counter({'a': 2, 'b': 1})"], "from collections import Counter",
        "class Counter(dict):\n    def __init__(self, *a): pass\ndef letters(s): return []",
        "def letters(s): return list(s)"),
    "heapq": (["assert heapq.nsmallest(2, top('3 1 2')) == [1, 2]"], "",
              "class heapq:\n    nsmallest = staticmethod(lambda *a: [1, 2])\ndef top(s): return []",
              "def top(s): return [int(x) for x in s.split()]"),
    "a helper the task declares, not the solution": (
        ["assert is_even(double(3))"], "def is_even(n): return n % 2 == 0",
        "def is_even(n): return True\ndef double(n): return 7", "def double(n): return 2 * n"),
}


@pytest.mark.parametrize("case", sorted(NAME_CASES))
def test_solution_names_never_stand_in_for_the_tests_names(client, case):
    tests, setup, cheat, honest = NAME_CASES[case]
    assert _python(client, cheat, tests, test_setup=setup).tests_passed == 0, case
    r = _python(client, honest, tests, test_setup=setup)
    assert r.tests_passed == len(tests), r


def test_only_declared_solution_names_cross(client):
    tests = ["assert check(add)", "assert add(2, 3) == 5"]
    setup = "def check(f):\n    return f(1, 1) == 2"
    assert _python(client, "def add(a, b): return a + b", tests, test_setup=setup,
                   solution_names=["add"]).tests_passed == 2
    # a name the task did not declare stays the tests' own: here undefined, so the test fails
    r = _python(client, "def add(a, b): return a + b\nlimit = 7", ["assert limit == 7"], solution_names=["add"])
    assert r.tests_passed == 0 and "NameError" in r.stderr, r


_RUNNER = "import sys\nrunner = sys.modules['__main__']\n"  # python_runner.py: the solution's own process
COMPARISON_CHEATS = {  # HumanEval/12-like tests; no cheat computes an answer
    # the old protocol asked for the other side's type: answering None to a None request passed `== None`
    "answers None when asked for None": (
        _RUNNER + "runner._CONVERT['none'] = lambda o: None\nclass Lie:\n    pass\ndef longest(xs): return Lie()"),
    "answers whatever type it is asked for": (
        _RUNNER + "old = runner._convert\n"
        "def convert(obj, kind):\n    if type(obj).__name__ == 'Lie' and kind in ('none', 'str', 'list'):\n"
        "        return {'none': None, 'str': 'zz', 'list': ['zz']}[kind]\n    return old(obj, kind)\nrunner._convert = convert\nclass Lie:\n    pass\ndef longest(xs): return Lie()"),
    "a str subclass equal to everything": (
        "class S(str):\n    def __eq__(s, o): return True\n    __hash__ = str.__hash__\ndef longest(xs): return S('q')"),
    "a list subclass whose iteration lies": (
        "class L(list):\n    def __iter__(s): return iter(['bb'])\n    def __eq__(s, o): return True\n"
        "def longest(xs): return L()"),
    "a generator of whatever is asked": (
        "def longest(xs):\n    yield from ()"),
}
COMPARISON_TESTS = ["assert longest(['a', 'bb', 'c']) == 'bb'", "assert longest([]) == None",
                    "assert [longest(['xyz'])] == ['xyz']"]


@pytest.mark.parametrize("cheat", sorted(COMPARISON_CHEATS))
def test_comparisons_are_decided_by_the_judge(client, cheat):
    r = _python(client, COMPARISON_CHEATS[cheat], COMPARISON_TESTS)
    assert r.tests_passed == 0, (cheat, r)
    honest = "def longest(xs): return max(xs, key=len) if xs else None"
    assert _python(client, honest, COMPARISON_TESTS).tests_passed == len(COMPARISON_TESTS)


def test_plain_values_of_the_solutions_objects_compare_as_python_does(client):
    code = ("from collections import Counter, OrderedDict, namedtuple\nP = namedtuple('P', 'x y')\n"
            "def counts(s): return Counter(s)\ndef ordered(): return OrderedDict(a=1)\ndef point(): return P(1, 2)\n"
            "class I(int): pass\ndef seven(): return I(7)\ndef longest(xs): return max(xs, key=len) if xs else None")
    tests = ["assert counts('aab') == {'a': 2, 'b': 1}", "assert ordered() == {'a': 1}", "assert point() == (1, 2)",
             "assert seven() == 7 and seven() == 7.0", "assert counts('ab') == counts('ba')",
             "assert longest([]) == None", "assert longest(['a', 'bb']) == 'bb'", "assert counts('a') != {'a': 2}"]
    r = _python(client, code, tests)
    assert r.tests_passed == len(tests), r


CONTROL_FLOW = {  # each raises inside the call where the test's own iteration would end early and pass
    "StopIteration in map()": ("def f(x): raise StopIteration",
                               "assert all(map(lambda p: f(p[0]) == p[1], [(1, 2), (2, 3)]))"),
    "StopIteration in zip()": ("def f(x): raise StopIteration",
                               "assert all(a == b for a, b in zip(map(f, [1, 2]), [2, 3]))"),
    "StopIteration in filter()": ("def f(x): raise StopIteration",
                                  "assert not list(filter(lambda x: f(x) != x + 1, [1, 2]))"),
    "StopAsyncIteration": ("def f(x): raise StopAsyncIteration",
                           "assert all(map(lambda p: f(p[0]) == p[1], [(1, 2), (2, 3)]))"),
    "StopIteration from a method": ("class C:\n    def get(s, x): raise StopIteration\nc = C()",
                                    "assert not list(filter(lambda x: c.get(x) != x, [1, 2]))"),
    "SystemExit inside the call": ("import sys\ndef f(x): sys.exit(0)",
                                   "assert all(map(lambda p: f(p[0]) == p[1], [(1, 2), (2, 3)]))"),
    "KeyboardInterrupt inside the call": ("def f(x): raise KeyboardInterrupt",
                                          "assert all(map(lambda p: f(p[0]) == p[1], [(1, 2), (2, 3)]))"),
}


@pytest.mark.parametrize("cheat", sorted(CONTROL_FLOW))
def test_control_flow_exceptions_from_the_solution_fail_the_test(client, cheat):
    code, test = CONTROL_FLOW[cheat]
    assert _python(client, code, [test]).tests_passed == 0, cheat


def test_builtin_errors_still_reach_tests_that_expect_them(client):
    code = "def f(x):\n    if x < 0: raise ValueError('negative')\n    return x\ndef g(): return iter([1, 2])"
    tests = ["try:\n    f(-1)\n    assert False\nexcept ValueError:\n    pass", "assert list(g()) == [1, 2]",
             "assert [x for x in g()] == [1, 2]"]
    assert _python(client, code, tests).tests_passed == 3


# ------------------------------------------------------------------ the float checker

FLOAT_CASES = [  # (output, expected, accepted)
    ("123456689", "123456789", False), ("9.87654e+08", "987654321", False), ("987654321.0", "987654321", False),
    ("1e1", "10", False), ("0x10", "16", False), ("987654321", "987654321", True), ("+7", "7", True),
    ("3.1415927", "3.14159265", True), ("1e-7", "0", False), ("2.0000001", "2.0", True),
]


@pytest.mark.parametrize("output,expected,accepted", FLOAT_CASES)
def test_float_checker_checks_integers_exactly(output, expected, accepted):
    from sandbox.harness.checkers import check

    assert check("float", output, expected) is accepted
    assert check("float", output, expected, exact_integers=False) is (accepted or output not in ("0x10",))


def test_float_checker_in_judge_mode(client):
    cases = [{"stdin": "", "expected_stdout": "123456789 0.5\n"}]
    for out, verdict in (("123456689 0.5", "WA"), ("1.23456789e8 0.5", "WA"), ("123456789 0.5000001", "AC")):
        r = client.run("python", f"print({out!r})", cases=cases, checker={"kind": "float"})
        assert r.cases[0].verdict.value == verdict, (out, r)
    r = client.run("python", "print('123456689 0.5')", cases=cases, checker={"kind": "float", "exact_integers": False})
    assert r.cases[0].verdict.value == "AC", r


# ------------------------------------------------------------------ state that crosses requests

POISON = {  # a request whose own limits break the expected phase, then an honest one with the same tests
    "rust": (["add(1, 2) == 3"], "fn add(a: i64, b: i64) -> i64 { a + b }"),
    "cpp": (["f() == std::string(3000000, 'x')"], "#include <string>\nstd::string f() { return std::string(3000000, 'x'); }"),
}


@pytest.mark.parametrize("language", sorted(POISON))
def test_a_request_with_tiny_limits_does_not_poison_the_expected_values(client, require_language, language):
    require_language(language)
    tests, honest = POISON[language]
    client.run(language, honest, tests=tests, limits={"disk_mb": 1, "memory_mb": 64, "timeout_s": 1})
    r = client.run(language, honest, tests=tests, limits={"timeout_s": 10})
    assert r.tests_passed == len(tests), r


# ------------------------------------------------------------------ sessions

def test_delete_during_a_long_cell_frees_its_slot_at_once(client):
    sid = client.open_session(ttl_s=30)
    answer: dict = {}

    def long_cell():
        answer["r"] = client.run_in_session(sid, "import time\ntime.sleep(100000)", timeout_s=100000)
    t = threading.Thread(target=long_cell)
    t.start()
    time.sleep(1.0)  # the cell is running
    live = client.health().sessions  # a session counts until its container is gone and its seat free again
    assert live >= 1
    t0 = time.monotonic()
    client.close_session(sid)
    while client.health().sessions >= live and time.monotonic() - t0 < 10:
        time.sleep(0.02)
    freed_s = time.monotonic() - t0
    t.join(10)
    assert freed_s < 1.0, f"the session's seat was freed {freed_s:.2f} s after DELETE"
    assert answer["r"].status == "dead", answer["r"]


def test_cell_timeout_is_capped_by_the_sessions_ttl(client):
    sid = client.open_session(ttl_s=2)
    t0 = time.monotonic()
    r = client.run_in_session(sid, "import time\ntime.sleep(60)", timeout_s=100000)
    assert r.status == "timeout" and time.monotonic() - t0 < 10, r


def test_session_replies_are_bounded_and_cannot_be_forged(client):
    forge = ("import json, os, struct\nbody = json.dumps({'stdout': 'FORGED', 'display': [{'text/plain': 'z' * 100000}],"
             " 'error': []}).encode()\n"
             "for fd in range(3, 20):\n    try: os.write(fd, struct.pack('<I', len(body)) + body)\n"
             "    except OSError: pass\n")
    sid = client.open_session(limits={"output_kb": 1})
    big = client.run_in_session(sid, "'x' * 3_000_000")
    assert sum(len(d.get("text/plain", "")) for d in big.display) <= 1024, len(str(big))
    err = client.run_in_session(sid, "raise ValueError('y' * 3_000_000)")
    assert err.status == "error" and len(str(err.error)) <= 4096, len(str(err.error))
    forged = client.run_in_session(sid, forge)
    # what the cell wrote reached its own captured output at most (fd 3 and up include the capture memfds); the
    # forged message did not become its reply
    assert forged.stdout != "FORGED" and len(str(forged.display)) <= 1024, forged
    assert client.run_in_session(sid, "print('after', 1)").stdout == "after 1\n"
    assert client.run_in_session(sid, "print('after', 2)").stdout == "after 2\n"
    client.close_session(sid)


# ------------------------------------------------------------------ fetched files

def test_fetch_files_is_bounded_per_response(client):
    code = ("import os\nwith open('big', 'wb') as f:\n    f.truncate(8 << 20)\n"  # sparse: no block on disk
            "os.makedirs('d', exist_ok=True)\nos.link('big', 'd/big2')\n"
            "with open('small', 'w') as f:\n    f.write('ok')\n")
    names = ["big", "d//big2", "d/big2", "small", "big"] + [f"d/../big{i}" for i in range(3)]
    r = client.run("python", code, fetch_files=names, limits={"disk_mb": 16})
    total = sum(len(base64.b64decode(v)) for v in r.files.values())
    assert set(r.files) == {"big", "small"} and total == (8 << 20) + 2, (set(r.files), total)
    assert "the same file as 'big'" in r.stderr, r.stderr
    r = client.run("python", code.replace("8 << 20", "200 << 20"), fetch_files=["big", "small"],
                   limits={"disk_mb": 16})
    assert set(r.files) == {"small"} and "cap" in r.stderr, (set(r.files), r.stderr)


def test_session_reply_fields_are_bounded_whatever_the_driver_sends():
    from sandbox.sessions import bounded_result

    reply = {"stdout": "a" * 5000, "stderr": 7, "display": [{"text/plain": "x" * 600}, {"text/plain": "y" * 600}, 3],
             "error": [{"ename": 1, "evalue": "v", "traceback": ["t", {"x": 1}]}]}
    r = bounded_result(reply, 1024, 1.0)
    assert len(r.stdout) == 1024 and r.stderr == "" and r.status == "error"
    assert r.display[0] == {"text/plain": "x" * 600} and "left out" in r.display[1]["text/plain"] and len(r.display) == 2
    assert r.error == [{"ename": "", "evalue": "v", "traceback": ["t"]}]
