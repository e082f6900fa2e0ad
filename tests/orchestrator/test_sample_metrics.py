"""The per-iteration figures of the samples, by hand: reward spreads (TRL's batch std and GRPO's in-group
std), groups with no signal, completion lengths and the share cut at max_new_tokens; the completions logged."""
import math
import statistics

import pytest

from orchestrator.iteration.sample_metrics import sample_metrics, sample_records
from rollout.samples import Sample, Samples
from rollout.tasks import Problem


def _samples() -> Samples:
    # prompt 0: rewards 1, 0 (lengths 2, 4, the second cut); prompt 1: 1, 1; prompt 2: None, 0.5 (one skipped)
    spec = [(0, 1.0, 2, "stop"), (0, 0.0, 4, "length"), (1, 1.0, 1, "stop"), (1, 1.0, 3, "stop"),
            (2, None, 4, "length"), (2, 0.5, 2, "stop")]
    out = Samples()
    for i, (p, r, n, why) in enumerate(spec):
        s = Sample(p, "t", [7] * (p + 2), [5] * n, [-0.1] * n, text=f"c{i}", finish_reason=why)
        s.reward = r
        out.items.append(s)
    return out


def test_sample_metrics_by_hand():
    m = sample_metrics(_samples())
    assert m["reward_std"] == pytest.approx(statistics.stdev([1.0, 0.0, 1.0, 1.0, 0.5]))  # Bessel, as TRL
    assert m["reward_std_in_group"] == pytest.approx((0.5 + 0.0 + 0.0) / 3)  # population std per prompt
    assert m["zero_std_groups"] == pytest.approx(2 / 3)  # prompt 1 (1, 1) and prompt 2 (one reward left)
    assert (m["completion_len"], m["completion_len_min"], m["completion_len_max"]) == (16 / 6, 1, 4)
    assert m["clipped_ratio"] == pytest.approx(2 / 6)
    assert m["prompt_tokens"] == 2 + 3 + 4  # each prompt once


def test_no_rewarded_sample_gives_nan_not_an_error():
    s = _samples()
    for x in s:
        x.reward = None
    m = sample_metrics(s)
    assert math.isnan(m["reward_std"]) and math.isnan(m["zero_std_groups"])


def test_sample_records_take_the_first_sample_of_the_first_prompts_with_logged_columns():
    problems = [Problem("t", f"q{i}", "a") for i in range(3)]
    records = sample_records(4, problems, _samples(), 2, {"pred": [f"p{i}" for i in range(6)]})
    assert [(r["prompt"], r["completion"], r["pred"], r["reward"]) for r in records] == \
        [("q0", "c0", "p0", 1.0), ("q1", "c2", "p2", 1.0)]
    assert records[0] == {"iteration": 4, "prompt": "q0", "completion": "c0", "reward": 1.0,
                               "completion_tokens": 2, "finish_reason": "stop", "pred": "p0"}
    assert sample_records(4, problems, _samples(), 0) == []
