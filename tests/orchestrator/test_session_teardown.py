"""A session stops without asking Ray anything when its local raylet has died or may be dying (each call would
wait out its timeout): the stops that ask Ray are dropped, the shared memory is removed, the cluster's processes
are ended by pid (`Cluster.abandon`: tests/orchestrator/test_cluster.py), and the stops that need no Ray (the
sandbox's, the reward functions') still run; so too when its start-up is interrupted. The whole path, a job's
SIGTERM reaching the raylet: tests/integration/test_job_stop.py."""
from __future__ import annotations

from contextlib import ExitStack
from types import SimpleNamespace

import pytest

from orchestrator.workers.cluster import Cluster
from orchestrator.records.rundir import RunDir
from orchestrator.iteration.session import RaySideStops, Session

WITHOUT_RAY = ["shared memory removed", "cluster abandoned", "sandbox stopped"]
WITH_RAY = ["asked Ray", "sandbox stopped"]


class LocalCluster(Cluster):
    """A cluster started here (`local`; else joined) whose raylet is alive or not; abandoning it is recorded."""

    def __init__(self, done: list[str], raylet_alive: bool, local: bool = True):
        raylet = SimpleNamespace(process=SimpleNamespace(poll=lambda: None if raylet_alive else -9))
        super().__init__(connected_here=True, node=SimpleNamespace(all_processes={"raylet": [raylet]}) if local
                         else None)
        self.done = done

    def abandon(self) -> None:
        self.done.append("cluster abandoned")


def _stops(done: list[str], cluster: Cluster) -> tuple[ExitStack, RaySideStops]:
    teardown = ExitStack()
    teardown.callback(done.append, "sandbox stopped")
    ray_side = teardown.enter_context(RaySideStops(cluster))
    ray_side.callback(done.append, "asked Ray")
    ray_side.instead(lambda: done.append("shared memory removed"))
    return teardown, ray_side


CASES = [  # raylet alive, cluster started here, interrupted -> what the stop does
    (False, True, False, WITHOUT_RAY),  # died (OOM killer, or the signal got there first)
    (True, True, True, WITHOUT_RAY),  # a job's SIGTERM on its way to the raylet: Ray may stop answering any moment
    (True, True, False, WITH_RAY),
    (True, False, True, WITH_RAY),  # a joined cluster lives on after the run: only the run's own actors stop
]


@pytest.mark.parametrize("alive, local, interrupted, expected", CASES)
def test_a_session_asks_ray_to_stop_only_while_ray_can_answer(tmp_path, alive, local, interrupted, expected):
    done: list[str] = []
    cluster = LocalCluster(done, alive, local)
    session = Session(cfg=None, run=RunDir(tmp_path / "run"), task=None, tokenizer=None, trainer=None, probe=[],
                      weights=None)
    (session._teardown, session._ray_side), session._cluster = _stops(done, cluster), cluster
    session.close(interrupted)
    assert done == expected


@pytest.mark.parametrize("alive, local, interrupted, expected", CASES)
def test_an_unwound_start_up_asks_ray_to_stop_only_while_ray_can_answer(alive, local, interrupted, expected):
    done: list[str] = []
    with pytest.raises(KeyboardInterrupt if interrupted else RuntimeError):
        with _stops(done, LocalCluster(done, alive, local))[0]:
            raise KeyboardInterrupt if interrupted else RuntimeError("a failed start")
    assert done == expected
