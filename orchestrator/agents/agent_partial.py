"""Partial rollouts of multi-turn trajectories (`rollout.partial_rollout` with `agent:`): Kimi k1.5's partial rollouts
(arXiv:2501.12599, section 2.6.2) cut at turn boundaries. Each batch's sampling gives a trajectory turns until it has
sampled `segment_tokens` tokens in that sampling; after the episode's reply to that turn is inserted, the trajectory
is set aside with its episode (the environment's or the tools' state), its conversation and its tokens, and continued
when the next batch is sampled, from those very ids, under the weights the engines serve then. A group (a prompt's
n trajectories) is trained in the batch whose sampling ends its last trajectory, as single-turn partial rollouts are
(orchestrator/agents/partial_rollouts.py), with the same staleness bound: a trajectory in its `max_draws`-th sampling,
or in the run's last iteration, runs to its end.

Every sampled token carries the version that sampled it (inserted tokens -1); each turn's seed is a function of the
seed of the sampling that opened the trajectory, its index there and the turn, so the schedule of which version
samples which token is fixed by the config. A group set aside is continued on copies of its trajectories (the same
episodes, their state going on), so that the batch that set it aside, checked against its policy while the next
one is drawn, keeps reading the tokens it sampled; the checkpoint of the batch drawn ahead pickles its groups set
aside, episodes included, so episodes whose state lives outside this process (the python tool's sandbox session,
code_feedback's sandbox client) cannot be set aside: orchestrator/config/schema.py refuses them with partial_rollout."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from orchestrator.agents.partial_rollouts import PartialDraw, partial_metrics
from rollout.agent import AgentRunner, OpenTrajectory, agent_metrics
from rollout.samples import Sample, Samples
from rollout.tasks import Problem


@dataclass
class AgentGroup:
    """A prompt's trajectories, some of which have not ended: set aside between two samplings."""

    problem: Problem
    trajectories: list[OpenTrajectory]
    ended: list[bool]
    samplings: list[int]  # per trajectory: the samplings (batches drawn) that gave it tokens
    draws: int  # samplings the group has been part of

    @property
    def samples(self) -> list[Sample]:
        """Its trajectories so far (partial_rollouts.sampled_in reads the tokens a sampling gave them)."""
        return [AgentRunner.sample(x, self.problem.task_id, 0) for x in self.trajectories]


def draw_agent_partially(agent, generate: Callable, new_problems: Sequence[Problem], carried: Sequence[AgentGroup], *,
                         n_samples: int, seed: int, version: int, segment: int, max_draws: int, min_groups: int,
                         finish_all: bool) -> PartialDraw:
    """Continue the `carried` groups' running trajectories and open `n_samples` for each new problem
    (`agent`: orchestrator.agents.agent_rollout.Agent; `generate` as its runner's), each for a segment of `segment`
    sampled tokens (to its end in the group's `max_draws`-th sampling, or with `finish_all`), by the engines serving
    `version`. Where fewer than `min_groups` groups have ended then, the oldest open ones run to their end."""
    counts: Counter = Counter()
    # continued on copies: the batch that set them aside is checked against its policy while this one is drawn
    # (checks.BatchChecks.drawn_ahead reads its set-aside tokens), as single-turn partial rollouts copy theirs
    carried = [AgentGroup(g.problem, [x.continued() for x in g.trajectories], list(g.ended), list(g.samplings),
                          g.draws) for g in carried]
    for g in carried:
        for x, ended in zip(g.trajectories, g.ended):
            if not ended:
                agent.continue_episode(x.episode, counts)
    runner = agent.runner(generate, version)
    opened = runner.open([agent.episode(p, counts) for p in new_problems for _ in range(n_samples)], seed)
    groups = list(carried) + [
        AgentGroup(p, opened[i * n_samples:(i + 1) * n_samples], [False] * n_samples, [0] * n_samples, 0)
        for i, p in enumerate(new_problems)]
    sampled_before = {id(x): sum(x.traj.mask) for g in groups for x in g.trajectories}
    ran = [x for g in groups for x, ended in zip(g.trajectories, g.ended) if not ended]
    parts: Counter = Counter()

    def advance(todo: list[AgentGroup], to_end: Callable[[AgentGroup], bool]) -> None:
        live = []
        for g in todo:
            for x, ended in zip(g.trajectories, g.ended):
                if not ended:
                    x.to_end = to_end(g)
                    live.append(x)
        done, _ = runner.run_open(live, segment)
        parts.update(runner.timings)
        finished = {id(x) for x in done}
        for g in todo:
            g.ended = [e or id(x) in finished for x, e in zip(g.trajectories, g.ended)]

    continued = sum(1 for g in carried for e in g.ended if not e)
    advance(groups, lambda g: finish_all or g.draws + 1 >= max_draws)
    short = min_groups - sum(all(g.ended) for g in groups)
    finished_early = [g for g in groups if not all(g.ended)][:max(short, 0)]
    if finished_early:
        advance(finished_early, lambda g: True)

    problems, items, set_aside, spans, outcomes = [], [], [], [], []
    for g in groups:
        g.draws += 1
        g.samplings = [k + (sum(x.traj.mask) > sampled_before[id(x)])
                       for k, x in zip(g.samplings, g.trajectories)]
        if not all(g.ended):
            set_aside.append(g)
            continue
        spans += g.samplings
        items += [AgentRunner.sample(x, g.problem.task_id, len(problems)) for x in g.trajectories]
        outcomes += [(x.traj.turns, x.solved) for x in g.trajectories]
        problems.append(g.problem)
    samples = Samples(items)
    latencies = [t for x in ran for t in getattr(x.episode, "latencies", [])]  # this sampling's tool calls
    metrics = agent_metrics(samples, counts, latencies, outcomes if agent.scores_itself else ()) | partial_metrics(
        continued, sum(not e for g in set_aside for e in g.ended), len(set_aside), len(finished_early), spans)
    return PartialDraw(problems, samples, set_aside, metrics,
                       parts={"generate": parts["generate_s"], "tools": parts["tool_s"]})
