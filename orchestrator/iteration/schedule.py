"""Which policy version samples each iteration's batch, and when (`rollout.max_staleness`).

Versions: policy v is the trainer after v iterations' updates; the engines serve v from the sync of iteration v
on (0: the initial weights). A batch trained at iteration t is trained by policy t - 1; its staleness is
t - 1 - (the version that sampled it).

- `max_staleness: 0` (lockstep): iteration t's batch is sampled at the start of iteration t, by policy t - 1.
- `max_staleness: 1` (one-step overlap: IMPALA's actor-learner split with one step of lag, Espeholt et al. 2018,
  arXiv:1802.01561; slime's and veRL's one-step off-policy modes): iteration t + 1's batch is sampled while
  iteration t trains and publishes, by the engines still serving policy t - 1. Before the sync of iteration t
  the engines finish it (drain, then load: no request is aborted and every token of a batch comes from one
  version), so the batch is trained at iteration t + 1 by policy t on samples of policy t - 1: staleness 1,
  never more. The first batch is sampled in lockstep (staleness 0).
- `max_staleness: k >= 2` (with `rollout.partial_rollout`, orchestrator/agents/partial_rollouts.py): batches are drawn
  ahead as with 1, and a generation still running when its batch's token budget is spent is set aside
  (`Drawn.set_aside`) and continued when the next batch is drawn, for at most k samplings in all: its first
  tokens are then k updates old when trained, never more.

With `rollout.weight_update: in_flight` (max_staleness 1) the engines take the weights a train step publishes while
they draw the next batch between two of its decode steps (rollout/in_flight.py): that batch's first tokens are
sampled by the policy one update before the one that trains on it, those after the switch by that very policy.
The batch is not drained before the sync; it is finished when it is taken, or before a checkpoint that saves it.

The schedule is a function of the config and the iteration, never of timing (in flight: with
rollout.in_flight_step); the batch drawn ahead is saved with
each checkpoint (`save_ahead` / `load_ahead`), so that a resumed run trains on the very batch the uninterrupted run
trained on (`deterministic: true`: exactly)."""
from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.agents.agent_rollout import Rollout
from orchestrator.agents.partial_rollouts import mask_stale, sampled_in, token_staleness
from orchestrator.records import PhaseRecord, RunDir
from rollout.samples import Sample
from rollout.tasks import Problem

AHEAD_FILE = "drawn_ahead.pkl"  # in a checkpoint directory: the batch drawn ahead for the next iteration
# Where the classes a batch drawn ahead holds lived before the orchestrator's sub-packages (54c3dcd), so that a
# checkpoint written before them still resumes
_MOVED = {"orchestrator.scheduler": "orchestrator.iteration.schedule",
          "orchestrator.agent_rollout": "orchestrator.agents.agent_rollout",
          "orchestrator.partial_rollouts": "orchestrator.agents.partial_rollouts",
          "orchestrator.agent_partial": "orchestrator.agents.agent_partial",
          "orchestrator.prompts": "orchestrator.workers.prompts"}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        return super().find_class(_MOVED.get(module, module), name)


