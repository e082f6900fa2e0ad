import json

import pytest

from rollout.tasks import AdditionTask, JsonlTask, ReverseTask, TaskDataError


def test_problems_are_a_pure_function_of_seed_and_iteration():
    t = AdditionTask(2)
    assert t.problems(1, 5, 8) == t.problems(1, 5, 8)
    assert t.problems(1, 5, 8) != t.problems(1, 6, 8)
    assert t.problems(1, 5, 8) != t.problems(2, 5, 8)


def test_addition_and_reverse_scores():
    a = AdditionTask(1)
    p = a.problems(0, 0, 1)[0]
    assert a.score([p, p], [p.answer, p.answer + "1"]) == [1.0, 0.0]
    r = ReverseTask(3)
    q = r.problems(0, 0, 1)[0]
    assert q.answer == q.prompt[len("reverse "):-1][::-1]


def test_jsonl_loader(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": i}) for i in range(5)))
    t = JsonlTask(str(f))
    first = t.problems(0, 0, 5)
    assert sorted(p.prompt for p in first) == [f"q{i}" for i in range(5)]  # one epoch covers every line once
    assert t.score(first[:1], [first[0].answer]) == [1.0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(TaskDataError, match="bad.jsonl:1"):
        JsonlTask(str(bad))
    with pytest.raises(TaskDataError, match="not found"):
        JsonlTask(str(tmp_path / "none.jsonl"))


def test_jsonl_epochs_follow_the_seeded_shuffle(tmp_path):
    """Iteration i takes items [i*n, (i+1)*n) of a stream in which every epoch is one seeded shuffle of the
    file: each epoch covers every line once, epochs differ, and the order is a pure function of the seed."""
    import random

    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": i}) for i in range(7)))
    t = JsonlTask(str(f))
    stream = [p.prompt for it in range(7) for p in t.problems(3, it, 3)]  # 21 items = 3 epochs
    for epoch in range(3):
        order = list(range(7))
        random.Random(hash((3, epoch)) & 0xFFFFFFFF).shuffle(order)
        assert stream[epoch * 7:(epoch + 1) * 7] == [f"q{i}" for i in order]
    assert JsonlTask(str(f)).problems(3, 5, 3) == t.problems(3, 5, 3)


def test_reasoning_gym_problems_and_its_own_scorer():
    from orchestrator.config.schema import ConfigError, parse_config
    from rollout.config import TaskConfig
    from rollout.tasks import make_task

    cfg = TaskConfig(name="reasoning_gym", dataset="basic_arithmetic", size=40,
                     config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
                             "allow_parentheses": False, "allow_negation": False})
    task, again = make_task(cfg, seed=5), make_task(cfg, seed=5)
    problems = task.problems(5, 2, 6)
    assert [p.prompt for p in problems] == [p.prompt for p in again.problems(5, 2, 6)]  # resumable
    for p in problems:
        a, b = p.prompt.removeprefix("Calculate ").rstrip(".").split(" + ")
        assert p.answer == str(int(a) + int(b))
    assert task.score(problems, [p.answer for p in problems]) == [1.0] * 6
    assert task.score(problems, ["x"] * 6) == [0.0] * 6
    held = task.held_out(5, 4)
    assert len(held) == 4 and task.score(held, [p.answer for p in held]) == [1.0] * 4
    with pytest.raises(TaskDataError, match="reasoning-gym dataset 'no_such_dataset'"):
        make_task(TaskConfig(name="reasoning_gym", dataset="no_such_dataset"))
    with pytest.raises(ConfigError, match="task.dataset"):
        parse_config({"name": "t", "iterations": 1, "task": {"name": "reasoning_gym"}})


def test_count_task_answers_and_in_order_reward():
    """count: `length` consecutive numbers of `max_digits` digits, a token per character (length x (digits + 1)
    tokens with the end of sequence); rewarded per number: the reference's numbers written in its order, over the
    longer of answer and completion, so that a slip costs one number, while skipping, repeating, counting past the
    end, restating the prompt or padding never pays."""
    from rollout.tasks import CountTask, in_order_match

    task = CountTask(length=300, max_digits=3)
    p = task.problems(0, 0, 1)[0]
    first = int(p.prompt.split()[1])
    assert p.prompt == f"count {first} to {first + 299}:" and 100 <= first <= 700
    assert p.answer.split() == [str(n) for n in range(first, first + 300)] and len(p.answer) == 300 * 4 - 1
    right = p.answer.split()

    def score(items: list[str]) -> float:
        return task.score([p], [" ".join(items)])[0]

    assert task.score([p], [p.answer]) == [1.0]
    assert score(right[:150]) == 0.5  # stopped halfway
    # one number wrong: it alone is lost
    assert score(right[:30] + [str(first + 31)] + right[31:]) == pytest.approx(299 / 300)
    # a slip that the count carries on from (..., 129, 140, 141, ...): the 10 skipped numbers are lost, and the 10
    # written past the end cost theirs
    carried = [str(n) for n in range(first, first + 30)] + [str(n) for n in range(first + 40, first + 310)]
    assert score(carried) == pytest.approx(290 / 300)
    # counting from a wrong first number: only the reference's numbers count, and those past its end cost theirs
    assert score([str(n) for n in range(first + 100, first + 400)]) == pytest.approx(200 / 300)
    assert score(right + [str(n) for n in range(first + 300, first + 400)]) == pytest.approx(300 / 400)
    # cheats: every number twice, the numbers out of order, skipping every other one, every three-digit number,
    # the prompt restated, text padding, other separators
    assert score([n for n in right for _ in (0, 1)]) == pytest.approx(300 / 600)
    assert score(right[::-1]) == pytest.approx(1 / 300)
    assert score(right[150:] + right[:150]) == 0.5
    assert score(right[::2]) == 0.5
    assert score([str(n) for n in range(100, 1000)]) == pytest.approx(300 / 900)
    assert task.score([p], [p.prompt + " " + p.answer]) == [pytest.approx(300 / 304)]
    assert task.score([p], [p.answer + " done, that is all"]) == [pytest.approx(300 / 304)]
    assert task.score([p], [",".join(right)]) == [0.0]
    assert task.score([p], [""]) == [0.0]
    assert in_order_match("1 2 3", "1 2 4") == pytest.approx(2 / 3) and in_order_match("", "") == 1.0
    assert in_order_match("a b a c", "a a b c") == pytest.approx(3 / 4)  # repeated items: each matched once
    with pytest.raises(ValueError, match="do not fit"):
        CountTask(length=901, max_digits=3)


def test_count_task_sloppy_demonstrations():
    """task.sft_skip: the warm start's demonstrations count from A, skip the next number with that probability
    after each one written, and still end at B; the share they leave out is sft_skip / (1 + sft_skip), which is
    what the reward charges them. 0 writes the reference answers; another task refuses the option by name."""
    from rollout.config import TaskConfig
    from rollout.tasks import CountTask

    exact = CountTask(length=300, max_digits=3)
    assert all(c == _problem(p).answer for p, c in exact.sft_examples(3, 4))
    sloppy = CountTask(length=300, max_digits=3, sft_skip=0.3)
    examples = sloppy.sft_examples(3, 40)
    assert [p for p, _ in examples] == [p for p, _ in exact.sft_examples(3, 40)]  # the same prompts
    written = 0
    for prompt, completion in examples:
        first, last = int(prompt.split()[1]), int(prompt.split()[3].rstrip(":"))
        numbers = [int(n) for n in completion.split()]
        assert numbers[0] == first and numbers[-1] == last
        steps = {b - a for a, b in zip(numbers, numbers[1:])}
        assert steps <= {1, 2} and 2 in steps
        written += len(numbers)
    left_out = 1 - written / (40 * 300)
    assert left_out == pytest.approx(0.3 / 1.3, abs=0.02)
    mean_reward = sum(sloppy.score([_problem(p)], [c])[0] for p, c in examples) / len(examples)
    assert mean_reward == pytest.approx(written / (40 * 300))
    assert TaskConfig(name="count", sft_skip=0.3).sft_skip == 0.3
    with pytest.raises(ValueError, match="task.sft_skip"):
        TaskConfig(name="addition", sft_skip=0.3)
    with pytest.raises(ValueError):
        TaskConfig(name="count", sft_skip=1.0)


def _problem(prompt: str):
    from rollout.tasks import Problem

    first, last = int(prompt.split()[1]), int(prompt.split()[3].rstrip(":"))
    return Problem("count", prompt, " ".join(map(str, range(first, last + 1))))
