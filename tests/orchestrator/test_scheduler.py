"""The rollout schedule (orchestrator/iteration/schedule.py): which policy version samples each iteration's batch, that
a batch drawn ahead is finished before the engines' weights change, and that it survives a checkpoint."""
from __future__ import annotations

import pickle
import threading
from contextlib import contextmanager

import pytest

from orchestrator.agents.agent_rollout import Rollout
from orchestrator.iteration.schedule import Around, Drawn, RolloutScheduler


class Engines:
    """A stand-in for the engines: records which iteration was drawn on which version, and on which thread."""

    def __init__(self, fail_at: int | None = None):
        self.calls: list[tuple[int, int, bool]] = []
        self.carried: list[list] = []  # what each drawing was handed to continue
        self.fail_at = fail_at
        self.release = threading.Event()
        self.release.set()

    def draw(self, iteration: int, version: int, carried: list) -> Drawn:
        self.release.wait(10)
        if iteration == self.fail_at:
            raise RuntimeError(f"engine died drawing iteration {iteration}")
        self.calls.append((iteration, version, threading.current_thread() is threading.main_thread()))
        self.carried.append(list(carried))
        # partial rollouts' stand-in: each drawing sets aside what names it
        return Drawn(iteration, [], None, Rollout([]), version, 0.0, 0.0, set_aside=[f"open@{iteration}"])


def _run(scheduler: RolloutScheduler, first: int, last: int, drained: list | None = None) -> list[tuple[int, int]]:
    """The loop's calls, iteration by iteration: take, ahead, (train, publish), drain, sync. `drained`: gets
    (iteration, version) of each batch a drain finished (the loop checks those against the trainer's snapshot of
    the policy it held while `drawing`)."""
    trained = []
    for it in range(first, last + 1):
        drawn = scheduler.take(it)
        scheduler.ahead(it)
        drawing = scheduler.drawing
        trained.append((drawn.iteration, drawn.staleness()))
        finished = scheduler.drain()
        assert (finished is not None) == drawing
        if finished is not None and drained is not None:
            drained.append((finished.iteration, finished.version))
        scheduler.synced(it)
    return trained


def test_lockstep_draws_each_batch_on_the_policy_it_trains():
    engines = Engines()
    with RolloutScheduler(engines.draw, 0, 0, 4) as scheduler:
        assert _run(scheduler, 1, 4) == [(1, 0), (2, 0), (3, 0), (4, 0)]
    assert engines.calls == [(1, 0, True), (2, 1, True), (3, 2, True), (4, 3, True)]


def test_one_step_overlap_draws_the_next_batch_on_the_previous_policy_in_the_background():
    engines = Engines()
    drained = []
    with RolloutScheduler(engines.draw, 1, 0, 4) as scheduler:
        assert _run(scheduler, 1, 4, drained) == [(1, 0), (2, 1), (3, 1), (4, 1)]
    assert drained == [(2, 0), (3, 1), (4, 2)]  # drained in iterations 1-3, each on the version then served
    # batch 1 drawn now on policy 0; batch t + 1 drawn during iteration t on the policy the engines still serve,
    # t - 1; nothing beyond the last iteration
    assert engines.calls == [(1, 0, True), (2, 0, False), (3, 1, False), (4, 2, False)]


def test_the_weights_never_change_under_a_batch_being_drawn():
    engines = Engines()
    with RolloutScheduler(engines.draw, 1, 0, 3) as scheduler:
        scheduler.take(1)
        engines.release.clear()  # the engines are busy with batch 2
        scheduler.ahead(1)
        with pytest.raises(RuntimeError, match="drain first"):
            scheduler.synced(1)
        with pytest.raises(RuntimeError, match="between a drain and the next iteration"):
            scheduler.save_ahead(None)
        engines.release.set()
        scheduler.drain()
        scheduler.synced(1)
        assert scheduler.take(2).version == 0