@dataclass
class Drawn:
    """An iteration's batch: its problems (and what rendering them skipped or cut), the rollout, the policy
    version that sampled it and when and for how long it was sampled."""

    iteration: int
    problems: list[Problem]
    rendering: object  # orchestrator.workers.prompts.RenderCounts
    rolled: Rollout
    version: int
    started: float  # time.time()
    seconds: float
    # a batch drawn ahead: mean |engine - trainer| log-prob of its sampled tokens, the trainer on a snapshot of
    # the policy that sampled it, checked before it is trained (checks.BatchChecks.drawn_ahead)
    logprob_gap: float | None = None
    # partial rollouts: the groups whose generations had not all ended (partial_rollouts.OpenGroup), continued
    # when the next batch is drawn
    set_aside: list = field(default_factory=list)
    # weights taken in flight: the engines switched to version + 1 during the drawing (its later tokens), and the
    # mean |engine - trainer| log-prob of those tokens, the trainer on that policy
    in_flight: bool = False
    in_flight_logprob_gap: float | None = None
    stale_masked: int = 0  # tokens left out of the loss beyond max_staleness (none by schedule: a guard)

    def staleness(self) -> int:
        return self.iteration - 1 - self.version

    def mask_beyond(self, max_staleness: int) -> None:
        """Leave out of the loss any token sampled more than `max_staleness` updates before the trainer's policy
        (partial_rollouts.mask_stale)."""
        self.stale_masked = mask_stale(self.rolled.samples, self.iteration - 1, max_staleness, self.version)

    def metrics(self) -> dict[str, float]:
        """The batch's staleness (policy versions between its last sampler and its trainer) and that sampler; with
        partial rollouts or weights taken in flight per token and per sample, and the tokens left out beyond the
        bound (none by schedule)."""
        out = {"staleness": self.staleness(), "behaviour_version": self.version}
        masked = {"stale_masked_tokens": self.stale_masked}
        if "partial_continued" in self.rolled.metrics or self.in_flight:  # tokens of several versions
            return out | token_staleness(self.rolled.samples, self.iteration - 1, self.version) | masked
        return out | (masked if self.stale_masked else {})

    def sampled(self, version: int | None = None) -> list[Sample]:
        """What this drawing sampled by `version` (default: the one it started on): its batch's tokens, and with
        partial rollouts those of the generations it set aside, each sample's loss mask narrowed to them."""
        return sampled_in(self.rolled.samples, self.set_aside, self.version if version is None else version)


@dataclass
class Around:
    """What a run's schedule does around the batches it hands out (unit tests of the schedule leave it out):
    `check_ahead(drawn, iteration)` checks a batch drawn ahead against the policy that sampled it (timed as
    phase ahead_check); `keep_sampler()` has the trainer keep that policy before the update that makes it
    stale; `checkpoint_due(iteration)`; `run` times the drain and the drawing ahead."""

    run: RunDir | None = None
    check_ahead: Callable[[Drawn, int], None] = lambda drawn, iteration: None
    keep_sampler: Callable[[], None] = lambda: None
    checkpoint_due: Callable[[int], bool] = lambda iteration: False


