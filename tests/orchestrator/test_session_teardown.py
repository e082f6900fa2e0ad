"""A session whose local raylet has died stops without asking Ray anything (each call would wait out its timeout):
the stops that ask Ray are dropped, the shared memory is removed, the cluster's processes are ended by pid
(`Cluster.abandon`: tests/orchestrator/test_cluster.py), and the stops that need no Ray (the sandbox's, the reward
functions') still run; so too when a start-up is interrupted with its raylet dead. The whole path, a job's SIGTERM
reaching the raylet: tests/integration/test_job_stop.py."""
from __future__ import annotations

from contextlib import ExitStack
from types import SimpleNamespace

import pytest

from orchestrator.rundir import RunDir
from orchestrator.session import RaySideStops, Session


def _stops(done: list[str], lost: bool) -> tuple[ExitStack, RaySideStops, SimpleNamespace]:
    cluster = SimpleNamespace(head_lost=lambda within_s=0.0: lost, abandon=lambda: done.append("cluster abandoned"))
    teardown = ExitStack()
    teardown.callback(done.append, "sandbox stopped")
    ray_side = teardown.enter_context(RaySideStops(cluster))
    ray_side.callback(done.append, "asked Ray")
    ray_side.instead(lambda: done.append("shared memory removed"))
    return teardown, ray_side, cluster


def test_a_session_whose_raylet_died_asks_ray_nothing(tmp_path):
    done: list[str] = []
    session = Session(cfg=None, run=RunDir(tmp_path / "run"), task=None, tokenizer=None, trainer=None, probe=[],
                      weights=None)
    session._teardown, session._ray_side, session._cluster = _stops(done, lost=True)
    session.close()
    assert done == ["shared memory removed", "cluster abandoned", "sandbox stopped"]


@pytest.mark.parametrize("lost", [True, False])
def test_an_interrupted_start_up_asks_ray_only_while_its_raylet_lives(lost):
    done: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        teardown, _, _ = _stops(done, lost)
        with teardown:
            raise KeyboardInterrupt  # a scheduler's SIGTERM, while Session.open starts the engines
    assert done == (["shared memory removed", "cluster abandoned", "sandbox stopped"] if lost
                    else ["asked Ray", "sandbox stopped"])
