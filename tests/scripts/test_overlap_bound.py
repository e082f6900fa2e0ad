"""scripts/measure_overlap_bound.py's bound, on samples computed by hand: rollout 1 s at 1 core, the rest 2 s at
1.5 cores, on 2 cores: lockstep 3 s; overlapped at least max(1, 2, (1 + 3) / 2) = 2 s: at most 1.5x. Iteration 1
(start-up, compilation) is left out."""
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "measure_overlap_bound.py"


def _module():
    spec = importlib.util.spec_from_file_location("measure_overlap_bound", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bound_by_hand():
    wall, cpu = {}, {}
    for it in (1, 2, 3):
        slow = 10 if it == 1 else 1  # the first iteration is left out whatever it holds
        wall |= {f"{it}/rollout": 1.0 * slow, f"{it}/train": 1.5, f"{it}/publish": 0.5}
        cpu |= {f"{it}/rollout": {"engine": 0.9 * slow, "other": 0.1}, f"{it}/train": {"trainer": 2.5},
                f"{it}/publish": {"trainer": 0.25, "other": 0.25}}
    b = _module().bound({"wall": wall, "cpu": cpu}, cores=2)
    assert b["iterations"] == 2
    assert b["phases"]["rollout"]["cores_in_use"] == pytest.approx(1.0)
    assert b["phases"]["rollout"]["cpu_engine_cores"] == pytest.approx(0.9)
    assert b["phases"]["train"]["cores_in_use"] == pytest.approx(2.5 / 1.5)
    assert b["lockstep_s_per_iteration"] == pytest.approx(3.0)
    assert b["overlapped_floor_s_per_iteration"] == pytest.approx(2.0)
    assert b["speedup_bound"] == pytest.approx(1.5)
    # the rest busy on both cores: only (1 + 2 x 2) / 2 = 2.5 s of CPU can be packed: at most 1.2x
    for it in (2, 3):
        cpu[f"{it}/train"], cpu[f"{it}/publish"] = {"trainer": 3.0}, {"trainer": 1.0}
    assert _module().bound({"wall": wall, "cpu": cpu}, cores=2)["speedup_bound"] == pytest.approx(3.0 / 2.5)