def test_a_failed_background_draw_surfaces_at_the_drain():
    engines = Engines(fail_at=2)
    with RolloutScheduler(engines.draw, 1, 0, 3) as scheduler:
        scheduler.take(1)
        scheduler.ahead(1)
        with pytest.raises(RuntimeError, match="engine died drawing iteration 2"):
            scheduler.drain()


def test_a_batch_drawn_ahead_by_a_checkpoint_older_than_the_sub_packages_still_loads(tmp_path):
    """A checkpoint written before the orchestrator's modules moved into sub-packages names their old paths."""
    from orchestrator.iteration.schedule import AHEAD_FILE

    drawn = Drawn(3, [], None, Rollout([]), 1, 0.0, 0.0, set_aside=["open"])
    old = pickle.dumps(drawn, protocol=0).replace(b"orchestrator.iteration.schedule\n", b"orchestrator.scheduler\n")
    old = old.replace(b"orchestrator.agents.agent_rollout\n", b"orchestrator.agent_rollout\n")
    assert b"orchestrator.scheduler\n" in old and b"orchestrator.agent_rollout\n" in old
    (tmp_path / AHEAD_FILE).write_bytes(old)
    with RolloutScheduler(Engines().draw, 1, 2, 4) as scheduler:
        scheduler.load_ahead(tmp_path)
        assert scheduler.take(3) == drawn


def test_the_batch_drawn_ahead_survives_a_checkpoint(tmp_path):
    """Killed after iteration 2's checkpoint and resumed: the same batches on the same versions as without."""
    whole = Engines()
    with RolloutScheduler(whole.draw, 1, 0, 4) as scheduler:
        uninterrupted = _run(scheduler, 1, 4)
    first = Engines()
    with RolloutScheduler(first.draw, 1, 0, 4) as scheduler:
        _run(scheduler, 1, 2)
        scheduler.save_ahead(tmp_path)  # the loop checkpoints after the sync
    second = Engines()
    with RolloutScheduler(second.draw, 1, 2, 4) as scheduler:  # resumed: the engines serve policy 2
        scheduler.load_ahead(tmp_path)
        resumed = _run(scheduler, 3, 4)
    assert uninterrupted == [(1, 0), (2, 1)] + resumed
    assert [c[:2] for c in first.calls + second.calls] == [c[:2] for c in whole.calls]
    # a lockstep run ignores a batch drawn ahead (another config's checkpoint) and one for another iteration
    lockstep = Engines()
    with RolloutScheduler(lockstep.draw, 0, 2, 4) as scheduler:
        scheduler.load_ahead(tmp_path)
        assert _run(scheduler, 3, 3) == [(3, 0)]


def test_each_drawing_continues_what_the_one_before_set_aside_also_across_a_checkpoint(tmp_path):
    """Partial rollouts: the generations a drawing set aside go to the next drawing, in lockstep as drawn ahead,
    and a resumed run hands the next drawing what the batch saved in the checkpoint set aside."""
    for staleness in (0, 2):
        engines = Engines()
        with RolloutScheduler(engines.draw, staleness, 0, 4) as scheduler:
            _run(scheduler, 1, 4)
        assert engines.carried == [[], ["open@1"], ["open@2"], ["open@3"]]
    first, second = Engines(), Engines()
    with RolloutScheduler(first.draw, 2, 0, 4) as scheduler:
        _run(scheduler, 1, 2)
        scheduler.save_ahead(tmp_path)
    with RolloutScheduler(second.draw, 2, 2, 4) as scheduler:
        scheduler.load_ahead(tmp_path)
        _run(scheduler, 3, 4)
    assert first.carried + second.carried == [[], ["open@1"], ["open@2"], ["open@3"]]


