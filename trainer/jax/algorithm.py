"""What the engine needs from an RL algorithm (PPO, SAC, IMPALA), and the pieces they share.

An algorithm works on one data shard of one seed: `init_seed` builds a seed's state with a leading [shards]
axis (parameters identical on every shard, environments and RNG streams not), `make_update(axes)` returns one
jittable update step that averages whatever it must over the named `axes` (the shards), and the update's
metrics carry at least `return_sum`, `episodes` and `length_sum` (the episodes that finished during it); every
other metric field is a scalar averaged over seeds, shards and updates by `summarize`."""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from trainer.jax.config import JaxConfig
from trainer.jax.distributions import Categorical, DiagNormal
from trainer.jax.envs import Box, Environment, auto_reset_step, reset_slot
from trainer.jax.networks import Flat


class Algorithm(Protocol):
    cfg: JaxConfig
    env: Environment

    def init_seed(self, key: jax.Array) -> Any: ...

    def make_update(self, axes: Sequence[str]) -> Callable[[Any, Any], tuple[Any, Any]]: ...


def make_algorithm(cfg: JaxConfig, env: Environment, total_updates: int) -> Algorithm:
    if cfg.algorithm == "sac":
        from trainer.jax.sac import SAC

        return SAC(cfg, env, total_updates)
    if cfg.algorithm == "impala":
        from trainer.jax.impala import Impala

        return Impala(cfg, env, total_updates)
    from trainer.jax.ppo import PPO

    return PPO(cfg, env, total_updates)


def reset_shards(env: Environment, key: jax.Array, shards: int, envs_per_shard: int):
    """Every shard's env slots, first observations and RNG key: (slot, obs, key), each [shards, ...]."""
    def one(k):
        k_reset, k_run = jax.random.split(k)
        obs, slot = jax.vmap(lambda kk: reset_slot(env, kk))(jax.random.split(k_reset, envs_per_shard))
        return slot, obs, k_run

    return jax.jit(jax.vmap(one))(jax.random.split(key, shards))


def replicate(tree: Any, shards: int) -> Any:
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (shards,) + jnp.shape(x)), tree)


def summarize(metrics: Any) -> dict[str, Any]:
    """Host-side reduction of one chunk's metrics (leaves [seeds, shards, updates])."""
    m = jax.device_get(metrics)._asdict()
    ret = np.asarray(m.pop("return_sum"), np.float64).sum(axis=(1, 2))
    eps = np.asarray(m.pop("episodes")).sum(axis=(1, 2))
    lens = np.asarray(m.pop("length_sum"), np.float64).sum(axis=(1, 2))
    per_seed = np.where(eps > 0, ret / np.maximum(eps, 1), np.nan)
    out: dict[str, Any] = {
        "episode_return_mean": float(ret.sum() / eps.sum()) if eps.sum() else None,
        "episode_length_mean": float(lens.sum() / eps.sum()) if eps.sum() else None,
        "episodes": int(eps.sum()),
        **{name: float(np.mean(value)) for name, value in m.items()},
    }
    if len(per_seed) > 1:
        out["episode_return_mean_per_seed"] = [None if np.isnan(x) else float(x) for x in per_seed]
    return out


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
