"""Environments: a small protocol any pure-JAX environment can implement, a gymnax adapter, and the
auto-reset / episode-return bookkeeping that runs inside the jitted rollout."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Discrete:
    n: int


@dataclass(frozen=True)
class Box:
    shape: tuple[int, ...]
    low: float | tuple[float, ...]
    high: float | tuple[float, ...]


@runtime_checkable
class Environment(Protocol):
    """A single (unbatched) pure-JAX environment. `step` does not reset: the engine does that.

    reset(key) -> (obs, state); step(key, state, action) -> (obs, state, reward, terminated, truncated).
    All functions must be jittable and vmappable; `state` is any pytree.

    Optional attribute `max_episode_steps: int`: the time limit, if the env truncates an episode only once it
    has lasted that many steps (so two truncations of one env are at least that many steps apart). With it, PPO
    and IMPALA evaluate the critic only at the few steps a rollout can have cut (`cut_values`).
    """

    observation_shape: tuple[int, ...]
    action_space: Discrete | Box

    def reset(self, key: jax.Array) -> tuple[jax.Array, Any]: ...

    def step(self, key: jax.Array, state: Any, action: jax.Array) -> tuple[jax.Array, Any, jax.Array, jax.Array, jax.Array]: ...


class GymnaxEnv:
    """Adapts a gymnax 1.0 environment (its `step_env`/`reset_env`, without gymnax's own auto-reset)."""

    def __init__(self, name: str, **env_kwargs: Any) -> None:
        import gymnax
        from gymnax.environments import spaces

        self.name = name
        self._env, self._params = gymnax.make(name, **env_kwargs)
        # gymnax's is_truncated: the episode's step count (0 at reset) reached params.max_steps_in_episode
        limit = getattr(self._params, "max_steps_in_episode", None)
        self.max_episode_steps = int(limit) if limit is not None else None
        self.observation_shape = tuple(self._env.observation_space(self._params).shape)
        space = self._env.action_space(self._params)
        if isinstance(space, spaces.Discrete):
            self.action_space: Discrete | Box = Discrete(int(space.n))
        else:
            self.action_space = Box(tuple(space.shape), float(jnp.min(space.low)), float(jnp.max(space.high)))

    def reset(self, key: jax.Array) -> tuple[jax.Array, Any]:
        return self._env.reset_env(key, self._params)

    def step(self, key: jax.Array, state: Any, action: jax.Array):
        obs, state, reward, terminated, _ = self._env.step_env(key, state, action, self._params)
        truncated = self._env.is_truncated(state, self._params)
        return obs, state, reward.astype(jnp.float32), terminated, truncated


class BraxEnv:
    """Adapts a Brax environment (`brax.envs.get_environment`; its physics backend is a keyword, `backend`). Brax
    reports only the task's end (`done`); the time limit is counted here (`episode_length` steps, Brax's
    training default 1000) and reported as truncation."""

    def __init__(self, name: str, episode_length: int = 1000, **env_kwargs: Any) -> None:
        from brax import envs as brax_envs

        if name not in brax_envs._envs:  # noqa: SLF001  (brax lists its registry nowhere else)
            raise ValueError(f"unknown Brax environment {name!r}; known: {', '.join(sorted(brax_envs._envs))}")
        self.name = name
        self.episode_length = self.max_episode_steps = episode_length
        self._env = brax_envs.get_environment(name, **env_kwargs)
        # Brax's observation_size runs a reset op by op (6.5 s for inverted_pendulum on 2 cores); its shape alone
        # comes from tracing it (0.25 s)
        reset = jax.eval_shape(self._env.reset, jax.random.PRNGKey(0))
        self.observation_shape = (int(reset.obs.shape[-1]),)
        # Brax actuators take actions in [-1, 1]
        self.action_space: Discrete | Box = Box((int(self._env.action_size),), -1.0, 1.0)

    def reset(self, key: jax.Array) -> tuple[jax.Array, Any]:
        state = self._env.reset(key)
        return state.obs, (state, jnp.zeros((), jnp.int32))

    def step(self, key: jax.Array, state: Any, action: jax.Array):
        brax_state, t = state
        nxt = self._env.step(brax_state, action)
        t = t + 1
        reward, done = jnp.asarray(nxt.reward, jnp.float32), jnp.asarray(nxt.done) > 0
        nxt = nxt.replace(reward=reward, done=jnp.asarray(nxt.done, jnp.float32))  # reset's dtypes, for jnp.where
        return nxt.obs, (nxt, t), reward, done, t >= self.episode_length


def make_env(name: str, **env_kwargs: Any) -> Environment:
    """A gymnax id, "brax/<name>", or "package.module:factory" (factory(**env_kwargs) returns an Environment)."""
    if name.startswith("brax/"):
        return BraxEnv(name.removeprefix("brax/"), **env_kwargs)
    if ":" in name:
        module, factory = name.split(":", 1)
        env = getattr(importlib.import_module(module), factory)(**env_kwargs)
        if not isinstance(env, Environment):
            raise TypeError(f"{name} did not return a trainer.jax.envs.Environment")
        return env
    return GymnaxEnv(name, **env_kwargs)


class EnvSlot(NamedTuple):
    """One environment's state plus the return and length of its running episode."""

    state: Any
    ep_return: jax.Array
    ep_length: jax.Array


class StepOut(NamedTuple):
    obs: jax.Array
    slot: EnvSlot
    reward: jax.Array
    done: jax.Array  # terminated or truncated: the next obs starts a new episode
    finished_return: jax.Array  # the episode's return where done, else 0
    finished_length: jax.Array
    # cut by the time limit, not ended by the task: the episode's value goes on past `final_obs`
    truncated: jax.Array
    final_obs: jax.Array  # the step's observation before any reset (where done, the episode's last one)


def reset_slot(env: Environment, key: jax.Array) -> tuple[jax.Array, EnvSlot]:
    obs, state = env.reset(key)
    return obs, EnvSlot(state, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))


def auto_reset_step(env: Environment, k_step: jax.Array, k_reset: jax.Array, slot: EnvSlot, action: jax.Array) -> StepOut:
    """Step; where the episode ended, return the first observation of a new one (reset computed
    for every env and selected: branch-free under vmap)."""
    obs, state, reward, terminated, truncated = env.step(k_step, slot.state, action)
    done = jnp.logical_or(terminated, truncated)
    ep_return = slot.ep_return + reward
    ep_length = slot.ep_length + 1
    obs_re, state_re = env.reset(k_reset)
    state = jax.tree.map(lambda r, s: jnp.where(done, r, s), state_re, state)
    next_obs = jnp.where(done, obs_re, obs)
    new = EnvSlot(state, jnp.where(done, 0.0, ep_return), jnp.where(done, 0, ep_length))
    cut = jnp.logical_and(truncated, jnp.logical_not(terminated))  # a task's end at the limit is an end
    return StepOut(next_obs, new, reward, done, jnp.where(done, ep_return, 0.0), jnp.where(done, ep_length, 0),
                   cut, obs)
