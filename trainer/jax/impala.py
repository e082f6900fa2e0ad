"""IMPALA-style actor/learner in one jitted program (`algorithm: impala`).

Espeholt et al. 2018, "IMPALA: Scalable Distributed Deep-RL with Importance Weighted Actor-Learner Architectures":
actors run a behaviour policy mu whose parameters lag the learner's pi, and the learner corrects for the lag with
V-trace (trainer/jax/vtrace.py). Here the actors are the vmapped envs of each shard, acting with the parameters the
learner had `impala.lag` updates before (a ring of past parameters in the state stands in for the parameter
server's delay); the learner then takes `impala.minibatches` gradient steps on their trajectories. Loss (section
4.2): the V-trace policy gradient -rho_s A_s log pi(a_s|x_s) with A_s = r_s + gamma v_{s+1} - V(x_s), the value
regression 0.5 (v_s - V(x_s))^2 weighted by vf_coef, and an entropy bonus weighted by ent_coef.

Variants of the paper, by name: Adam (after global-norm clipping) instead of RMSProp, as in PPO here; the actors'
lag is a fixed number of updates instead of whatever the asynchronous system happens to give; an episode cut by
the time limit bootstraps from the value of its last observation (Pardo et al. 2018), folded into that step's
reward with the discount then 0, which is the same TD error and stops the trace as the episode's end does."""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from trainer.jax.config import JaxConfig
from trainer.jax.envs import EnvSlot, Environment
from trainer.jax.on_policy import PolicyStep, actor_critic, clipped_adam, cut_values, make_policy_rollout
from trainer.jax.shards import replicate, reset_shards
from trainer.jax.vtrace import vtrace


class ImpalaState(NamedTuple):
    params: jax.Array  # the learner's, flat
    opt_state: Any
    history: jax.Array  # [lag, n_params]: the learner's parameters of the last `lag` updates, oldest first
    slot: EnvSlot
    obs: jax.Array
    key: jax.Array
    update: jax.Array


class ImpalaMetrics(NamedTuple):
    return_sum: jax.Array
    episodes: jax.Array
    length_sum: jax.Array
    pg_loss: jax.Array
    value_loss: jax.Array
    entropy: jax.Array
    rho_mean: jax.Array  # mean importance ratio pi/mu over the batch (1 when the actors are on-policy)
    rho_clip_frac: jax.Array  # fraction of steps with rho > rho_bar


class Impala:
    def __init__(self, cfg: JaxConfig, env: Environment, total_updates: int) -> None:
        assert cfg.impala is not None
        self.cfg, self.imp, self.env = cfg, cfg.impala, env
        self.agent = actor_critic(cfg, env)
        self.tx = clipped_adam(cfg, max(total_updates, 1) * self.imp.minibatches)

    def init_seed(self, key: jax.Array) -> ImpalaState:
        cfg = self.cfg
        k_params, k_shards = jax.random.split(key)
        params = self.agent.init(k_params)
        history = jnp.broadcast_to(params, (self.imp.lag,) + params.shape)
        slot, obs, keys = reset_shards(self.env, k_shards, cfg.shards, cfg.num_envs // cfg.shards)
        return ImpalaState(replicate(params, cfg.shards), replicate(self.tx.init(params), cfg.shards),
                           replicate(history, cfg.shards), slot, obs, keys, jnp.zeros((cfg.shards,), jnp.int32))

    def params_tree(self, state: ImpalaState, seed: int = 0) -> Any:
        return self.agent.seed_tree(state.params, seed)

    def make_update(self, axes: Sequence[str]):
        cfg, imp, apply = self.cfg, self.imp, self.agent.apply
        axes = tuple(axes)
        n_envs = cfg.num_envs // cfg.shards
        rollout = make_policy_rollout(cfg, self.env, self.agent, n_envs)
        envs_per_mb = n_envs // imp.minibatches

        def pmean(x):
            return jax.lax.pmean(x, axes) if axes else x

        def loss_fn(params, traj: PolicyStep, last_obs):
            dist, values = apply(params, traj.obs)  # [T, envs]
            logp = dist.log_prob(traj.action)
            const = jax.lax.stop_gradient
            bootstrap = const(apply(params, last_obs)[1])
            # A time-limit cut: the TD error bootstraps from the last observation's value, and the trace stops.
            end_value = cut_values(lambda o: const(apply(params, o)[1]), traj.truncated, traj.final_obs,
                                   getattr(self.env, "max_episode_steps", None))
            rewards = traj.reward + cfg.gamma * end_value
            discounts = cfg.gamma * (1.0 - traj.done.astype(jnp.float32))
            log_rhos = const(logp) - traj.logp  # traj.logp: the behaviour policy's
            vs, pg_adv = vtrace(log_rhos, discounts, rewards, const(values), bootstrap, imp.rho_bar, imp.c_bar,
                                imp.pg_rho_bar, imp.trace_lambda)
            pg_loss = -jnp.mean(pg_adv * logp)
            value_loss = 0.5 * jnp.mean((vs - values) ** 2)
            entropy = jnp.mean(dist.entropy())
            total = pg_loss + cfg.vf_coef * value_loss - cfg.ent_coef * entropy
            rhos = jnp.exp(log_rhos)
            return total, (pg_loss, value_loss, entropy, jnp.mean(rhos), jnp.mean((rhos > imp.rho_bar).astype(jnp.float32)))

        grad_of = jax.grad(loss_fn, has_aux=True)

        def learner_step(carry, mb):
            params, opt_state = carry
            traj, last_obs = mb
            grads, aux = grad_of(params, traj, last_obs)
            updates, opt_state = self.tx.update(pmean(grads), opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), aux

        def update(st: ImpalaState, _=None) -> tuple[ImpalaState, ImpalaMetrics]:
            key, k_rollout = jax.random.split(st.key)
            behaviour = st.history[0] if imp.lag else st.params
            (slot, obs), traj = rollout(behaviour, st.slot, st.obs, k_rollout)
            # Minibatches split the envs (whole trajectories): [mb, T, envs/mb, ...]
            split = jax.tree.map(lambda x: jnp.moveaxis(x.reshape((cfg.num_steps, imp.minibatches, envs_per_mb)
                                                                  + x.shape[2:]), 1, 0), traj)
            last = obs.reshape((imp.minibatches, envs_per_mb) + obs.shape[1:])
            (params, opt_state), aux = jax.lax.scan(learner_step, (st.params, st.opt_state), (split, last))
            history = jnp.concatenate([st.history[1:], st.params[None]]) if imp.lag else st.history
            metrics = ImpalaMetrics(jnp.sum(traj.finished_return), jnp.sum(traj.done.astype(jnp.int32)),
                                    jnp.sum(traj.finished_length),
                                    *(jnp.mean(a) for a in aux))
            return ImpalaState(params, opt_state, history, slot, obs, key, st.update + 1), metrics

        return update
