"""The JAX engine: builds the jitted training chunk (N PPO updates) vmapped over seeds and shards and,
with several devices, shard_mapped over a (`seed`, `data`) mesh; initial state, checkpoint save/restore,
and host-side metric summaries.

State layout: every leaf of the runner state has leading axes [seeds, shards]. Parameters and optimizer
state are replicated over shards (identical initialisation, averaged gradients). Seeds are independent,
so devices go to seeds first: they need no communication at all."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from trainer.jax.config import JaxConfig, device_splits
from trainer.jax.envs import Discrete, make_env, reset_slot
from trainer.jax.networks import ActorCritic
from trainer.jax.ppo import RunnerState, UpdateMetrics, make_optimizer, make_update

SHARD_AXIS = "shard"
SEED_MESH_AXIS = "seed"
MESH_AXIS = "data"
STATE_SPEC = P(SEED_MESH_AXIS, MESH_AXIS)  # the runner state's [seeds, shards] leading axes on the mesh


def enable_compilation_cache(path: str | None) -> None:
    if path:
        os.makedirs(path, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", os.path.abspath(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def use_cpu_cores(n: int | None = None) -> bool:
    """Create `n` XLA CPU devices (default: one per core this process may run on) so seeds and shards can
    run on every core. Only possible before JAX's backends start: returns False if they have, or if
    XLA_FLAGS already forces a host device count (the multi-device tests do)."""
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return False
    try:
        jax.config.update("jax_num_cpu_devices", n or len(os.sched_getaffinity(0)))
    except RuntimeError:  # backends already initialised
        return False
    return True


def pick_devices(cfg: JaxConfig, devices: int | None = None) -> tuple[int, int]:
    """(devices over seeds, devices over shards). `devices` (or cfg.devices) fixes the total; otherwise as
    many as divide the seeds and shards evenly. Ties go to seeds, which never communicate."""
    total = devices if devices is not None else cfg.devices
    if total is not None:
        if total > jax.device_count():
            raise ValueError(f"jax.devices asks for {total} devices, {jax.device_count()} available")
        splits = device_splits(cfg.seeds, cfg.shards, total)
        if not splits:
            raise ValueError(f"{total} devices cannot be split evenly over seeds ({cfg.seeds}) and shards ({cfg.shards})")
    else:
        splits = [s for n in range(1, jax.device_count() + 1) for s in device_splits(cfg.seeds, cfg.shards, n)]
    return max(splits, key=lambda s: (s[0] * s[1], s[0]))


class Engine:
    def __init__(self, cfg: JaxConfig, total_updates: int, seed: int, devices: int | None = None) -> None:
        self.cfg = cfg
        self.seed = seed
        self.env = make_env(cfg.env)
        space = self.env.action_space
        discrete = isinstance(space, Discrete)
        self.network = ActorCritic(
            action_dim=space.n if discrete else math.prod(space.shape),
            discrete=discrete,
            hidden_sizes=tuple(cfg.hidden_sizes),
            activation=cfg.activation,
            obs_rank=len(self.env.observation_shape),
        )
        self.tx = make_optimizer(cfg, total_updates)
        dummy = jnp.zeros(self.env.observation_shape, jnp.float32)
        shapes = jax.eval_shape(self.network.init, jax.random.PRNGKey(0), dummy)
        _, self.unravel = ravel_pytree(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes))
        seed_devices, shard_devices = pick_devices(cfg, devices)
        self.n_devices = seed_devices * shard_devices
        self.mesh = None
        if self.n_devices > 1:
            grid = np.array(jax.devices()[: self.n_devices]).reshape(seed_devices, shard_devices)
            self.mesh = Mesh(grid, (SEED_MESH_AXIS, MESH_AXIS))
        local_seeds, local_shards = cfg.seeds // seed_devices, cfg.shards // shard_devices
        axes = tuple(a for a, n in ((SHARD_AXIS, local_shards), (MESH_AXIS, shard_devices)) if n > 1)
        update = make_update(cfg, self.env, self._apply, self.tx, axes)

        def per_shard(rs: RunnerState) -> tuple[RunnerState, UpdateMetrics]:
            return jax.lax.scan(update, rs, None, cfg.updates_per_iteration)

        chunk = _batch(_batch(per_shard, local_shards, SHARD_AXIS), local_seeds, None)
        if self.mesh is not None:
            chunk = jax.shard_map(chunk, mesh=self.mesh, in_specs=(STATE_SPEC,), out_specs=STATE_SPEC)
        self._chunk = jax.jit(chunk, donate_argnums=0)
        self._compiled: Any = None

    # Parameters live as one flat vector: the optimizer (norm clipping, Adam) is then a handful of
    # ops per minibatch instead of a handful per parameter leaf.
    def _apply(self, flat: jax.Array, obs: jax.Array):
        return self.network.apply(self.unravel(flat), obs)

    def params_tree(self, state: RunnerState, seed: int = 0) -> Any:
        """One seed's parameters as the Flax variable tree (shard 0; all shards hold the same)."""
        return self.unravel(jnp.asarray(jax.device_get(state.params)[seed, 0]))

    @property
    def steps_per_chunk(self) -> int:
        """Environment steps of one chunk, all seeds together."""
        c = self.cfg
        return c.seeds * c.num_envs * c.num_steps * c.updates_per_iteration

    # ---- state ---------------------------------------------------------------------------------
    def init_state(self) -> RunnerState:
        cfg = self.cfg
        n_envs = cfg.num_envs // cfg.shards
        dummy = jnp.zeros(self.env.observation_shape, jnp.float32)
        # Parameters are initialised one seed at a time outside any vmap: orthogonal init (a batched
        # LAPACK QR) inside a vmapped jit can deadlock jaxlib's CPU thread pool (FEASIBILITY, JAX).
        init_params = jax.jit(self.network.init)

        @jax.jit
        def init_shards(key: jax.Array):
            def one(k):
                k_reset, k_run = jax.random.split(k)
                obs, slot = jax.vmap(lambda kk: reset_slot(self.env, kk))(jax.random.split(k_reset, n_envs))
                return slot, obs, k_run
            return jax.vmap(one)(jax.random.split(key, cfg.shards))

        states = []
        root = jax.random.PRNGKey(self.seed)
        # fold_in, not split: seed i of a vmapped run is the same agent whatever `seeds` is.
        for seed_key in (jax.random.fold_in(root, i) for i in range(cfg.seeds)):
            k_params, k_shards = jax.random.split(seed_key)
            params, _ = ravel_pytree(init_params(k_params, dummy))
            opt_state = self.tx.init(params)
            slot, obs, keys = init_shards(k_shards)
            rep = lambda x: jnp.broadcast_to(x, (cfg.shards,) + jnp.shape(x))  # noqa: E731
            states.append(RunnerState(jax.tree.map(rep, params), jax.tree.map(rep, opt_state), slot, obs, keys,
                                      jnp.zeros((cfg.shards,), jnp.int32)))
        return self.place(jax.tree.map(lambda *xs: jnp.stack(xs), *states))

    def place(self, state: Any) -> Any:
        if self.mesh is None:
            return jax.device_put(state, jax.devices()[0])
        return jax.device_put(state, NamedSharding(self.mesh, STATE_SPEC))

    # ---- running -------------------------------------------------------------------------------
    def compile(self, state: RunnerState) -> None:
        self._compiled = self._chunk.lower(state).compile()

    def run_chunk(self, state: RunnerState) -> tuple[RunnerState, UpdateMetrics]:
        """Run `updates_per_iteration` PPO updates; `state` is donated (do not reuse it)."""
        if self._compiled is None:
            self.compile(state)
        return self._compiled(state)

    # ---- checkpoints ---------------------------------------------------------------------------
    def save(self, path: Path, state: RunnerState) -> None:
        import orbax.checkpoint as ocp

        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(Path(path).absolute(), jax.device_get(state))
            ckptr.wait_until_finished()

    def restore(self, path: Path) -> RunnerState:
        import orbax.checkpoint as ocp

        target = jax.device_get(self.init_state())  # structure, shapes and dtypes to restore into
        with ocp.StandardCheckpointer() as ckptr:
            restored = ckptr.restore(Path(path).absolute(), target)
        return self.place(jax.tree.map(jnp.asarray, restored))


