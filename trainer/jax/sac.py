"""Soft actor-critic for continuous (Box) actions, end to end in one jitted program (`algorithm: sac`).

Haarnoja et al. 2018, "Soft Actor-Critic Algorithms and Applications" (arXiv:1812.05905): a tanh-squashed
Gaussian policy (appendix C), soft Q targets (eq. 3 and 5) from twin critics with clipped double Q (Fujimoto et
al. 2018, "Addressing Function Approximation Error in Actor-Critic Methods", as that paper's section 5 uses),
target critics by Polyak averaging, and the learned temperature of section 5 (eq. 18; the loss is written on
log alpha, as the authors' released code optimises it) with target entropy -dim(A).

Replay lives on device in a flashbax item buffer. With `sac.prioritized`, batches are drawn with probability
p_i^alpha / sum_k p_k^alpha, p_i = |TD error| + eps, and the critic loss is weighted by w_i = (N P(i))^-beta /
max_j w_j (Schaul et al. 2016, "Prioritized Experience Replay", section 3.3 and Algorithm 1; max over the sampled
batch, as Algorithm 1 does). alpha and beta anneal linearly over the run's updates. The buffer is created with
exponent 1 and is handed p_i^alpha: a priority keeps the alpha of the step that set it (Schaul's buffer re-raises
nothing either; with a constant alpha the two are the same).

Time limits: a transition cut by the time limit bootstraps from its true next observation (the one before the
reset); only the task's end zeroes the target's bootstrap (Pardo et al. 2018, "Time Limits in Reinforcement
Learning")."""
from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import flashbax as fbx
import jax
import jax.numpy as jnp
import optax

from trainer.jax.config import JaxConfig, SacConfig
from trainer.jax.envs import Box, EnvSlot, Environment, auto_reset_step
from trainer.jax.networks import Flat, SquashedGaussianActor, TwinQ
from trainer.jax.shards import replicate, reset_shards

LOG2 = math.log(2.0)


class Transition(NamedTuple):
    obs: jax.Array
    action: jax.Array  # in [-1, 1]^d (tanh space); the env got it scaled to its bounds
    reward: jax.Array
    next_obs: jax.Array  # the step's own next observation, also where the episode ended
    terminated: jax.Array  # float: the task ended the episode (not the time limit)


class SacParams(NamedTuple):
    actor: jax.Array  # flat
    critic: jax.Array  # flat, both twins
    target_critic: jax.Array
    log_alpha: jax.Array


class SacOptState(NamedTuple):
    actor: Any
    critic: Any
    alpha: Any


class SacState(NamedTuple):
    params: SacParams
    opt_state: SacOptState
    buffer: Any  # flashbax buffer state (experience, indices and, if prioritized, the sum tree)
    slot: EnvSlot
    obs: jax.Array
    key: jax.Array
    update: jax.Array  # updates done so far
    env_steps: jax.Array  # env steps this shard has taken


class SacMetrics(NamedTuple):
    return_sum: jax.Array
    episodes: jax.Array
    length_sum: jax.Array
    critic_loss: jax.Array
    actor_loss: jax.Array
    alpha: jax.Array
    entropy: jax.Array  # -log pi of the actor's fresh actions (an estimate of the policy's entropy)
    q_mean: jax.Array
    gradient_steps: jax.Array  # taken this update (0 while the buffer fills)


# ---------------------------------------------------------------- the paper's pieces (unit-tested by hand)
def squashed_log_prob(u: jax.Array, mean: jax.Array, log_std: jax.Array) -> jax.Array:
    """log pi(tanh(u)) for u ~ N(mean, exp(log_std)): the Gaussian's log density minus sum_i log(1 - tanh(u_i)^2)
    (Haarnoja et al. 2018, appendix C, eq. 26), the latter as 2 (log 2 - u - softplus(-2u)), which is exact and
    finite where tanh(u) rounds to +-1."""
    z = (u - mean) * jnp.exp(-log_std)
    gaussian = jnp.sum(-0.5 * z**2 - log_std - 0.5 * math.log(2 * math.pi), axis=-1)
    return gaussian - jnp.sum(2.0 * (LOG2 - u - jax.nn.softplus(-2.0 * u)), axis=-1)


def soft_q_target(reward: jax.Array, terminated: jax.Array, next_qs: jax.Array, next_logp: jax.Array,
                  alpha: jax.Array, gamma: float) -> jax.Array:
    """y = r + gamma (1 - terminated) (min_i Q'_i(s', a') - alpha log pi(a'|s')), a' ~ pi(.|s'); next_qs: [2, B]."""
    return reward + gamma * (1.0 - terminated) * (jnp.min(next_qs, axis=0) - alpha * next_logp)


