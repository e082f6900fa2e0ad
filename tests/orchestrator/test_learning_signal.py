"""The no-learning-signal warning (orchestrator/iteration/learning_signal.py), on batches built by hand."""
from __future__ import annotations

from orchestrator.iteration.learning_signal import SignalWatch, has_spread
from rollout.samples import Sample, Samples
from rollout.tasks import Problem

PROBLEMS = [Problem("p0", "2+2=", "4", columns={"solution": "4"}), Problem("p1", "3+4=", "7", columns={"solution": "7"})]


def batch(rewards: list[list[float | None]]) -> Samples:
    """One group of samples per prompt, `rewards[prompt][sample]`."""
    return Samples([Sample(p, f"p{p}", [1], [2], [-0.1], text=f"answer {p}.{i}", reward=r)
                    for p, group in enumerate(rewards) for i, r in enumerate(group)])


def test_spread_is_within_a_group_or_with_one_sample_per_prompt_across_them():
    assert not has_spread(batch([[0.0, 0.0], [1.0, 1.0]]))  # different prompts, no spread within either
    assert has_spread(batch([[0.0, 1.0], [1.0, 1.0]]))
    assert not has_spread(batch([[0.5, None], [0.5, 0.5]]))  # a sample left out (None) is no spread
    assert has_spread(batch([[0.0], [1.0]])) and not has_spread(batch([[1.0], [1.0]]))


def test_the_warning_comes_after_n_flat_iterations_names_the_constant_function_and_clears():
    watch = SignalWatch(after=3)
    flat = batch([[0.0, 0.0], [0.0, 0.0]])
    values = {"reward 'accuracy_reward'": [0.0] * 4, "reward 'format'": [0.0, 0.0, 1.0, 1.0]}
    assert not watch.observe(1, PROBLEMS, flat, values) and not watch.observe(2, PROBLEMS, flat, values)
    assert watch.warning is None
    assert watch.observe(3, PROBLEMS, flat, values)
    w = watch.warning
    assert w.startswith("iterations 1-3: every prompt's samples got the same reward")
    assert "reward 'accuracy_reward' returned 0 for every sample" in w and "'format'" not in w
    assert "completion 'answer 0.0'" in w and "columns {answer: '4', solution: '4'}" in w
    assert "\\boxed{42}" in w
    assert not watch.observe(4, PROBLEMS, flat, values)  # said once per streak
    assert watch.observe(5, PROBLEMS, batch([[0.0, 1.0], [0.0, 0.0]]), values) and watch.warning is None
    for it in (6, 7):
        assert not watch.observe(it, PROBLEMS, flat, values)
    assert watch.observe(8, PROBLEMS, flat, values) and "iterations 6-8" in watch.warning


def test_no_constant_function_is_said_too_and_zero_means_never():
    watch = SignalWatch(after=1)
    assert watch.observe(1, PROBLEMS, batch([[0.0, 0.0], [1.0, 1.0]]), {"the addition task's verifier": [0, 0, 1, 1]})
    assert watch.warning.startswith("iteration 1: ") and "no reward function returned one constant value" in watch.warning
    never = SignalWatch(after=0)
    assert not any(never.observe(it, PROBLEMS, batch([[0.0, 0.0]]), {}) for it in range(1, 10))
