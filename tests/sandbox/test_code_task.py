"""The coding task's reward through the real sandbox service (only sandbox.client is used)."""
from __future__ import annotations

import json

import pytest

from rollout.tasks.base import Task
from rollout.tasks.code import CodeTask, extract_code

pytestmark = [pytest.mark.root, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def task(service) -> CodeTask:
    return CodeTask(sandbox_url=service.url, token="test-token")


def test_protocol_and_determinism(task):
    assert isinstance(task, Task)
    assert task.problems(1, 3, 5) == task.problems(1, 3, 5)
    assert task.problems(1, 3, 5) != task.problems(1, 4, 5)
    assert "def f" in task.corpus()


def test_rewards(task):
    probs = task.problems(seed=7, iteration=0, n=10)
    refs = [json.loads(p.answer)["reference"] for p in probs]
    assert task.score(probs, refs) == [1.0] * 10
    assert task.score(probs, [f"```python\n{r}```\nexplanation" for r in refs]) == [1.0] * 10
    bad = task.score(probs, ["def f(*a):\n    return None\n"] * 10)
    assert bad == [0.0] * 10
    assert task.score(probs[:2], ["this is not python", "while True: pass"]) == [0.0, 0.0]


def test_partial_credit(task):
    p = task.problems(seed=1, iteration=0, n=1)[0]
    tests = json.loads(p.answer)["tests"]
    # Answers right only for the first test's input: 1 of 4.
    arg, expected = tests[0][len("assert f("):].split(") == ")
    cheat = f"def f(*a):\n    return {expected} if a == ({arg},) else object()\n"
    assert task.score([p], [cheat]) == [pytest.approx(0.25)]
    sft = task.sft_examples(0, 3)
    assert len(sft) == 3 and all("def f" in c for _, c in sft)


def test_extract_code():
    assert extract_code("x\n```py\nprint(1)\n```") == "print(1)\n"
    assert extract_code("print(2)") == "print(2)"


def test_code_as_a_reward_function(service, monkeypatch):
    """`rewards: [{fn: code}]`: a `tests` column (with `language`), or the JSON spec in `answer`; a problem with
    neither is not applicable (None); the same sandbox verdicts as the task's scorer."""
    from orchestrator.rewards.functions import RewardFunctions, RewardSpec

    monkeypatch.setenv("TIDE_SANDBOX_TOKEN", "test-token")  # read by the (spawned) reward worker
    spec = json.dumps({"language": "python", "tests": ["assert f(2) == 4", "assert f(0) == 0"]})
    fns = RewardFunctions([RewardSpec(fn="code")], sandbox_url=service.url)
    try:
        got = fns.score(["p"] * 4,
                        ["def f(x):\n    return 2 * x\n", "```python\ndef f(x):\n    return x * x\n```",
                         "def f(x):\n    return 4\n", "anything"],
                        {"answer": [spec, "", spec, "42"],
                         "tests": [None, ["assert f(3) == 9"], None, None],
                         "language": [None, "python", None, None]})
    finally:
        fns.close()
    assert got.rewards == [1.0, 1.0, 0.5, None]
    with pytest.raises(Exception, match="needs a sandbox"):
        RewardFunctions([RewardSpec(fn="code")])


def test_code_reward_judges_stdin_stdout_cases(service, monkeypatch):
    """`cases` (and `checker`) columns or a JSON spec with cases: the sandbox's judge mode, the share of cases
    accepted; CodeContests' {"input": [...], "output": [...]} as it comes."""
    from orchestrator.rewards.functions import RewardFunctions, RewardSpec

    monkeypatch.setenv("TIDE_SANDBOX_TOKEN", "test-token")
    cases = [{"stdin": "1 2\n", "expected_stdout": "3\n"}, {"input": "2 2\n", "output": "4\n"}]
    contests = {"input": ["1 2\n", "5 5\n", "0 0\n", "9 1\n"], "output": ["3\n", "10\n", "0\n", "10.0\n"]}
    spec = json.dumps({"language": "cpp", "cases": cases})
    add = "a, b = map(int, input().split())\nprint(a + b)"
    cpp = "#include <cstdio>\nint main() { long a, b; scanf(\"%ld %ld\", &a, &b); printf(\"%ld\\n\", a + b); }"
    fns = RewardFunctions([RewardSpec(fn="code")], sandbox_url=service.url)
    try:
        got = fns.score(["p"] * 5, [add, f"```python\n{add}\n```", "print(3)", add, f"```cpp\n{cpp}\n```"],
                        {"answer": ["", "", "", "", spec],
                         "cases": [cases, contests, cases, contests, None],
                         "checker": [None, {"kind": "float"}, None, None, None],
                         "language": ["python", "python", "python", None, None]})
    finally:
        fns.close()
    # exact checker: "10.0" is not "10"; the float checker accepts it; print(3) passes only the first case
    assert got.rewards == [1.0, 1.0, 0.5, 0.75, 1.0]
