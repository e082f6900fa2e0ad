"""What the engine needs from an RL algorithm (PPO, SAC, IMPALA): the protocol, the registry that builds one by
name, and the host-side summary of its metrics. The pieces the algorithms share live below them (shards.py,
on_policy.py): nothing here is imported back by an algorithm.

An algorithm works on one data shard of one seed: `init_seed` builds a seed's state with a leading [shards]
axis (parameters identical on every shard, environments and RNG streams not), `make_update(axes)` returns one
jittable update step that averages whatever it must over the named `axes` (the shards), and the update's
metrics carry at least `return_sum`, `episodes` and `length_sum` (the episodes that finished during it); every
other metric field is a scalar averaged over seeds, shards and updates by `summarize`."""
from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import jax
import numpy as np

from trainer.jax.config import JaxConfig
from trainer.jax.envs import Environment


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
