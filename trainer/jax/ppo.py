"""PPO pieces for one data shard of one seed: GAE, the clipped loss, and one full update (rollout +
epochs x minibatches). Collectives name `axes`; the engine maps them onto vmap axes or mesh axes."""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from trainer.jax import shuffle
from trainer.jax.config import JaxConfig
from trainer.jax.envs import EnvSlot, Environment
from trainer.jax.networks import Flat
from trainer.jax.normalization import (Moments, discounted_sums, init_moments, normalize, scale_rewards,
                                       update_moments)
from trainer.jax.on_policy import actor_critic, clipped_adam, cut_values, make_policy_rollout
from trainer.jax.shards import replicate, reset_shards


# Minibatches larger than this are differentiated in chunks of this many rows. Measured against rejax on
# CartPole (64x64 MLPs, 4 minibatches; scripts/bench_jax.py): 2048-row chunks beat 512 and 4096 at 256 to
# 2048 envs, and chunking minibatches of 2048 rows or fewer only added overhead (0.82x -> 0.96x at 64 envs).
AUTO_CHUNK_ROWS = 2048
# After the rollout the critic runs over its observations in time chunks of about this many rows: big
# enough for efficient GEMMs, small enough that large env counts do not hold every activation at once.
CRITIC_CHUNK_ROWS = 4096


class Transition(NamedTuple):
    obs: jax.Array
    action: jax.Array
    logp: jax.Array
    value: jax.Array | None  # None inside the rollout loop; the critic runs over the whole rollout after it
    reward: jax.Array
    done: jax.Array


class RunnerState(NamedTuple):
    params: Any
    opt_state: Any
    slot: EnvSlot  # batched over this shard's envs
    obs: jax.Array
    key: jax.Array  # raw uint32 key
    update: jax.Array  # PPO updates done so far
    # Running statistics (kept, though unused, when normalize_observations / scale_rewards are off): the same on
    # every shard, pooled over all of them
    obs_moments: Moments
    return_moments: Moments  # of the discounted reward sums that scale the rewards
    discounted_return: jax.Array  # [envs of this shard]: each env's running discounted reward sum


class UpdateMetrics(NamedTuple):
    return_sum: jax.Array  # sum of returns of the episodes that finished during the update
    episodes: jax.Array
    length_sum: jax.Array
    pg_loss: jax.Array
    value_loss: jax.Array
    entropy: jax.Array
    approx_kl: jax.Array
    clip_frac: jax.Array


