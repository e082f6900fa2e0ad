"""The JAX engine's config section (`jax:` in the YAML). Pure pydantic: importing it must not import jax."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SacConfig(BaseModel):
    """Soft actor-critic (`algorithm: sac`). One update = `num_steps` vector env steps into the replay buffer, then
    `gradient_steps` gradient steps on sampled batches (each: twin critics, actor, temperature, Polyak targets)."""
    model_config = ConfigDict(extra="forbid")

    buffer_size: int = Field(100_000, gt=0)  # transitions held per shard (flashbax, on device)
    batch_size: int = Field(256, gt=0)
    learning_starts: int = Field(1_000, ge=0)  # env steps per shard of uniform random actions before any update
    gradient_steps: int = Field(1, gt=0)  # per update
    tau: float = Field(0.005, gt=0, le=1)  # Polyak averaging weight of the target critics
    init_alpha: float = Field(1.0, gt=0)  # initial temperature (learned; target entropy -action_dim)
    log_std_min: float = -5.0
    log_std_max: float = 2.0
    # Prioritized replay (Schaul et al. 2016): alpha (priority exponent) and beta (importance-weight exponent)
    # anneal linearly from their start to their end value over the run's updates.
    prioritized: bool = False
    priority_alpha: float = Field(0.6, ge=0, le=1)
    priority_alpha_end: float | None = Field(None, ge=0, le=1)  # None: constant alpha
    priority_beta: float = Field(0.4, ge=0, le=1)
    priority_beta_end: float = Field(1.0, ge=0, le=1)
    priority_eps: float = Field(1e-6, gt=0)

    @model_validator(mode="after")
    def _sizes(self) -> "SacConfig":
        if self.log_std_min >= self.log_std_max:
            raise ValueError("sac.log_std_min must be below sac.log_std_max")
        return self


class ImpalaConfig(BaseModel):
    """IMPALA-style actor/learner in one program (`algorithm: impala`): the vmapped actors act with the
    parameters the learner had `lag` updates before; the learner corrects with V-trace (Espeholt et al. 2018)."""
    model_config = ConfigDict(extra="forbid")

    lag: int = Field(1, ge=0)  # policy lag of the actors, in learner updates (0: on-policy)
    rho_bar: float = Field(1.0, gt=0)
    c_bar: float = Field(1.0, gt=0)
    pg_rho_bar: float | None = Field(None, gt=0)  # None: rho_bar
    trace_lambda: float = Field(1.0, ge=0, le=1)
    minibatches: int = Field(1, gt=0)  # learner steps per batch of trajectories (split over envs)


# Fields only PPO reads: set (to other than their defaults) with another algorithm they would be silently
# ignored, so they are refused.
PPO_ONLY = frozenset({"epochs", "minibatches", "gae_lambda", "clip_eps", "normalize_advantages", "grad_chunk_rows",
                      "normalize_observations", "obs_clip", "scale_rewards", "reward_clip"})
ACTOR_CRITIC_ONLY = frozenset({"ent_coef", "vf_coef", "max_grad_norm"})  # PPO and IMPALA (SAC: plain Adam)


class JaxConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    algorithm: Literal["ppo", "sac", "impala"] = "ppo"
    # A gymnax id ("CartPole-v1", "Acrobot-v1", "Breakout-MinAtar", "Pendulum-v1", ...) or
    # "package.module:factory" where factory() returns a `trainer.jax.envs.Environment`, or "brax/<name>"
    # for a Brax environment ("brax/inverted_pendulum", "brax/hopper", ...).
    env: str = "CartPole-v1"
    env_kwargs: dict[str, Any] = Field(default_factory=dict)  # passed to the env's constructor (brax: backend, episode_length)
    num_envs: int = Field(4, gt=0)  # total over all shards
    num_steps: int = Field(128, gt=0)  # vector env steps per update (PPO/IMPALA: the rollout length)
    updates_per_iteration: int = Field(10, gt=0)  # updates per jitted chunk (one tide iteration)
    epochs: int = Field(4, gt=0)
    minibatches: int = Field(4, gt=0)  # per shard
    gamma: float = Field(0.99, gt=0, le=1)
    gae_lambda: float = Field(0.95, ge=0, le=1)
    clip_eps: float = Field(0.2, gt=0)
    ent_coef: float = Field(0.01, ge=0)
    vf_coef: float = Field(0.5, ge=0)
    max_grad_norm: float = Field(0.5, gt=0)
    lr: float = Field(2.5e-4, gt=0)
    anneal_lr: bool | None = None  # linear decay to 0 over the run's updates; None: PPO and IMPALA yes, SAC no
    normalize_advantages: bool = True
    # Running observation normalisation and reward scaling (Engstrom et al. 2020; trainer/jax/normalization.py):
    # off by default, as in PPO's paper; locomotion tasks want both (configs/brax_hopper.yaml).
    normalize_observations: bool = False
    obs_clip: float = Field(10.0, gt=0)
    scale_rewards: bool = False
    reward_clip: float = Field(10.0, gt=0)
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
    # The library XLA:CPU runs matrix products with: "ynnpack" (XLA's default) or "eigen" (XLA's own dots). Which
    # is faster depends on the products' shapes and the core count: on 2 cores, Eigen splits [256, 128] x
    # [128, 128] over both cores (~1.5x YNNPACK, which keeps it on one) but is slower at small products and
    # at 256-wide layers (docs/design.md has the measured table). Ignored on GPU and TPU.
    cpu_matmul: Literal["ynnpack", "eigen"] = "ynnpack"
    compilation_cache_dir: str | None = ".cache/jax"
    sac: SacConfig | None = None  # `algorithm: sac` only; None: defaults
    impala: ImpalaConfig | None = None  # `algorithm: impala` only; None: defaults

    @property
    def lr_annealed(self) -> bool:
        return self.algorithm != "sac" if self.anneal_lr is None else self.anneal_lr

    @model_validator(mode="after")
    def _algorithm_fields(self) -> "JaxConfig":
        for section in ("sac", "impala"):
            if getattr(self, section) is not None and self.algorithm != section:
                raise ValueError(f"jax.{section} is read only with `algorithm: {section}` (algorithm is {self.algorithm})")
        if self.algorithm == "sac" and self.sac is None:
            self.sac = SacConfig()
        if self.algorithm == "impala" and self.impala is None:
            self.impala = ImpalaConfig()
        # Refused only when they differ from their defaults: a resolved config (every field written out) loads back.
        unread = PPO_ONLY if self.algorithm == "impala" else PPO_ONLY | ACTOR_CRITIC_ONLY
        fields = type(self).model_fields
        unused = sorted(f for f in unread & self.model_fields_set if getattr(self, f) != fields[f].get_default(
            call_default_factory=True)) if self.algorithm != "ppo" else []
        if unused:
            raise ValueError(f"jax.{', jax.'.join(unused)} {'is' if len(unused) == 1 else 'are'} not read by "
                             f"algorithm {self.algorithm}: remove {'it' if len(unused) == 1 else 'them'}")
        return self

    @model_validator(mode="after")
    def _divisible(self) -> "JaxConfig":
        if self.num_envs % self.shards:
            raise ValueError(f"num_envs ({self.num_envs}) must be divisible by shards ({self.shards})")
        batch = self.num_envs // self.shards * self.num_steps
        if self.algorithm == "ppo" and batch % self.minibatches:
            raise ValueError(f"per-shard batch {batch} (num_envs/shards*num_steps) must be divisible by minibatches")
        if self.devices is not None and not device_splits(self.seeds, self.shards, self.devices):
            raise ValueError(f"devices ({self.devices}) must split as (devices over seeds) x (devices over shards), "
                             f"dividing seeds ({self.seeds}) and shards ({self.shards})")
        if self.impala is not None and (self.num_envs // self.shards) % self.impala.minibatches:
            raise ValueError(f"envs per shard ({self.num_envs // self.shards}) must be divisible by impala.minibatches")
        if self.sac is not None and self.sac.buffer_size < self.num_envs // self.shards * self.num_steps:
            raise ValueError("sac.buffer_size must hold at least one update's transitions (num_envs/shards*num_steps)")
        if not self.hidden_sizes or any(h <= 0 for h in self.hidden_sizes):
            raise ValueError("hidden_sizes must be a non-empty list of positive ints")
        return self


def device_splits(seeds: int, shards: int, devices: int) -> list[tuple[int, int]]:
    """The ways to lay `devices` out as (devices over seeds, devices over shards), each dividing its axis."""
    return [(a, devices // a) for a in range(1, devices + 1)
            if devices % a == 0 and seeds % a == 0 and shards % (devices // a) == 0]