def _batch(f: Callable, size: int, axis_name: str | None) -> Callable:
    """vmap over a leading axis; a size-1 axis is squeezed instead, since vmap would turn every matmul
    into a batched dot with a unit batch dimension, which XLA:CPU runs markedly slower."""
    if size > 1:
        return jax.vmap(f, axis_name=axis_name)

    def squeezed(x):
        out = f(jax.tree.map(lambda a: a[0], x))
        return jax.tree.map(lambda a: a[None], out)

    return squeezed


def flat_params(state: RunnerState) -> np.ndarray:
    """All parameters as [seeds, shards, n_params] (shards hold identical copies)."""
    return np.asarray(jax.device_get(state.params))


def summarize(metrics: UpdateMetrics) -> dict[str, Any]:
    """Host-side reduction of one chunk's metrics (leaves [seeds, shards, updates])."""
    m = jax.device_get(metrics)
    ret = np.asarray(m.return_sum, np.float64).sum(axis=(1, 2))
    eps = np.asarray(m.episodes).sum(axis=(1, 2))
    lens = np.asarray(m.length_sum, np.float64).sum(axis=(1, 2))
    per_seed = np.where(eps > 0, ret / np.maximum(eps, 1), np.nan)
    out: dict[str, Any] = {
        "episode_return_mean": float(ret.sum() / eps.sum()) if eps.sum() else None,
        "episode_length_mean": float(lens.sum() / eps.sum()) if eps.sum() else None,
        "episodes": int(eps.sum()),
        "pg_loss": float(np.mean(m.pg_loss)),
        "value_loss": float(np.mean(m.v_loss)),
        "entropy": float(np.mean(m.entropy)),
        "approx_kl": float(np.mean(m.approx_kl)),
        "clip_frac": float(np.mean(m.clip_frac)),
    }
    if len(per_seed) > 1:
        out["episode_return_mean_per_seed"] = [None if np.isnan(x) else float(x) for x in per_seed]
    return out
