"""The actor-critic pieces PPO and IMPALA share: the network and its optimizer, the rollout of a stochastic policy
over a shard's envs, and the time-limit bootstrap of the value targets."""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from trainer.jax.config import JaxConfig
from trainer.jax.distributions import Categorical, DiagNormal
from trainer.jax.envs import Box, Discrete, Environment, auto_reset_step
from trainer.jax.networks import ActorCritic, Flat


def clipped_adam(cfg: JaxConfig, optimizer_steps: int) -> optax.GradientTransformation:
    """Adam after global-norm clipping; the learning rate decays linearly to 0 over `optimizer_steps` if annealed."""
    lr: float | Callable = optax.linear_schedule(cfg.lr, 0.0, optimizer_steps) if cfg.lr_annealed else cfg.lr
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), optax.adam(lr, eps=1e-5))


def actor_critic(cfg: JaxConfig, env: Environment) -> Flat:
    """The actor-critic network for `env`'s observations and actions, its parameters one flat vector."""
    space = env.action_space
    discrete = isinstance(space, Discrete)
    network = ActorCritic(action_dim=space.n if discrete else math.prod(space.shape), discrete=discrete,
                          hidden_sizes=tuple(cfg.hidden_sizes), activation=cfg.activation,
                          obs_rank=len(env.observation_shape))
    return Flat(network, jnp.zeros(env.observation_shape, jnp.float32))


class PolicyStep(NamedTuple):
    """One step of every env of a shard under a stochastic policy (time-major [T, envs, ...] after a rollout)."""
    obs: jax.Array
    action: jax.Array  # as sampled (Box: before clipping to the bounds)
    logp: jax.Array  # of the acting policy
    reward: jax.Array
    done: jax.Array
    truncated: jax.Array  # cut by the time limit, not ended by the task
    final_obs: jax.Array  # the step's observation before any reset
    finished_return: jax.Array
    finished_length: jax.Array


def cut_values(value_fn: Callable, truncated: jax.Array, final_obs: jax.Array,
               max_episode_steps: int | None) -> jax.Array:
    """The value of the last observation where a time limit cut the episode, 0 elsewhere: [T, n] from time-major
    `truncated` [T, n] and `final_obs` [T, n, ...]; value_fn maps [k, n, ...] observations to [k, n] values. (The
    bootstrap of Pardo et al. 2018, "Time Limits in Reinforcement Learning", that PPO's GAE and IMPALA's V-trace use.)

    With the env's time limit L known, one env can be cut at most ceil(T / L) times in T steps (cuts are L steps
    apart), so per env only that many observations, gathered from the steps it was cut at, go through the critic,
    instead of all T (at 8 seeds x 4 envs on CartPole, T = 128 and L = 500, the full pass was 8% of an update)."""
    steps, n = truncated.shape
    k = steps if not max_episode_steps or max_episode_steps < 1 else -(-steps // max_episode_steps)
    if k >= steps:
        return jnp.where(truncated, value_fn(final_obs), 0.0)
    # per env, the (at most k) cut steps first: top_k over the flags (equal flags: the earlier step first)
    flags = truncated.T.astype(jnp.int32)  # [n, T]
    _, index = jax.lax.top_k(flags, k)  # [n, k]
    cut = jnp.take_along_axis(flags, index, axis=1) > 0
    values = value_fn(final_obs[index.T, jnp.arange(n)])  # [k, n]
    at = (index.T[:, None, :] == jnp.arange(steps)[None, :, None]) & cut.T[:, None, :]  # [k, T, n]
    return jnp.sum(jnp.where(at, values[:, None, :], 0.0), axis=0)


def make_policy_rollout(cfg: JaxConfig, env: Environment, agent: Flat, n_envs: int) -> Callable:
    """rollout(params, slot, obs, key, to_input=None) -> ((slot, obs), PolicyStep [num_steps, n_envs, ...]): the envs
    act with the policy of `agent.apply(params, to_input(obs)) -> (dist, value)` (PPO's and IMPALA's actors),
    `params` its flat vector, `to_input` what the network is given of an observation (None: the observation;
    PPO's running normalisation otherwise). PolicyStep.obs holds the observations as the env gave them."""
    space = env.action_space
    box = space if isinstance(space, Box) else None
    dist_cls = DiagNormal if box else Categorical
    action_dim = math.prod(box.shape) if box else space.n
    step_env = jax.vmap(lambda ks, kr, s, a: auto_reset_step(env, ks, kr, s, a))

    def rollout_step(carry, xs, to_input):
        tree, slot, obs = carry
        noise, k_step, k_reset = xs
        # Only the policy runs per step (XLA drops the unused critic)
        dist, _ = agent.module.apply(tree, to_input(obs))
        action = dist.sample_with(noise)
        env_action = jnp.clip(action, box.low, box.high).reshape((n_envs,) + box.shape) if box else action
        out = step_env(k_step, k_reset, slot, env_action)
        step = PolicyStep(obs, action, dist.log_prob(action), out.reward, out.done, out.truncated, out.final_obs,
                          out.finished_return, out.finished_length)
        return (tree, out.slot, out.obs), step

    def rollout(params, slot, obs, key, to_input: Callable | None = None):
        # All randomness of the rollout is drawn up front in a few large ops, so the loop body
        # (where XLA:CPU time is mostly per-op overhead) holds none.
        k_noise, k_env = jax.random.split(key)
        noise = dist_cls.noise(k_noise, (cfg.num_steps, n_envs), action_dim)
        env_keys = jax.random.split(k_env, (cfg.num_steps, 2, n_envs))
        # The flat vector is cut into the network's weights once, not at every step: with vmapped seeds each cut
        # is a strided copy, and per step they cost 7% of an update (8 seeds x 4 envs, CartPole).
        tree = agent.unravel(params)
        body = functools.partial(rollout_step, to_input=to_input or (lambda o: o))
        (_, slot, obs), steps = jax.lax.scan(body, (tree, slot, obs), (noise, env_keys[:, 0], env_keys[:, 1]),
                                             unroll=cfg.scan_unroll)
        return (slot, obs), steps

    return rollout