def test_weights_taken_in_flight_change_under_the_batch_being_drawn_once_its_draw_is_ready_for_them():
    """rollout.weight_update in_flight: `ahead` returns once the draw has readied the engines for the next sync
    (its fourth argument), the sync lands while the batch is still being drawn, and closing the scheduler
    releases a draw still waiting for weights."""
    order = []

    def draw(iteration, version, carried, opened=None):
        order.append(("draw", iteration, version, opened is not None))
        opened.set()
        waiting.wait(10)
        return Drawn(iteration, [], None, Rollout([]), version, 0.0, 0.0, in_flight=True)

    waiting = threading.Event()
    with RolloutScheduler(draw, 1, 0, 3, in_flight=True, release=waiting.set) as scheduler:
        scheduler.ahead(1)
        assert order == [("draw", 2, 0, True)] and scheduler.drawing
        scheduler.synced(1)  # no drain first: the batch takes policy 1 while it is drawn
        waiting.set()
        assert scheduler.take(2).version == 0 and scheduler.served == 1
        waiting.clear()
        scheduler.ahead(2)
    assert waiting.is_set()  # released by close, or the with-block would have waited 10 s for the draw
    assert order[-1] == ("draw", 3, 1, True)


class Recorder:
    """The run's side of `Around`: what the schedule timed (phases), checked and had the trainer keep, in order."""

    def __init__(self, checkpoints: set[int]):
        self.events: list[tuple] = []
        self.checkpoints = checkpoints

    @contextmanager
    def phase(self, iteration: int, name: str):
        self.events.append((name, iteration))
        yield {}

    def record_phase(self, rec) -> None:
        self.events.append((rec.phase, rec.iteration))

    def check(self, drawn: Drawn, iteration: int) -> None:
        drawn.logprob_gap = 0.0  # as BatchChecks.drawn_ahead records it
        self.events.append(("check", drawn.iteration, iteration))

    def around(self) -> Around:
        return Around(self, self.check, lambda: self.events.append(("keep",)), self.checkpoints.__contains__)


def _loop(scheduler: RolloutScheduler, last: int) -> None:
    """The calls loop.run_iterations makes on its schedule, iteration by iteration."""
    for it in range(1, last + 1):
        scheduler.begin(it, scheduler.take(it))
        scheduler.training()
        scheduler.published(it)
        scheduler.synced(it)


def test_the_loops_hooks_do_nothing_in_lockstep():
    run = Recorder(checkpoints={2})
    with RolloutScheduler(Engines().draw, 0, 0, 3, around=run.around()) as scheduler:
        _loop(scheduler, 3)
    assert run.events == []


def test_a_batch_drawn_ahead_is_drained_before_each_sync_and_checked_once_when_trained_or_before_a_checkpoint():
    """max_staleness 1: the trainer keeps the sampler while a batch is drawn ahead; the batch is drained when the
    weights are published and checked when its iteration begins, or at the drain when a checkpoint (which does not
    hold the trainer's snapshot) comes first."""
    run = Recorder(checkpoints={2})
    with RolloutScheduler(Engines().draw, 1, 0, 4, around=run.around()) as scheduler:
        _loop(scheduler, 4)
    assert run.events == [("keep",), ("drain", 1),
                          ("rollout_ahead", 2), ("check", 2, 2), ("keep",), ("drain", 2), ("check", 3, 2),
                          ("rollout_ahead", 3), ("keep",), ("drain", 3),
                          ("rollout_ahead", 4), ("check", 4, 4), ("drain", 4)]


def test_weights_taken_in_flight_drain_only_before_a_checkpoint():
    def draw(iteration, version, carried, opened=None):
        if opened is not None:
            opened.set()
        return Drawn(iteration, [], None, Rollout([]), version, 0.0, 0.0, in_flight=opened is not None)

    run = Recorder(checkpoints={2})
    with RolloutScheduler(draw, 1, 0, 3, in_flight=True, around=run.around()) as scheduler:
        _loop(scheduler, 3)
    assert run.events == [("keep",), ("rollout_ahead", 2), ("check", 2, 2), ("keep",), ("drain", 2),
                          ("check", 3, 2), ("rollout_ahead", 3)]


def test_a_negative_bound_is_refused():
    with pytest.raises(ValueError, match="max_staleness -1: 0 .lockstep. or more"):
        RolloutScheduler(Engines().draw, -1, 0, 3)
