"""Benchmark goals (scripts/bench_common.py): a goal with a side that never reached its target is not met."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_common import Report, ratio_of  # noqa: E402


def test_two_failures_are_no_ratio():
    assert math.isnan(ratio_of(math.inf, math.inf))  # used to read 1.0: "as fast as each other"
    assert math.isnan(ratio_of(0.0, 0.0)) and math.isnan(ratio_of(math.nan, 2.0))
    assert ratio_of(6.0, 3.0) == 2.0 and ratio_of(3.0, 3.0) == 1.0 and ratio_of(1.0, 0.0) == math.inf


@pytest.mark.parametrize("tide,trl,met", [
    ([20, 30, 40], [25, 35, 45], True),
    ([math.inf] * 3, [math.inf] * 3, False),    # neither reached the target: met on the old ratio_of
    ([math.inf] * 3, [25, 35, 45], False),
    ([20, 30, 40], [math.inf] * 3, False),      # the baseline never got there: no comparison, not a win
    ([20, 30, math.inf], [25, 35, 45], False),  # one seed of one side failed
])
def test_sample_efficiency_goal_needs_both_sides_to_reach_the_target(tmp_path, tide, trl, met):
    """bench_sample_efficiency's goal, as it computes it: iterations to the target, lower is better."""
    report = Report("t", quick=True, out=tmp_path / "t.json")
    row = report.add("iterations to target", "tide", "trl", "iterations", tide, trl, higher_is_better=False)
    goal = report.goal("tide within 1.2x TRL's iterations (TRL / tide)", ratio_of(1.0, row["ratio"]), 1 / 1.2,
                       row=row)
    assert goal["met"] is met
    assert ("failed_sides" in goal) is any(math.isinf(x) for x in tide + trl)


@pytest.mark.parametrize("tide,trl,met", [([10.0], [12.0], True), ([math.inf], [math.inf], False),
                                          ([math.inf], [12.0], False), ([10.0], [math.inf], False)])
def test_e2e_goal_needs_both_sides_to_reach_the_target(tmp_path, tide, trl, met):
    """bench_e2e's goal: time to reward 0.5, TRL / tide."""
    report = Report("t", quick=True, out=tmp_path / "t.json")
    row = report.add("time to 0.5", "tide", "trl", "seconds", tide, trl, higher_is_better=False)
    goal = report.goal("time to 0.5 (TRL / tide)", ratio_of(row["baseline_median"], row["contender_median"]), 1.0,
                       row=row)
    assert goal["met"] is met


def test_every_goal_of_every_bench_names_its_row():
    """The class, not the case: each bench's goals pass the row their ratio comes from, so a failed side is
    seen (the one goal computed from a note, the sandbox's cell latency, has no baseline side)."""
    import re

    scripts = Path(__file__).resolve().parents[2] / "scripts"
    for path in sorted(scripts.glob("bench_*.py")):
        text = path.read_text()
        for call in re.finditer(r"report\.goal\((.*?)\)\n", text, re.S):
            if "session_cell_p50" in call.group(1):
                continue
            assert "row=" in call.group(1), f"{path.name}: {call.group(0)[:120]}"
