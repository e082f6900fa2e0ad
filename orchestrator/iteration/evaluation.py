"""The eval phase (`eval.every` > 0): a fixed held-out set of the task's problems (drawn from a seed stream
training never uses), scored after the weight sync of every `every`-th iteration:
- `eval/pass@1`: greedy decoding, the fraction of problems solved (reward 1);
- `eval/pass@k` for k in {1, n_samples} (`eval/sampled_pass@1`, `eval/pass@<n>`): the unbiased estimator of
  Chen et al. 2021 ("Evaluating Large Language Models Trained on Code", arXiv:2107.03374, eq. 1) from
  n_samples completions per problem sampled from `eval.temperature`, `top_p`, `top_k` (each unset one: the
  run's own `rollout.*`: EvalConfig.sampling);
- `eval/reward_mean`: the mean reward of those sampled completions.

With `agent:` these stay what they are -- the model answering in one completion, without tools or feedback -- and
the agent is measured beside them on the same problems: n_samples trajectories each, sampled as above and scored
by the environment or the task (`eval/agent_reward_mean`, `eval/agent_sampled_pass@1`, `eval/agent_turns_mean`).
configs/tool_calc.yaml reads the gap between the two as what the tool is worth."""
from __future__ import annotations

from math import comb
from typing import TYPE_CHECKING

from orchestrator.config.schema import EvalConfig
from rollout.config import RolloutConfig
from rollout.samples import Samples
from rollout.tasks import Problem, Task
from trainer.batch import TokenDistribution

if TYPE_CHECKING:
    from orchestrator.agents.agent_rollout import Agent
    from orchestrator.workers.rollout_group import RolloutGroup

EVAL_STREAM = 2 * 10**9  # offset of the held-out problems' seed from the run's (never drawn by training)
SOLVED = 1.0  # a completion solves its problem when its task reward reaches this


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k completions drawn without replacement from n, c of them correct,
    is correct: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    return 1.0 - comb(n - c, k) / comb(n, k)


def held_out_problems(task: Task, seed: int, n: int) -> list[Problem]:
    """The task's own held-out problems (a dataset's `eval_path`), else problems from a seed stream training
    never draws."""
    own = getattr(task, "held_out", None)
    problems = own(seed, n) if own else None
    return problems if problems is not None else task.problems(seed + EVAL_STREAM, 0, n)


def evaluate(rollout: "RolloutGroup", task: Task, problems: list[Problem], cfg: EvalConfig, run: RolloutConfig,
             seed: int, agent: "Agent | None" = None) -> dict[str, float]:
    """`run`: the run's rollout settings (the completion length and, where `cfg` leaves them unset, the
    sampled completions' temperature, top_p and top_k: EvalConfig.sampling)."""
    tokens = cfg.max_new_tokens or run.max_new_tokens
    greedy = rollout.generate(problems, 1, tokens, TokenDistribution(temperature=0.0), seed)
    sampled = rollout.generate(problems, cfg.n_samples, tokens, cfg.sampling(run), seed)
    greedy_rewards, sampled_rewards = _rewards(task, problems, greedy), _rewards(task, problems, sampled)
    solved = _solved(sampled, sampled_rewards, len(problems))
    n = cfg.n_samples
    out = {"eval/pass@1": sum(r >= SOLVED for r in greedy_rewards) / len(problems),
           "eval/sampled_pass@1": sum(pass_at_k(n, c, 1) for c in solved) / len(problems),
           "eval/reward_mean": sum(sampled_rewards) / len(sampled_rewards)}
    if n > 1:
        out[f"eval/pass@{n}"] = sum(pass_at_k(n, c, n) for c in solved) / len(problems)
    if agent is not None:
        out |= _agent_eval(agent, rollout, task, problems, cfg, run, seed)
    return out


def _agent_eval(agent: "Agent", rollout: "RolloutGroup", task: Task, problems: list[Problem], cfg: EvalConfig,
                run: RolloutConfig, seed: int) -> dict[str, float]:
    from orchestrator.agents.agent_rollout import engine_turns

    done = agent.rollout(engine_turns(rollout, cfg.sampling(run)), problems, cfg.n_samples, seed, version=-1)
    rewards = ([s.reward for s in done.samples] if agent.scores_itself
               else _rewards(task, problems, done.samples))
    solved = _solved(done.samples, rewards, len(problems))
    return {"eval/agent_reward_mean": sum(rewards) / len(rewards),
            "eval/agent_sampled_pass@1": sum(pass_at_k(cfg.n_samples, c, 1) for c in solved) / len(problems),
            "eval/agent_turns_mean": done.metrics["turns/mean"]}


def _solved(samples: Samples, rewards: list[float], n_problems: int) -> list[int]:
    """Per problem, how many of its samples solved it."""
    solved = [0] * n_problems
    for s, r in zip(samples, rewards, strict=True):
        solved[s.prompt_index] += r >= SOLVED
    return solved


def _rewards(task: Task, problems: list[Problem], samples: Samples) -> list[float]:
    return task.score([problems[s.prompt_index] for s in samples], [s.text for s in samples])
