"""The JAX engine: builds the jitted training chunk (N updates of PPO, SAC or IMPALA) vmapped over seeds and shards and,
with several devices, shard_mapped over a (`seed`, `data`) mesh; initial state, checkpoint save/restore,
and host-side metric summaries.

State layout: every leaf of the algorithm's state has leading axes [seeds, shards]. Parameters and optimizer
state are replicated over shards (identical initialisation, averaged gradients). Seeds are independent,
so devices go to seeds first: they need no communication at all."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from trainer.jax.algorithm import make_algorithm, summarize  # noqa: F401  (summarize: part of this module's API)
from trainer.jax.config import JaxConfig, device_splits
from trainer.jax.envs import make_env
from trainer.jax import lowering

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
        self.env = make_env(cfg.env, **cfg.env_kwargs)
        self.algorithm = make_algorithm(cfg, self.env, total_updates)
        seed_devices, shard_devices = pick_devices(cfg, devices)
        self.n_devices = seed_devices * shard_devices
        self.mesh = None
        if self.n_devices > 1:
            grid = np.array(jax.devices()[: self.n_devices]).reshape(seed_devices, shard_devices)
            self.mesh = Mesh(grid, (SEED_MESH_AXIS, MESH_AXIS))
        local_seeds, local_shards = cfg.seeds // seed_devices, cfg.shards // shard_devices
        axes = tuple(a for a, n in ((SHARD_AXIS, local_shards), (MESH_AXIS, shard_devices)) if n > 1)
        update = self.algorithm.make_update(axes)

        def per_shard(state: Any) -> tuple[Any, Any]:
            return jax.lax.scan(update, state, None, cfg.updates_per_iteration)

        chunk = _batch(_batch(per_shard, local_shards, SHARD_AXIS), local_seeds, None)
        if self.mesh is not None:
            # flashbax's sum tree (prioritized replay) carries an unvarying constant through a fori_loop, which
            # shard_map's varying-axes check rejects; JAX's advised workaround is to switch the check off there.
            check_vma = not (cfg.sac is not None and cfg.sac.prioritized)
            chunk = jax.shard_map(chunk, mesh=self.mesh, in_specs=(STATE_SPEC,), out_specs=STATE_SPEC,
                                  check_vma=check_vma)
        self._chunk = jax.jit(chunk, donate_argnums=0)
        self._compiled: Any = None

    def params_tree(self, state: Any, seed: int = 0) -> Any:
        """One seed's policy parameters as the Flax variable tree (PPO and IMPALA)."""
        return self.algorithm.params_tree(state, seed)

    @property
    def steps_per_chunk(self) -> int:
        """Environment steps of one chunk, all seeds together."""
        c = self.cfg
        return c.seeds * c.num_envs * c.num_steps * c.updates_per_iteration

    # ---- state ---------------------------------------------------------------------------------
    def init_state(self) -> Any:
        root = jax.random.PRNGKey(self.seed)
        # fold_in, not split: seed i of a vmapped run is the same agent whatever `seeds` is.
        states = [self.algorithm.init_seed(jax.random.fold_in(root, i)) for i in range(self.cfg.seeds)]
        return self.place(jax.tree.map(lambda *xs: jnp.stack(xs), *states))

    def place(self, state: Any) -> Any:
        if self.mesh is None:
            return jax.device_put(state, jax.devices()[0])
        return jax.device_put(state, NamedSharding(self.mesh, STATE_SPEC))

    # ---- running -------------------------------------------------------------------------------
    def compile(self, state: Any) -> None:
        self._compiled = lowering.compile(self._chunk, state, cpu_matmul=self.cfg.cpu_matmul)

    def run_chunk(self, state: Any) -> tuple[Any, Any]:
        """Run `updates_per_iteration` updates; `state` is donated (do not reuse it)."""
        if self._compiled is None:
            self.compile(state)
        return self._compiled(state)

    # ---- checkpoints ---------------------------------------------------------------------------
    def save(self, path: Path, state: Any) -> None:
        """The whole state (parameters, optimizers, env states, observations, raw PRNG keys and, for SAC, the
        replay buffer with its priorities), so that a restored run continues bit for bit."""
        import orbax.checkpoint as ocp

        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(Path(path).absolute(), jax.device_get(state))
            ckptr.wait_until_finished()

    def restore(self, path: Path) -> Any:
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


def flat_params(state: Any) -> np.ndarray:
    """PPO's and IMPALA's parameters as [seeds, shards, n_params] (shards hold identical copies)."""
    return np.asarray(jax.device_get(state.params))
