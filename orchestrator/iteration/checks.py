"""The verification step of an iteration: each batch against the policy that sampled it, and the probe
(the measurements themselves: orchestrator/iteration/logprob_check.py).

- A batch sampled by the policy that trains it (lockstep, or the first batch): the train step's own log-probs of
  its first mini-batch (of the whole batch with a mismatch correction) before any update, checked after the
  train step and before the publish.
- A batch drawn ahead: against the trainer's snapshot of the policy that sampled it (`drawn_ahead`, called by the
  schedule while the engines draw the next batch), and its tokens sampled after weights taken in flight against
  that newer policy; the train step's own gap spans an update then (`stale_logprob_gap`, not checked).
- The probe (`rollout.probe_every`): fixed prompts on every engine after a sync, with `agent:` also fixed
  multi-turn trajectories; checked once the iteration's metrics are written, so that the failing figure is in
  them.

Every gap has the bound of `rollout.max_logprob_gap` (or the dtype's default, RolloutConfig.logprob_gap_bound)."""
from __future__ import annotations

from orchestrator.iteration.logprob_check import (PROBE_BATCHES, agent_logprob_gap, behaviour_gap,
                                                  check_logprob_gap, logprob_gap, probe_due, sampled_gap)
from orchestrator.iteration.schedule import Drawn
from orchestrator.iteration.session import Session, console
from trainer.batch import TrainBatch


class BatchChecks:
    """The run's checks of its batches and engines, with its bound (and where the bound comes from)."""

    def __init__(self, s: Session) -> None:
        self.s = s
        self.bound = s.cfg.rollout.logprob_gap_bound(s.cfg.model.dtype)
        self.origin = s.cfg.rollout.logprob_gap_origin(s.cfg.model.dtype)

    def drawn_ahead(self, drawn: Drawn, iteration: int) -> None:
        """A batch drawn ahead, against the policy that sampled it: the trainer's snapshot of that policy (taken
        in the train step that came after it was started) scores a share of it (logprob_check.behaviour_gap).
        Done at the start of the iteration that trains it, while the engines draw the next batch, so that the
        engines do not wait for it; or, where a checkpoint is saved before then, before the checkpoint (the
        snapshot is not in it), so that a resumed run finds the batch checked."""
        s = self.s
        share = s.cfg.trainer.updates_per_iteration
        with s.run.phase(iteration, "ahead_check"):
            drawn.logprob_gap = behaviour_gap(s.trainer, drawn.sampled(), s.sampling, share)
            # the tokens sampled after weights taken in flight: by the policy the trainer holds now
            if drawn.in_flight and (newer := drawn.sampled(drawn.version + 1)):
                drawn.in_flight_logprob_gap = sampled_gap(s.trainer, newer[::share], s.sampling)
        check_logprob_gap(drawn.iteration, drawn.logprob_gap, self.bound, "the batch drawn ahead, against the "
                          "policy that sampled it", self.origin)
        if drawn.in_flight_logprob_gap is not None:
            check_logprob_gap(drawn.iteration, drawn.in_flight_logprob_gap, self.bound, "the batch drawn ahead, its "
                              "tokens sampled after the weights taken in flight, against that policy", self.origin)

    def trained(self, iteration: int, drawn: Drawn, batch: TrainBatch, train: dict,
                mismatch: dict[str, float]) -> dict[str, float]:
        """After the train step: a batch its own trainer's policy sampled is checked on the train step's gap
        (with a mismatch correction, the whole batch's, the tokens it leaves out of the loss included; it is
        taken out of `mismatch`). Returns the gap metrics: `logprob_gap`, the batch against the policy that
        sampled it; a stale batch's gap here spans an update: `stale_logprob_gap`."""
        gap = mismatch.pop("logprob_gap", train["behaviour_gap"])
        if all(x.reward is None for x in drawn.rolled.samples):  # no token to measure a gap on: not a mismatch
            console.log(f"[yellow]iteration {iteration}: the rewards left every sample out (None): nothing trained")
        elif drawn.staleness() == 0:
            check_logprob_gap(iteration, gap, self.bound, "the whole batch, before any update"
                              if batch.old_recomputed else "the first mini-batch, before its update", self.origin)
        if drawn.staleness() == 0:
            return {"logprob_gap": gap}
        newer = {} if drawn.in_flight_logprob_gap is None else {"in_flight_logprob_gap": drawn.in_flight_logprob_gap}
        return {"logprob_gap": drawn.logprob_gap, "stale_logprob_gap": gap} | newer

    def probe(self, iteration: int) -> dict[str, float]:
        """The probe's gaps, when due (phase probe); checked by `check_probe`."""
        s, r = self.s, self.s.cfg.rollout
        if not probe_due(r.probe_interval, iteration):
            return {}
        probe = {}
        with s.run.phase(iteration, "probe"):
            probe["probe_gap"] = logprob_gap(s.trainer, s.rollout, s.probe, r.max_new_tokens, s.sampling, s.cfg.seed)
            if s.agent:
                probe["probe_gap_agent"] = agent_logprob_gap(s.trainer, s.agent, s.rollout, s.agent_probe,
                                                             s.sampling, s.cfg.seed)
        return probe

    def check_probe(self, iteration: int, probe: dict[str, float]) -> None:
        for name, gap in probe.items():
            check_logprob_gap(iteration, gap, self.bound, PROBE_BATCHES[name], self.origin)
