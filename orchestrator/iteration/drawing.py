"""How an iteration's batch is drawn on the engines (the schedule's `draw`, orchestrator/iteration/schedule.py):
one completion per sample, or multi-turn trajectories with `agent:`; with `rollout.partial_rollout`, the groups
set aside by the batch before continued beside new ones; with weights taken in flight, the engines switching to
the next policy between two decode steps (rollout/in_flight.py)."""
from __future__ import annotations

import time

from orchestrator.agents import OpenGroup, PartialDraw, Rollout, draw_agent_partially, engine_turns, sample_partially
from orchestrator.iteration.schedule import Drawn
from orchestrator.iteration.session import Session
from rollout.in_flight import InFlight
from rollout.tasks import Problem


def sampling_seed(seed: int, iteration: int) -> int:
    return (seed * 1_000_003 + iteration * 7919) % (2**31 - 1)


def rollout(s: Session, problems: list[Problem], seed: int, version: int, in_flight: InFlight | None = None,
            opened=None) -> Rollout:
    """The iteration's samples: one completion per sample (`in_flight`: taking the next weights when published,
    rollout/in_flight.py), or with `agent:` multi-turn trajectories (whose tokens carry `version`, the policy the
    engines serve) with the agent's metrics."""
    r = s.cfg.rollout
    if s.agent is None:
        return Rollout(s.rollout.generate(problems, r.n_samples, r.max_new_tokens, s.sampling, seed, in_flight,
                                          opened))
    return s.agent.rollout(engine_turns(s.rollout, s.sampling), problems, r.n_samples, seed, version)


def partial_rollout(s: Session, problems: list[Problem], carried: list[OpenGroup], seed: int, version: int,
                    last: bool) -> PartialDraw:
    """rollout.partial_rollout: the groups `carried` over continued and the new ones opened, a segment each
    (multi-turn trajectories: orchestrator/agents/agent_partial.py); the batch is the groups ended now, at least
    enough to give every mini-batch of every data-parallel replica a sample."""
    r, t, p = s.cfg.rollout, s.cfg.trainer, s.cfg.trainer.parallel
    min_groups = -(-t.updates_per_iteration * p.dp * p.ep // r.n_samples)
    if s.agent is not None:
        return draw_agent_partially(
            s.agent, engine_turns(s.rollout, s.sampling), problems, carried, n_samples=r.n_samples, seed=seed,
            version=version, segment=r.segment_within(s.cfg.agent.max_total_tokens),
            max_draws=r.max_staleness, min_groups=min_groups, finish_all=last)
    return sample_partially(
        lambda requests: s.rollout.generate(requests, 1, r.max_new_tokens, s.sampling, seed), problems, carried,
        n_samples=r.n_samples, max_new_tokens=r.max_new_tokens, segment_tokens=r.segment_tokens,
        max_draws=r.max_staleness, min_groups=min_groups, seed=seed, version=version, finish_all=last,
        decode=lambda ids: s.task.renderer.tokenizer.decode(ids, skip_special_tokens=True))


def draw(s: Session, iteration: int, version: int, carried: list[OpenGroup], opened=None) -> Drawn:
    """Iteration `iteration`'s batch, sampled by the engines, which serve policy `version`; with partial rollouts,
    the groups ended now of those `carried` over and of the new ones, the others set aside. `opened` (a batch
    drawn ahead with weights taken in flight): set once the engines will hand the next sync to this draw."""
    r = s.cfg.rollout
    problems, rendering = s.task.rendered_problems(s.cfg.seed, iteration, r.prompts_per_iteration)
    if not problems:
        raise RuntimeError(f"iteration {iteration}: all {r.prompts_per_iteration} prompts are longer than "
                           f"rollout.max_prompt_tokens = {r.max_prompt_tokens} and were skipped")
    started, t0, seed = time.time(), time.perf_counter(), sampling_seed(s.cfg.seed, iteration)
    if not r.partial_rollout:
        # in flight, the engines may wait for the weights through every trainer call before the publish (ahead
        # check, pi_old, reference, train, publish), each within the trainer's timeout
        switch = None if opened is None else InFlight(version, version + 1, r.in_flight_step, 5 * s.trainer.timeout)
        rolled = rollout(s, problems, seed, version, switch, opened)
        return Drawn(iteration, problems, rendering, rolled, version, started, time.perf_counter() - t0,
                     in_flight=switch is not None)
    part = partial_rollout(s, problems, carried, seed, version, last=iteration == s.cfg.iterations)
    return Drawn(iteration, part.problems, rendering, Rollout(part.samples, part.metrics, part.parts), version,
                 started, time.perf_counter() - t0, set_aside=part.set_aside)
