"""Answer extraction and numeric matching, with a corpus of completions that try to collect reward they did not
earn."""
import pytest

from rollout.tasks.verifiers import extract_answer, last_boxed, numeric_match


@pytest.mark.parametrize("text,expected", [
    ("so the total is \\boxed{42}.", "42"),
    ("\\boxed{\\frac{3}{4}} is the answer", "\\frac{3}{4}"),  # nested braces kept
    ("first \\boxed{1}, then \\boxed {2}", "2"),  # the last one
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),  # GSM8K
    ("#### 5\nno wait\n#### 6", "6"),
    ("3 apples plus 4 apples make 7 apples", "7"),  # the last number
    ("it costs 1,250.50 dollars", "1,250.50"),
    ("a fraction: -3/8", "-3/8"),
    ("no digits here", None),
    ("\\boxed{unclosed", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_boxed_needs_its_brace():
    assert last_boxed("\\boxedx{1}") is None and last_boxed("\\boxed{a}{b}") == "a"


def test_numeric_match_by_hand():
    assert numeric_match("0.75", "3/4") == 1.0
    assert numeric_match("1,000", "1000") == 1.0
    assert numeric_match("abc", "1") == 0.0
    assert numeric_match("The answer is \\boxed{72}.", "72") == 1.0
    assert numeric_match("step by step ... #### 72", "#### 72") == 1.0  # a GSM8K reference solution
    assert numeric_match("48/2 = 24, 48 + 24 = 72", "Natalia sold ... #### 72") == 1.0
    assert numeric_match("$18", "18") == 1.0
    assert numeric_match("yes", "yes") == 1.0 and numeric_match("no", "yes") == 0.0  # non-numeric references


# Completions a policy searching for reward holes would try; none may score.
CHEATS = [
    "\\boxed{72} \\boxed{73}",  # several boxed answers: only the last counts
    "#### 72\n#### 71",  # several markers: only the last counts
    "72 73 74 75",  # enumerating candidates: only the last number counts
    "\\boxed{71} but 72",  # a boxed answer outranks a later bare number
    "\\boxed{}",  # empty box
    "72/0",  # division by zero
    "",  # nothing
    "7 2",  # digits split
    "\\boxed{72",  # unclosed box, wrong last number? (no: the last number is 72: see below)
]


@pytest.mark.parametrize("completion", CHEATS[:-1])
def test_cheats_score_nothing(completion):
    assert numeric_match(completion, "72") == 0.0


def test_an_unclosed_box_falls_back_to_the_last_number():
    """Not a cheat: the answer is there, just badly formatted; the last number is the final answer."""
    assert numeric_match(CHEATS[-1], "72") == 1.0
