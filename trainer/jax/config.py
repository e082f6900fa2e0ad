"""The JAX engine's config section (`jax:` in the YAML). Pure pydantic: importing it must not import jax."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class JaxConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # A gymnax id ("CartPole-v1", "Acrobot-v1", "Breakout-MinAtar", "Pendulum-v1", ...) or
    # "package.module:factory" where factory() returns a `trainer.jax.envs.Environment`.
    env: str = "CartPole-v1"
    num_envs: int = Field(4, gt=0)  # total over all shards
    num_steps: int = Field(128, gt=0)  # rollout length per update
    updates_per_iteration: int = Field(10, gt=0)  # PPO updates per jitted chunk (one tide iteration)
    epochs: int = Field(4, gt=0)
    minibatches: int = Field(4, gt=0)  # per shard
    gamma: float = Field(0.99, gt=0, le=1)
    gae_lambda: float = Field(0.95, ge=0, le=1)
    clip_eps: float = Field(0.2, gt=0)
    ent_coef: float = Field(0.01, ge=0)
    vf_coef: float = Field(0.5, ge=0)
    max_grad_norm: float = Field(0.5, gt=0)
    lr: float = Field(2.5e-4, gt=0)
    anneal_lr: bool = True  # linear decay to 0 over iterations * updates_per_iteration updates
    normalize_advantages: bool = True
    hidden_sizes: list[int] = Field(default_factory=lambda: [64, 64])
    activation: Literal["tanh", "relu"] = "tanh"
    seeds: int = Field(1, gt=0)  # independent agents trained in one program (vmapped, spread over devices)
    # Data-parallel shards: each owns num_envs / shards envs, its own RNG stream and minibatch shuffle;
    # gradients and advantage statistics are averaged over shards. Results depend on `shards` only,
    # not on how many devices hold them.
    shards: int = Field(1, gt=0)
    # Devices to spread seeds and shards over (seeds first: they never communicate). None: as many as
    # the seeds and shards can be split over evenly.
    devices: int | None = Field(None, gt=0)
    # On a CPU host, the XLA CPU devices to create before JAX starts. None: one per core, so that seeds and
    # shards run on all cores (one XLA:CPU program mostly keeps to one core at these model sizes).
    cpu_devices: int | None = Field(None, gt=0)
    target_return: float = 475.0  # reported in metrics (`solved`); training does not stop early
    # Minibatches are differentiated in row chunks of this size (same mean gradient, cache-sized
    # activations). None: automatic (2048-row chunks when the minibatch is larger, measured best here);
    # 0: never.
    grad_chunk_rows: int | None = Field(None, ge=0)
    scan_unroll: int = Field(1, gt=0)  # lax.scan unroll of the rollout loop
    compilation_cache_dir: str | None = ".cache/jax"

    @model_validator(mode="after")
    def _divisible(self) -> "JaxConfig":
        if self.num_envs % self.shards:
            raise ValueError(f"num_envs ({self.num_envs}) must be divisible by shards ({self.shards})")
        batch = self.num_envs // self.shards * self.num_steps
        if batch % self.minibatches:
            raise ValueError(f"per-shard batch {batch} (num_envs/shards*num_steps) must be divisible by minibatches")
        if self.devices is not None and not device_splits(self.seeds, self.shards, self.devices):
            raise ValueError(f"devices ({self.devices}) must split as (devices over seeds) x (devices over shards), "
                             f"dividing seeds ({self.seeds}) and shards ({self.shards})")
        if not self.hidden_sizes or any(h <= 0 for h in self.hidden_sizes):
            raise ValueError("hidden_sizes must be a non-empty list of positive ints")
        return self


def device_splits(seeds: int, shards: int, devices: int) -> list[tuple[int, int]]:
    """The ways to lay `devices` out as (devices over seeds, devices over shards), each dividing its axis."""
    return [(a, devices // a) for a in range(1, devices + 1)
            if devices % a == 0 and seeds % a == 0 and shards % (devices // a) == 0]
