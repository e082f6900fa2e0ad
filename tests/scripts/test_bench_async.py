"""scripts/bench_async.py's iteration clock, on timings written by hand: an iteration ends with the latest end of
its phases, a batch drawn ahead (which started in the iteration before) included but never later than that."""
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_iteration_ends_by_hand(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    sys.modules.pop("bench_async", None)
    import bench_async

    timings = [
        {"iteration": 0, "phase": "startup/ray", "start": 0.0, "seconds": 5.0},
        {"iteration": 1, "phase": "rollout", "start": 10.0, "seconds": 1.0},
        {"iteration": 1, "phase": "train", "start": 11.0, "seconds": 2.0},
        {"iteration": 2, "phase": "rollout_ahead", "start": 11.0, "seconds": 1.5},  # drawn while 1 trained
        {"iteration": 1, "phase": "sync", "start": 13.0, "seconds": 0.5},
        {"iteration": 2, "phase": "rollout", "start": 13.5, "seconds": 0.0},
        {"iteration": 2, "phase": "train", "start": 13.5, "seconds": 2.0},
        {"iteration": "startup", "phase": "x", "start": 99.0, "seconds": 1.0},
    ]
    assert bench_async.iteration_ends(timings) == {1: 13.5, 2: 15.5}