def gae(rewards: jax.Array, values: jax.Array, dones: jax.Array, last_value: jax.Array,
        gamma: float, lam: float, end_values: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation (Schulman et al. 2016, "High-Dimensional Continuous Control Using
    Generalized Advantage Estimation", eq. 16) over time-major arrays [T, ...]. `dones[t]` means the episode
    ended at step t: step t's TD error does not look at step t+1 (another episode) and the trace stops there.
    `end_values[t]`, where given, is the value the TD error of an ending step bootstraps from: the value of the
    last observation where a time limit cut the episode (Pardo et al. 2018, "Time Limits in Reinforcement
    Learning": partial-episode bootstrapping), 0 where the task ended it; None: 0 everywhere. Returns
    (advantages, value targets)."""
    if end_values is None:
        end_values = jnp.zeros_like(values)

    def back(carry, x):
        adv_next, v_next = carry
        r, v, d, v_end = x
        live = 1.0 - d.astype(jnp.float32)
        delta = r + gamma * (live * v_next + (1.0 - live) * v_end) - v
        adv = delta + gamma * lam * live * adv_next
        return (adv, v), adv

    _, adv = jax.lax.scan(back, (jnp.zeros_like(last_value), last_value), (rewards, values, dones, end_values),
                          reverse=True)
    return adv, adv + values


def clipped_losses(logp: jax.Array, old_logp: jax.Array, adv: jax.Array, value: jax.Array,
                   old_value: jax.Array, target: jax.Array, clip_eps: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """PPO's clipped surrogate (to minimise) and clipped value loss, both means; plus the clip fraction."""
    ratio = jnp.exp(logp - old_logp)
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv)
    v_clipped = old_value + jnp.clip(value - old_value, -clip_eps, clip_eps)
    v_loss = 0.5 * jnp.maximum((value - target) ** 2, (v_clipped - target) ** 2)
    clip_frac = jnp.mean((jnp.abs(ratio - 1.0) > clip_eps).astype(jnp.float32))
    return -jnp.mean(surrogate), jnp.mean(v_loss), clip_frac


def make_optimizer(cfg: JaxConfig, total_updates: int) -> optax.GradientTransformation:
    return clipped_adam(cfg, max(total_updates, 1) * cfg.epochs * cfg.minibatches)


class PPO:
    """Proximal policy optimisation (Schulman et al. 2017, "Proximal Policy Optimization Algorithms"), with the
    clipped value loss and advantage normalisation of its released implementation."""

    def __init__(self, cfg: JaxConfig, env: Environment, total_updates: int) -> None:
        self.cfg, self.env = cfg, env
        self.agent = actor_critic(cfg, env)
        self.tx = make_optimizer(cfg, total_updates)

    def init_seed(self, key: jax.Array) -> RunnerState:
        cfg = self.cfg
        k_params, k_shards = jax.random.split(key)
        params = self.agent.init(k_params)
        n_envs = cfg.num_envs // cfg.shards
        slot, obs, keys = reset_shards(self.env, k_shards, cfg.shards, n_envs)
        return RunnerState(replicate(params, cfg.shards), replicate(self.tx.init(params), cfg.shards), slot, obs,
                           keys, jnp.zeros((cfg.shards,), jnp.int32),
                           replicate(init_moments(self.env.observation_shape), cfg.shards),
                           replicate(init_moments(), cfg.shards), jnp.zeros((cfg.shards, n_envs), jnp.float32))

    def make_update(self, axes: Sequence[str]):
        return make_update(self.cfg, self.env, self.agent, self.tx, axes)

    def params_tree(self, state: RunnerState, seed: int = 0) -> Any:
        """One seed's parameters as the Flax variable tree (shard 0; all shards hold the same)."""
        return self.agent.seed_tree(state.params, seed)


def make_update(cfg: JaxConfig, env: Environment, agent: Flat, tx: optax.GradientTransformation,
                axes: Sequence[str]) -> Callable[[RunnerState], tuple[RunnerState, UpdateMetrics]]:
    """One PPO update on one shard; `agent.apply(params, obs) -> (dist, value)`. `axes`: named axes over which
    gradients and advantage statistics are averaged (the shards); empty for a single shard."""
    axes = tuple(axes)
    apply_fn = agent.apply
    n_envs = cfg.num_envs // cfg.shards
    batch = n_envs * cfg.num_steps
    mb_size = batch // cfg.minibatches
    rollout = make_policy_rollout(cfg, env, agent, n_envs)
    env_limit = getattr(env, "max_episode_steps", None)

    def pmean(x):
        return jax.lax.pmean(x, axes) if axes else x

    def loss_fn(params, mb: Transition, adv: jax.Array, target: jax.Array):
        dist, value = apply_fn(params, mb.obs)
        logp = dist.log_prob(mb.action)
        pg, vl, clip_frac = clipped_losses(logp, mb.logp, adv, value, mb.value, target, cfg.clip_eps)
        ent = jnp.mean(dist.entropy())
        total = pg + cfg.vf_coef * vl - cfg.ent_coef * ent
        approx_kl = jnp.mean((jnp.exp(logp - mb.logp) - 1.0) - (logp - mb.logp))
        return total, (pg, vl, ent, approx_kl, clip_frac)

    grad_of = jax.grad(loss_fn, has_aux=True)
    chunk_rows = AUTO_CHUNK_ROWS if cfg.grad_chunk_rows is None else cfg.grad_chunk_rows
    chunks = mb_size // chunk_rows if chunk_rows and mb_size % chunk_rows == 0 else 1

    def grad_fn(params, trans, adv, target):
        if chunks == 1:
            return grad_of(params, trans, adv, target)
        # Large minibatches: the mean gradient as the mean of equal row chunks' gradients, so each
        # chunk's activations stay in cache instead of streaming every layer through memory.
        split = jax.tree.map(lambda x: x.reshape((chunks, -1) + x.shape[1:]), (trans, adv, target))

        def acc(total, xs):
            g, aux = grad_of(params, *xs)
            return jax.tree.map(jnp.add, total, g), aux

        zero = jax.tree.map(jnp.zeros_like, params)
        total, aux = jax.lax.scan(acc, zero, split)
        return jax.tree.map(lambda g: g / chunks, total), jax.tree.map(jnp.mean, aux)

    def minibatch_step(carry, mb):
        params, opt_state = carry
        trans, adv, target = mb
        if cfg.normalize_advantages:
            mean = pmean(jnp.mean(adv))
            var = pmean(jnp.mean(jnp.square(adv - mean)))
            adv = (adv - mean) / (jnp.sqrt(var) + 1e-8)
        grads, aux = grad_fn(params, trans, adv, target)
        grads = pmean(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), aux

    def epoch(carry, _):
        params, opt_state, key, data = carry
        key, k_perm = jax.random.split(key)
        perm = shuffle.permutation(k_perm, batch)
        shuffled = jax.tree.map(lambda x: jnp.take(x, perm, axis=0).reshape((cfg.minibatches, mb_size) + x.shape[1:]), data)
        (params, opt_state), aux = jax.lax.scan(minibatch_step, (params, opt_state), shuffled)
        return (params, opt_state, key, data), aux

    def update(rs: RunnerState, _=None) -> tuple[RunnerState, UpdateMetrics]:
        key, k_rollout = jax.random.split(rs.key)
        params = rs.params
        obs_moments, return_moments, discounted_return = rs.obs_moments, rs.return_moments, rs.discounted_return
        # The network's inputs: with normalisation, by the statistics from before this rollout, for acting and for
        # learning from it alike
        to_input = functools.partial(normalize, m=obs_moments, clip=cfg.obs_clip) if cfg.normalize_observations \
            else (lambda o: o)
        (slot, obs), steps = rollout(params, rs.slot, rs.obs, k_rollout, to_input)
        reward = steps.reward
        if cfg.normalize_observations:
            obs_moments = update_moments(obs_moments, steps.obs.reshape((-1,) + steps.obs.shape[2:]), axes)
        if cfg.scale_rewards:
            sums, discounted_return = discounted_sums(discounted_return, reward, steps.done, cfg.gamma)
            return_moments = update_moments(return_moments, sums.reshape(-1), axes)
            reward = scale_rewards(reward, return_moments, cfg.reward_clip)
        traj = Transition(to_input(steps.obs), steps.action, steps.logp, None, reward, steps.done)
        # The critic runs over the rollout after it, in large row chunks: inside the loop it sat on the
        # critical path in tiny GEMMs (8% of an update at 4 envs, 10% at 8 seeds x 4 envs).
        steps_per_chunk = max(1, min(cfg.num_steps, CRITIC_CHUNK_ROWS // n_envs))

        def critic(observations):
            return jax.lax.map(lambda o: apply_fn(params, o)[1], observations, batch_size=steps_per_chunk)

        traj, last_value = traj._replace(value=critic(traj.obs)), apply_fn(params, to_input(obs))[1]
        # Episodes cut by a time limit bootstrap from their last observation's value (truncation is not the
        # task's end): the critic over the observations the cut steps produced before their reset.
        end_values = cut_values(lambda o: critic(to_input(o)), steps.truncated, steps.final_obs, env_limit)
        adv, target = gae(traj.reward, traj.value, traj.done, last_value, cfg.gamma, cfg.gae_lambda, end_values)
        flat = jax.tree.map(lambda x: x.reshape((batch,) + x.shape[2:]), (traj, adv, target))
        (params, opt_state, key, _), aux = jax.lax.scan(epoch, (params, rs.opt_state, key, flat), None, cfg.epochs)
        pg, vl, ent, kl, cf = (jnp.mean(a) for a in aux)
        done = traj.done
        metrics = UpdateMetrics(jnp.sum(steps.finished_return), jnp.sum(done.astype(jnp.int32)),
                                jnp.sum(steps.finished_length), pg, vl, ent, kl, cf)
        return RunnerState(params, opt_state, slot, obs, key, rs.update + 1, obs_moments, return_moments,
                           discounted_return), metrics

    return update