def critic_loss(qs: jax.Array, target: jax.Array, weights: jax.Array) -> jax.Array:
    """Both critics' squared errors against the target, 0.5 (Q_i - y)^2 summed over i, weighted mean over the batch."""
    return jnp.mean(weights * jnp.sum(0.5 * (qs - target) ** 2, axis=0))


def _mean(x: jax.Array, mask: jax.Array | None) -> jax.Array:
    return jnp.mean(x) if mask is None else jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def actor_loss(logp: jax.Array, qs: jax.Array, alpha: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """E[alpha log pi(a|s) - min_i Q_i(s, a)], a ~ pi(.|s) reparameterised (eq. 7 with clipped double Q); the mean
    over the batch's states where `mask` (1/0) is 1."""
    return _mean(alpha * logp - jnp.min(qs, axis=0), mask)


def temperature_loss(log_alpha: jax.Array, logp: jax.Array, target_entropy: float,
                     mask: jax.Array | None = None) -> jax.Array:
    """-log alpha * E[log pi(a|s) + target entropy] (eq. 18 on log alpha); logp is a constant here."""
    return -log_alpha * _mean(jax.lax.stop_gradient(logp) + target_entropy, mask)


def importance_weights(probabilities: jax.Array, size: jax.Array, beta: jax.Array) -> jax.Array:
    """w_i = (N P(i))^-beta normalised by the batch's largest weight (Schaul et al. 2016, Algorithm 1)."""
    w = (size * probabilities) ** (-beta)
    return w / jnp.max(w)


def linear(start: float, end: float, fraction: jax.Array) -> jax.Array:
    return start + (end - start) * jnp.clip(fraction, 0.0, 1.0)


# ---------------------------------------------------------------- the algorithm
class SAC:
    def __init__(self, cfg: JaxConfig, env: Environment, total_updates: int) -> None:
        space = env.action_space
        if not isinstance(space, Box):
            raise ValueError(f"algorithm sac needs continuous (Box) actions; {cfg.env} has {space}")
        assert cfg.sac is not None
        self.cfg, self.sac, self.env = cfg, cfg.sac, env
        self.total_updates = max(total_updates, 1)
        self.action_dim = math.prod(space.shape)
        self.low = jnp.broadcast_to(jnp.asarray(space.low, jnp.float32), space.shape).reshape(-1)
        self.high = jnp.broadcast_to(jnp.asarray(space.high, jnp.float32), space.shape).reshape(-1)
        self.obs_size = math.prod(env.observation_shape)
        hidden = tuple(cfg.hidden_sizes)
        dummy_obs, dummy_action = jnp.zeros((self.obs_size,), jnp.float32), jnp.zeros((self.action_dim,), jnp.float32)
        self.actor = Flat(SquashedGaussianActor(self.action_dim, hidden, cfg.activation, self.sac.log_std_min,
                                                self.sac.log_std_max), dummy_obs)
        self.critic = Flat(TwinQ(hidden, cfg.activation), dummy_obs, dummy_action)
        steps = self.total_updates * self.sac.gradient_steps
        lr = optax.linear_schedule(cfg.lr, 0.0, steps) if cfg.lr_annealed else cfg.lr
        self.tx = optax.adam(lr)
        self.target_entropy = -float(self.action_dim)
        self.envs_per_shard = cfg.num_envs // cfg.shards
        self.buffer = self._make_buffer(self.sac)

    def _make_buffer(self, sac: SacConfig):
        # Created with exponent 1: update() hands it p^alpha itself (alpha may anneal)
        kwargs = dict(max_length=sac.buffer_size, min_length=1, sample_batch_size=sac.batch_size,
                      add_sequences=True, add_batches=False)
        if sac.prioritized:
            backend = jax.default_backend()
            return fbx.make_prioritised_item_buffer(**kwargs, priority_exponent=1.0,
                                                    device=backend if backend in ("gpu", "tpu") else "cpu")
        return fbx.make_item_buffer(**kwargs)

    def _flatten_obs(self, obs: jax.Array) -> jax.Array:
        return obs.reshape(obs.shape[: obs.ndim - len(self.env.observation_shape)] + (self.obs_size,)).astype(jnp.float32)

    def _to_env(self, action: jax.Array) -> jax.Array:
        scaled = self.low + 0.5 * (action + 1.0) * (self.high - self.low)
        return scaled.reshape(action.shape[:-1] + self.env.action_space.shape)

    def q_values(self, critic_params: jax.Array, obs: jax.Array, action: jax.Array) -> jax.Array:
        return self.critic.apply(critic_params, obs, action)

    def sample_action(self, actor_params: Any, obs: jax.Array, key: jax.Array) -> tuple[jax.Array, jax.Array]:
        """A reparameterised action in [-1, 1]^d and its log-probability."""
        mean, log_std = self.actor.apply(actor_params, obs)
        u = mean + jnp.exp(log_std) * jax.random.normal(key, mean.shape)
        return jnp.tanh(u), squashed_log_prob(u, mean, log_std)

    # ---- state
    def init_seed(self, key: jax.Array) -> SacState:
        cfg = self.cfg
        k_actor, k_critic, k_shards = jax.random.split(key, 3)
        actor, critic = self.actor.init(k_actor), self.critic.init(k_critic)
        dummy_obs = jnp.zeros((self.obs_size,), jnp.float32)
        log_alpha = jnp.asarray(math.log(self.sac.init_alpha), jnp.float32)
        params = SacParams(actor, critic, critic, log_alpha)
        opt = SacOptState(self.tx.init(actor), self.tx.init(critic), self.tx.init(log_alpha))
        item = Transition(dummy_obs, jnp.zeros((self.action_dim,), jnp.float32), jnp.zeros((), jnp.float32),
                          dummy_obs, jnp.zeros((), jnp.float32))
        buffer = self.buffer.init(item)
        slot, obs, keys = reset_shards(self.env, k_shards, cfg.shards, self.envs_per_shard)
        zeros = jnp.zeros((cfg.shards,), jnp.int32)
        return SacState(replicate(params, cfg.shards), replicate(opt, cfg.shards), replicate(buffer, cfg.shards),
                        slot, obs, keys, zeros, zeros)

    # ---- one update
    def make_update(self, axes: Sequence[str]):
        cfg, sac = self.cfg, self.sac
        axes = tuple(axes)
        n_envs = self.envs_per_shard
        step_env = jax.vmap(lambda ks, kr, s, a: auto_reset_step(self.env, ks, kr, s, a))

        def pmean(x):
            return jax.lax.pmean(x, axes) if axes else x

        def env_step(carry, xs):
            # Uniform random actions until `learning_starts` env steps, then the policy's samples
            actor_params, slot, obs, env_steps = carry
            k_act, k_uniform, k_step, k_reset = xs
            policy_action, _ = self.sample_action(actor_params, self._flatten_obs(obs), k_act)
            uniform = jax.random.uniform(k_uniform, policy_action.shape, minval=-1.0, maxval=1.0)
            action = jnp.where(env_steps < sac.learning_starts, uniform, policy_action)
            out = step_env(k_step, k_reset, slot, self._to_env(action))
            terminated = jnp.logical_and(out.done, jnp.logical_not(out.truncated)).astype(jnp.float32)
            trans = Transition(self._flatten_obs(obs), action, out.reward, self._flatten_obs(out.final_obs), terminated)
            return (actor_params, out.slot, out.obs, env_steps + n_envs), (trans, out.finished_return,
                                                                           out.finished_length, out.done)

        def gradient_step(carry, key):
            params, opt, buffer, progress = carry
            k_sample, k_next, k_pi = jax.random.split(key, 3)
            sample = self.buffer.sample(buffer, k_sample)
            mb: Transition = sample.experience
            alpha = jnp.exp(params.log_alpha)
            if sac.prioritized:
                size = jnp.minimum(progress.env_steps, sac.buffer_size).astype(jnp.float32)
                beta = linear(sac.priority_beta, sac.priority_beta_end, progress.fraction)
                # flashbax's float32 sum tree drifts (its inner sums are updated by deltas): a query near the
                # top can land on an empty leaf past the filled part (probability 0, measured here after ~6k
                # updates). Such a draw gets weight 0 and keeps priority 0.
                valid = sample.probabilities > 0
                weights = importance_weights(jnp.where(valid, sample.probabilities, 1.0), size, beta) * valid
                states = valid.astype(jnp.float32)  # the actor and temperature losses skip such draws too
            else:
                weights, states = jnp.ones_like(mb.reward), None

            next_action, next_logp = self.sample_action(params.actor, mb.next_obs, k_next)
            next_qs = self.q_values(params.target_critic, mb.next_obs, next_action)
            target = jax.lax.stop_gradient(soft_q_target(mb.reward, mb.terminated, next_qs, next_logp, alpha, cfg.gamma))

            def q_loss(critic_params):
                qs = self.q_values(critic_params, mb.obs, mb.action)
                return critic_loss(qs, target, weights), qs

            (c_loss, qs), c_grad = jax.value_and_grad(q_loss, has_aux=True)(params.critic)
            c_updates, c_opt = self.tx.update(pmean(c_grad), opt.critic, params.critic)
            critic = optax.apply_updates(params.critic, c_updates)

            def pi_loss(actor_params):
                action, logp = self.sample_action(actor_params, mb.obs, k_pi)
                return actor_loss(logp, self.q_values(critic, mb.obs, action), alpha, states), logp

            (a_loss, logp), a_grad = jax.value_and_grad(pi_loss, has_aux=True)(params.actor)
            a_updates, a_opt = self.tx.update(pmean(a_grad), opt.actor, params.actor)
            actor = optax.apply_updates(params.actor, a_updates)

            t_grad = jax.grad(temperature_loss)(params.log_alpha, logp, self.target_entropy, states)
            t_updates, t_opt = self.tx.update(pmean(t_grad), opt.alpha, params.log_alpha)
            log_alpha = optax.apply_updates(params.log_alpha, t_updates)

            target_critic = optax.incremental_update(critic, params.target_critic, sac.tau)
            if sac.prioritized:
                td = jnp.mean(jnp.abs(qs - target), axis=0)
                priority_alpha = linear(sac.priority_alpha, sac.priority_alpha if sac.priority_alpha_end is None
                                        else sac.priority_alpha_end, progress.fraction)
                priorities = jnp.where(valid, (td + sac.priority_eps) ** priority_alpha, 0.0)
                buffer = self.buffer.set_priorities(buffer, sample.indices, priorities)
            stats = jnp.stack([c_loss, a_loss, alpha, -jnp.mean(logp), jnp.mean(qs)])
            return (SacParams(actor, critic, target_critic, log_alpha), SacOptState(a_opt, c_opt, t_opt), buffer,
                    progress), stats

        def train(params, opt, buffer, progress, key):
            keys = jax.random.split(key, sac.gradient_steps)
            (params, opt, buffer, _), stats = jax.lax.scan(gradient_step, (params, opt, buffer, progress), keys)
            return params, opt, buffer, jnp.mean(stats, axis=0)

        def skip(params, opt, buffer, progress, key):
            # zeros typed like train's stats: varying over the mesh axes under shard_map, as the state is
            return params, opt, buffer, jnp.zeros((5,), jnp.float32) * params.log_alpha

        def update(st: SacState, _=None) -> tuple[SacState, SacMetrics]:
            key, k_act, k_env, k_train = jax.random.split(st.key, 4)
            act_keys = jax.random.split(k_act, (cfg.num_steps, 2))
            env_keys = jax.random.split(k_env, (cfg.num_steps, 2, n_envs))
            (_, slot, obs, env_steps), (traj, fin_ret, fin_len, done) = jax.lax.scan(
                env_step, (st.params.actor, st.slot, st.obs, st.env_steps),
                (act_keys[:, 0], act_keys[:, 1], env_keys[:, 0], env_keys[:, 1]))
            flat = jax.tree.map(lambda x: x.reshape((cfg.num_steps * n_envs,) + x.shape[2:]), traj)
            buffer = self.buffer.add(st.buffer, flat)
            progress = Progress(env_steps, st.update.astype(jnp.float32) / self.total_updates)
            ready = env_steps >= max(sac.learning_starts, sac.batch_size)
            params, opt, buffer, stats = jax.lax.cond(ready, train, skip, st.params, st.opt_state, buffer, progress,
                                                      k_train)
            metrics = SacMetrics(jnp.sum(fin_ret), jnp.sum(done.astype(jnp.int32)), jnp.sum(fin_len), *stats,
                                 jnp.where(ready, sac.gradient_steps, 0))
            return SacState(params, opt, buffer, slot, obs, key, st.update + 1, env_steps), metrics

        return update

    def policy_mean_action(self, actor_params: Any, obs: jax.Array) -> jax.Array:
        """The deterministic action (tanh of the mean) in the env's bounds, for evaluation."""
        mean, _ = self.actor.apply(actor_params, self._flatten_obs(obs))
        return self._to_env(jnp.tanh(mean))


class Progress(NamedTuple):
    env_steps: jax.Array  # this shard's env steps so far (the buffer holds min(env_steps, buffer_size))
    fraction: jax.Array  # of the run's updates done (prioritized replay's alpha and beta anneal over it)
