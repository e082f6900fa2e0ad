"""Tests mode outside Python, without containers: splitting tests into their two sides, reading values files
and the verdicts (sandbox/value_tests.py)."""
from __future__ import annotations

import os

import pytest

from sandbox.value_tests import Expected, judge, parse_values, read_values, split_test, valued
from sandbox.models import RunResult, Status


@pytest.mark.parametrize("language,test,value,expected", [
    ("javascript", "assert.deepEqual(candidate([1, 2]), [2, 1]);", "candidate([1, 2])", "[2, 1]"),
    ("javascript", "assert.strictEqual(f('a,b', \"(\"), `x${1}`, 'message')", "f('a,b', \"(\")", "`x${1}`"),
    ("typescript", "assert(f(1) === 'a == b')", "f(1)", "'a == b'"),
    ("cpp", "assert(candidate((3)) == (std::vector<long>({1, 2})));", "candidate((3))", "(std::vector<long>({1, 2}))"),
    ("c", "add(1, 2) == 3", "add(1, 2)", "3"),
    ("c", "(f(x) == 'a')", "f(x)", "'a'"),
    ("java", "assert(candidate(List.of(1)).equals((List.of(2))));", "candidate(List.of(1))", "(List.of(2))"),
    ("java", "Objects.equals(f(1), \"x\")", "f(1)", '"x"'),
    ("go", "reflect.DeepEqual(candidate([]int{1}), []int{2})", "candidate([]int{1})", "[]int{2}"),
    ("rust", "assert_eq!(candidate(vec![1, 2]), vec![2, 1]);", "candidate(vec![1, 2])", "vec![2, 1]"),
    ("rust", "candidate('(') == ')'", "candidate('(')", "')'"),
    ("ruby", "assert_equal([2, 1], candidate([1, 2]))", "candidate([1, 2])", "[2, 1]"),
    ("php", 'if (candidate("ab") !== [1, 2]) { throw new Exception("Test failed!"); }', 'candidate("ab")', "[1, 2]"),
    ("perl", "candidate(3) eq 'abc'", "candidate(3)", "'abc'"),
    ("perl", "is_deeply(candidate([1]), [1])", "candidate([1])", "[1]"),
    ("lua", "lu.assertEquals(candidate({1, 2}), {2, 1})", "candidate({1, 2})", "{2, 1}"),
    ("r", "if(!identical(candidate(3), 5)) {quit('no', 1)}", "candidate(3)", "5"),
    ("bash", '[[ $(candidate "3 4") = "5" ]]', '$(candidate "3 4")', '"5"'),
    ("bash", 'test "$(f 1)" == "a b"', '"$(f 1)"', '"a b"'),
])
def test_split(language, test, value, expected):
    s = split_test(language, test)
    assert (s.value, s.expected) == (value, expected)


@pytest.mark.parametrize("language,test", [
    ("c", "f(1) <= 3"), ("c", "a == b == c"), ("c", "f(1) != 2"), ("javascript", "console.log('x')"),
    ("javascript", "assert(!(f(1) == 2))"), ("bash", "add 1 2"), ("bash", "[ $(f) -eq 3 ]"), ("rust", "f(1) >= 2"),
    ("java", "f(1) == 2 && g(2) == 3 == true"),
])
def test_predicates_are_refused(language, test):
    with pytest.raises(ValueError, match="compares no value with an expected value"):
        split_test(language, test)


def test_values_file_duplicates_and_garbage():
    data = b"0\tok\t42\n1\terr\t\n2\tok\t1\n2\tok\t2\nnot a record\n9\tok\t5\n0x\tok\t1\n3\tmaybe\t1\n"
    assert parse_values(data, 4) == {0: (True, "42"), 1: (False, ""), 2: None}


def test_verdicts_name_why():
    tests = ["f(1) == 42", "f(2) == 3", "f(3) == 4", "f(4) == 5", "f(5) == 6"]
    expected = {0: (True, "42"), 1: (True, "3"), 2: (True, "4"), 3: (True, "5"), 4: (False, "")}
    got = {0: (True, "42"), 1: (True, "2"), 2: None, 3: (False, "")}
    v = judge(tests, expected, got)
    assert v.passed == 1
    assert [line.split(": ", 3)[-1] for line in v.failures] == [
        "got 2, expected 3", "more than one value was recorded for it", "it raised an error",
        "its expected value could not be evaluated"]
    r = valued(RunResult(status=Status.ok, stderr="user"), tests, Expected(expected, "tide: boom"), got)
    assert (r.tests_passed, r.tests_total) == (1, 5) and r.stderr.startswith("user\ntide: boom\ntide: test 1")


def test_values_file_is_read_without_following_links(tmp_path):
    (tmp_path / "v").write_bytes(b"0\tok\t1\n")
    assert read_values(str(tmp_path), "v", 100) == b"0\tok\t1\n"
    (tmp_path / "secret").write_text("host secret")
    os.symlink(tmp_path / "secret", tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")
    assert read_values(str(tmp_path), "link", 100) == b"" and read_values(str(tmp_path), "fifo", 100) == b""
    assert read_values(str(tmp_path), "missing", 100) == b""
