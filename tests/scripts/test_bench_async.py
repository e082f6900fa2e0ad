"""scripts/bench_async.py on timings written by hand: an iteration ends with the latest end of its phases, a batch
drawn ahead (which started in the iteration before) included but never later than that; a weight update takes from
the end of the train step to the end of the sync; the copies time the bytes they are given."""
import sys
from pathlib import Path

import pytest

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


def test_update_latency_by_hand(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    sys.modules.pop("bench_async", None)
    import bench_async

    timings = []
    for it, (train_end, publish, gap, sync) in enumerate([(5.0, 1.0, 0.0, 2.0), (20.0, 0.5, 0.1, 0.4),
                                                          (40.0, 0.7, 0.05, 0.6)], start=1):
        timings += [{"iteration": it, "phase": "train", "start": train_end - 3.0, "seconds": 3.0},
                    {"iteration": it, "phase": "publish", "start": train_end + gap, "seconds": publish,
                     "bytes": 1000 + it},
                    {"iteration": it, "phase": "sync", "start": train_end + gap + publish, "seconds": sync,
                     "parts": {"verify": sync / 4, "load": sync / 2}}]
    got = bench_async.latency_figures(timings, 3)
    assert got["latency_per_iteration_s"] == [pytest.approx(1.0), pytest.approx(1.35)]  # iteration 1 left out
    assert got["latency_s"] == pytest.approx(1.175)
    assert got["publish_s"] == pytest.approx(0.6) and got["sync_s"] == pytest.approx(0.5) and got["bytes"] == 1003
    assert got["verify_s"] == pytest.approx(0.125) and got["load_s"] == pytest.approx(0.25)


def test_copy_floor_copies_the_bytes(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    sys.modules.pop("bench_async", None)
    import bench_async

    small, large = bench_async.new_file_copy(1 << 20), bench_async.new_file_copy(64 << 20)
    assert 0 < small < large
    assert 0 < bench_async.memcpy_floor(1 << 20) < bench_async.memcpy_floor(64 << 20)


def test_against_trl_counts_equal_work_and_cores_by_hand(monkeypatch):
    """trl_100m: a tide run with an iteration of fewer optimizer steps than TRL's is no figure (inf); a sampled
    process tree's cores are its CPU seconds over the wall seconds between the samples inside the span."""
    import math

    monkeypatch.syspath_prepend(str(SCRIPTS))
    from bench_e2e import Timeline

    run = Timeline(0.0, 0.0, [], [1.0, 3.0, 6.0], optimizer_steps=[4, 4, 4])
    assert run.equal_work_iteration_s(4) == 2.5  # the median of 2 and 3
    run.optimizer_steps = [4, 3, 4]
    assert math.isinf(run.equal_work_iteration_s(4)) and run.iteration_s() == 2.5
    sampled = Timeline(0.0, 0.0, [], [], cpu=[(0.0, 0.0), (1.0, 0.5), (2.0, 2.5), (3.0, 4.5), (4.0, 4.6)])
    assert sampled.cores_between(0.5, 3.0) == pytest.approx(2.0)  # (4.5 - 0.5) / (3 - 1)
    assert math.isnan(sampled.cores_between(3.5, 3.9))


def test_cores_by_role_by_hand(monkeypatch):
    """Cores per role over iterations 2..last: their CPU seconds (start-up and iteration 1 left out) over the
    seconds from the end of iteration 1 to the end of `last`."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    from bench_async import cores_by_role

    samples = {"cpu": {"0/startup": {"engine": 9.0}, "1/rollout": {"engine": 5.0}, "2/rollout": {"engine": 1.0},
                       "2/train": {"trainer": 2.0, "other": 0.5}, "3/train": {"trainer": 3.0}}}
    ends = {1: 10.0, 2: 12.0, 3: 15.0}
    assert cores_by_role(samples, ends, 3) == {"engine": 0.2, "other": 0.1, "trainer": 1.0}
    assert cores_by_role(samples, ends, 2) == {"engine": 0.5, "other": 0.25, "trainer": 1.0}
