"""Drawing a batch of multi-turn trajectories (agent_rollout.py) and partial rollouts, generations or trajectories
set aside and continued in a later batch (partial_rollouts.py, agent_partial.py)."""
from orchestrator.agents.agent_partial import draw_agent_partially
from orchestrator.agents.agent_rollout import Agent, Rollout, engine_turns, episode_rewards
from orchestrator.agents.partial_rollouts import OpenGroup, PartialDraw, sample_partially

__all__ = ["Agent", "OpenGroup", "PartialDraw", "Rollout", "draw_agent_partially", "engine_turns",
           "episode_rewards", "sample_partially"]