class RolloutScheduler:
    """`draw(iteration, version, carried)` samples an iteration's batch on the engines (which serve `version`),
    continuing the generations the batch before set aside (`carried`, partial rollouts). The loop asks for each
    iteration's batch (`take`), says when it starts training on it (`begin`: the next one is drawn ahead meanwhile,
    and a batch drawn ahead is checked), when the train step starts (`training`), when the new weights are
    published (`published`: the engines finish the batch drawn ahead before their weights change) and synced
    (`synced`). Lockstep is max_staleness 0: every hook is then a no-op, and `take` draws the batch."""

    def __init__(self, draw: Callable[..., Drawn], max_staleness: int, served_version: int, last_iteration: int,
                 in_flight: bool = False, release: Callable[[], None] | None = None,
                 around: Around | None = None) -> None:
        """`in_flight`: batches drawn ahead take the next weights in flight; their draw is called with a
        threading.Event as a fourth argument, to set once the engines hand such a sync to it (`ahead` waits for
        that). `release`: ends the engines' waits for such weights (called when the scheduler closes)."""
        if max_staleness < 0:
            raise ValueError(f"rollout.max_staleness {max_staleness}: 0 (lockstep) or more")
        self._draw, self.max_staleness, self.served = draw, max_staleness, served_version
        self.in_flight, self._release = in_flight, release
        self.around = around or Around()
        self._carried: list = []  # what the last batch drawn set aside
        self.last_iteration = last_iteration
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tide-rollout-ahead") if max_staleness else None
        self._ahead: Future[Drawn] | None = None
        self._ready: Drawn | None = None  # drawn ahead and finished (drained, or loaded from a checkpoint)

    def take(self, iteration: int) -> Drawn:
        """The batch iteration `iteration` trains on: the one drawn ahead, or drawn now (lockstep, first)."""
        if self._ahead is not None:
            self.drain()
        drawn, self._ready = self._ready, None
        if drawn is None or drawn.iteration != iteration:
            drawn = self._draw(iteration, self.served, self._carried)
        self._carried = drawn.set_aside
        return drawn

    def begin(self, iteration: int, drawn: Drawn) -> None:
        """Iteration `iteration` trains on `drawn`: the next batch is drawn ahead meanwhile; a batch itself drawn
        ahead is checked against the policy that sampled it now, while the engines draw the next one (unless it
        was checked before a checkpoint that saved it)."""
        if drawn.staleness() and self.around.run is not None:  # its sampling, timed while the last one trained
            self.around.run.record_phase(PhaseRecord(iteration, "rollout_ahead", drawn.started, drawn.seconds,
                                                     parts=drawn.rolled.parts))
        self.ahead(iteration)
        if drawn.staleness() and drawn.logprob_gap is None:
            self.around.check_ahead(drawn, iteration)

    def training(self) -> None:
        """The train step starts: the policy it updates is sampling the batch drawn ahead, which is checked
        against it later (`Around.keep_sampler`)."""
        if self.drawing:
            self.around.keep_sampler()

    def published(self, iteration: int) -> None:
        """The iteration's weights are published: the batch drawn ahead ends on the weights it began on (taken
        in flight: it goes on through the sync)."""
        if self.max_staleness and not self.in_flight:
            self._drain_for(iteration)

    def _drain_for(self, iteration: int) -> None:
        """Finish the batch drawn ahead: before the engines' weights change, or (weights taken in flight) before
        a checkpoint saves it; checked now when a checkpoint is due (the snapshot it is checked on is not
        saved)."""
        with self.around.run.phase(iteration, "drain") if self.around.run else nullcontext():
            ahead = self.drain()
        if ahead is not None and self.around.checkpoint_due(iteration):
            self.around.check_ahead(ahead, iteration)

    def ahead(self, iteration: int) -> None:
        """Start drawing the next iteration's batch on the engines' current weights (max_staleness 1)."""
        nxt = iteration + 1
        if self._pool is None or nxt > self.last_iteration or self._ahead or self._ready:
            return
        if not self.in_flight:
            self._ahead = self._pool.submit(self._draw, nxt, self.served, self._carried)
            return
        # the next sync must find the engines ready to hand it to this draw, whichever thread runs first
        opened = threading.Event()
        self._ahead = self._pool.submit(self._draw, nxt, self.served, self._carried, opened)
        self._ahead.add_done_callback(lambda _: opened.set())
        opened.wait()

    @property
    def drawing(self) -> bool:
        """A batch is being drawn ahead, by the version the engines serve."""
        return self._ahead is not None

    def drain(self) -> Drawn | None:
        """Wait until the batch drawn ahead is finished (before the engines' weights change); that batch, or
        None when none was being drawn."""
        if self._ahead is None:
            return None
        future, self._ahead = self._ahead, None
        self._ready = future.result()
        return self._ready

    def synced(self, version: int) -> None:
        """The engines serve `version` (the iteration that published it); a batch drawn ahead with the weights
        taken in flight is finished before a checkpoint saves it."""
        if self._ahead is not None and not self.in_flight:
            raise RuntimeError("the engines' weights changed while a batch was being drawn: drain first")
        self.served = version
        if self.in_flight and self.around.checkpoint_due(version):
            self._drain_for(version)

    def save_ahead(self, checkpoint_dir: Path) -> None:
        if self._ahead is not None:
            raise RuntimeError("a checkpoint is taken between a drain and the next iteration")
        if self._ready is not None:
            (checkpoint_dir / AHEAD_FILE).write_bytes(pickle.dumps(self._ready))

    def load_ahead(self, checkpoint_dir: Path | None) -> None:
        path = None if checkpoint_dir is None else checkpoint_dir / AHEAD_FILE
        if self.max_staleness and path is not None and path.is_file():
            with open(path, "rb") as f:
                self._ready = _Unpickler(f).load()

    def __enter__(self) -> "RolloutScheduler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Let a batch still being drawn finish (the engines are stopped after this), then stop the thread."""
        if self._pool is None:
            return
        try:
            if self._ahead is not None:
                if self._release is not None:  # a draw waiting for weights that will not come now
                    self._release()
                self._ahead.exception()
        finally:
            self._pool.shutdown(wait=True)
