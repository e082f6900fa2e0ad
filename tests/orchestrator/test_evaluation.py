"""pass@k (Chen et al. 2021) against values computed by hand, and the eval section's validation."""
import pytest

from orchestrator.config.schema import ConfigError, parse_config
from orchestrator.iteration.evaluation import EVAL_STREAM, held_out_problems, pass_at_k
from rollout.tasks import AdditionTask


def test_pass_at_k_by_hand():
    # n = 4 completions, c correct: pass@1 = c / n; pass@n = 1 if any is correct
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 4) == 1.0
    # c = 2 of n = 4, k = 2: 1 - C(2, 2) / C(4, 2) = 1 - 1/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    # c = 1 of n = 5, k = 3: 1 - C(4, 3) / C(5, 3) = 1 - 4/10
    assert pass_at_k(5, 1, 3) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


def test_held_out_problems_are_fixed_and_not_the_training_stream():
    task = AdditionTask(2)
    a, b = held_out_problems(task, 1, 16), held_out_problems(task, 1, 16)
    assert a == b
    training = [p for it in range(1, 4) for p in task.problems(1, it, 16)]
    assert a != training[:16] and EVAL_STREAM > 10**9


def test_eval_section_is_validated_and_refused_by_the_jax_engine():
    assert parse_config({"name": "t", "iterations": 2, "eval": {"every": 5}}).eval.n_samples == 4
    with pytest.raises(ConfigError, match="eval.n_samples"):
        parse_config({"name": "t", "iterations": 2, "eval": {"n_samples": 0}})
    with pytest.raises(ConfigError, match="eval"):
        parse_config({"name": "j", "iterations": 2, "engine": "jax", "jax": {"env": "CartPole-v1"},
                      "eval": {"every": 1}})
