"""The JAX engine's config section (`jax:` in the YAML). Pure pydantic: importing it must not import jax."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from ckpt_transfer.config import StrictModel


class SacConfig(StrictModel):
    """Soft actor-critic (`algorithm: sac`). One update = `num_steps` vector env steps into the replay buffer, then
    `gradient_steps` gradient steps on sampled batches (each: twin critics, actor, temperature, Polyak targets)."""

    buffer_size: int = Field(100_000, gt=0, description="Transitions the replay buffer holds per shard (on "
                             "device, flashbax).")
    batch_size: int = Field(256, gt=0, description="Transitions sampled per gradient step.")
    learning_starts: int = Field(1_000, ge=0, description="Env steps per shard taken with uniform random actions "
                                 "before the first update.")
    gradient_steps: int = Field(1, gt=0, description="Gradient steps per update.")
    tau: float = Field(0.005, gt=0, le=1, description="Polyak averaging weight of the target critics.")
    init_alpha: float = Field(1.0, gt=0, description="Initial entropy temperature (learned, towards a target "
                              "entropy of -action_dim).")
    log_std_min: float = Field(-5.0, description="Lower bound of the policy's log standard deviation.")
    log_std_max: float = Field(2.0, description="Upper bound of the policy's log standard deviation.")
    prioritized: bool = Field(False, description="Prioritized replay (Schaul et al. 2016) instead of uniform; "
                              "priority_alpha and priority_beta anneal linearly to their _end values over the run.")
    priority_alpha: float = Field(0.6, ge=0, le=1, description="Priority exponent at the start of the run "
                                  "(prioritized only).")
    priority_alpha_end: float | None = Field(None, ge=0, le=1, description="Priority exponent at the end of the "
                                             "run; null: priority_alpha throughout.")
    priority_beta: float = Field(0.4, ge=0, le=1, description="Importance-weight exponent at the start of the run "
                                 "(prioritized only).")
    priority_beta_end: float = Field(1.0, ge=0, le=1, description="Importance-weight exponent at the end of the "
                                     "run.")
    priority_eps: float = Field(1e-6, gt=0, description="Added to every priority, so that no transition has "
                                "probability 0.")

    @model_validator(mode="after")
    def _sizes(self) -> "SacConfig":
        if self.log_std_min >= self.log_std_max:
            raise ValueError("sac.log_std_min must be below sac.log_std_max")
        return self


class ImpalaConfig(StrictModel):
    """IMPALA-style actor/learner in one program (`algorithm: impala`): the vmapped actors act with the
    parameters the learner had `lag` updates before; the learner corrects with V-trace (Espeholt et al. 2018)."""

    lag: int = Field(1, ge=0, description="Policy lag of the actors, in learner updates; 0: on-policy.")
    rho_bar: float = Field(1.0, gt=0, description="V-trace's truncation of the importance weights in the value "
                           "targets.")
    c_bar: float = Field(1.0, gt=0, description="V-trace's truncation of the trace coefficients.")
    pg_rho_bar: float | None = Field(None, gt=0, description="Truncation of the importance weights in the policy "
                                     "gradient; null: rho_bar.")
    trace_lambda: float = Field(1.0, ge=0, le=1, description="lambda of V-trace's traces (1.0: the paper's "
                                "V-trace).")
    minibatches: int = Field(1, gt=0, description="Learner steps per batch of trajectories (split over envs).")


# Fields only PPO reads: set (to other than their defaults) with another algorithm they would be silently
# ignored, so they are refused.
PPO_ONLY = frozenset({"epochs", "minibatches", "gae_lambda", "clip_eps", "normalize_advantages", "grad_chunk_rows",
                      "normalize_observations", "obs_clip", "scale_rewards", "reward_clip"})
ACTOR_CRITIC_ONLY = frozenset({"ent_coef", "vf_coef", "max_grad_norm"})  # PPO and IMPALA (SAC: plain Adam)


class JaxConfig(StrictModel):

    algorithm: Literal["ppo", "sac", "impala"] = Field(
        "ppo", description="`ppo` (PPO with GAE), `sac` (soft actor-critic with a replay buffer, Box actions only; "
        "jax.sac) or `impala` (lagged actors corrected with V-trace; jax.impala).")
    env: str = Field("CartPole-v1", description="The environment: a gymnax id (CartPole-v1, Acrobot-v1, "
                     "Pendulum-v1, Breakout-MinAtar, ...), `brax/<name>` (brax/hopper, brax/inverted_pendulum, ...) or "
                     "`package.module:factory` where factory() returns a trainer.jax.envs.Environment.")
    env_kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the environment's "
                                       "constructor (brax: backend, episode_length).")
    num_envs: int = Field(4, gt=0, description="Parallel environments, in total over all shards.")
    num_steps: int = Field(128, gt=0, description="Vector env steps per update (PPO and IMPALA: the rollout "
                           "length).")
    updates_per_iteration: int = Field(10, gt=0, description="Updates per tide iteration (one jitted chunk).")
    epochs: int = Field(4, gt=0, description="PPO: passes over each rollout's batch.")
    minibatches: int = Field(4, gt=0, description="PPO: minibatches per epoch, per shard.")
    gamma: float = Field(0.99, gt=0, le=1, description="Discount factor.")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="PPO: lambda of generalised advantage estimation.")
    clip_eps: float = Field(0.2, gt=0, description="PPO: clip range of the probability ratio and of the value "
                            "loss.")
    ent_coef: float = Field(0.01, ge=0, description="PPO and IMPALA: weight of the entropy bonus.")
    vf_coef: float = Field(0.5, ge=0, description="PPO and IMPALA: weight of the value loss.")
    max_grad_norm: float = Field(0.5, gt=0, description="PPO and IMPALA: gradients are clipped to this global "
                                 "norm.")
    lr: float = Field(2.5e-4, gt=0, description="Adam's learning rate (SAC: of actor, critics and temperature).")
    anneal_lr: bool | None = Field(None, description="Decay the learning rate linearly to 0 over the run's "
                                   "updates; null: yes for PPO and IMPALA, no for SAC.")
    normalize_advantages: bool = Field(True, description="PPO: normalise advantages to mean 0, std 1 in each "
                                       "minibatch (over all shards).")
    # Off by default, as in PPO's paper; locomotion tasks want both (configs/brax_hopper.yaml).
    normalize_observations: bool = Field(
        False, description="PPO: normalise observations by their running mean and variance (Engstrom et al. "
        "2020), clipped to obs_clip; the statistics are checkpointed.")
    obs_clip: float = Field(10.0, gt=0, description="PPO: normalised observations are clipped to [-obs_clip, "
                            "obs_clip].")
    scale_rewards: bool = Field(False, description="PPO: divide rewards by the running std of a discounted reward "
                                "sum (Engstrom et al. 2020), clipped to reward_clip.")
    reward_clip: float = Field(10.0, gt=0, description="PPO: scaled rewards are clipped to [-reward_clip, "
                               "reward_clip].")
    hidden_sizes: list[int] = Field(default_factory=lambda: [64, 64], description="Widths of the hidden layers of "
                                    "the policy and value (or critic) networks.")
    activation: Literal["tanh", "relu"] = Field("tanh", description="Activation of the hidden layers.")
    seeds: int = Field(1, gt=0, description="Independent agents trained in one program (vmapped, spread over "
                       "devices).")
    shards: int = Field(1, gt=0, description="Data-parallel shards: each owns num_envs / shards envs and its own "
                        "RNG stream; gradients are averaged over shards. Results depend on shards, not on how many "
                        "devices hold them.")
    # seeds first: they never communicate
    devices: int | None = Field(None, gt=0, description="Devices to spread seeds, then shards over; null: as many "
                                "as the seeds and shards split over evenly.")
    # One XLA:CPU program mostly keeps to one core at these model sizes.
    cpu_devices: int | None = Field(None, gt=0, description="On a CPU host, the XLA CPU devices created before JAX "
                                    "starts; null: one per core.")
    target_return: float = Field(475.0, description="Mean return reported as `solved` in metrics; training does "
                                 "not stop early.")
    # 2048-row chunks measured best here
    grad_chunk_rows: int | None = Field(
        None, ge=0, description="PPO: minibatches are differentiated in chunks of this many rows (the same mean "
        "gradient, smaller activations); null: 2048-row chunks when the minibatch is larger; 0: never.")
    scan_unroll: int = Field(1, gt=0, description="Unroll factor of the lax.scan over the rollout's steps.")
    # On 2 cores Eigen splits [256, 128] x [128, 128] over both cores (~1.5x YNNPACK, which keeps it on one) but
    # is slower at small products and at 256-wide layers (docs/design.md has the measured table).
    cpu_matmul: Literal["ynnpack", "eigen"] = Field(
        "ynnpack", description="On CPU, the library XLA runs matrix products with: `ynnpack` (XLA's default) or "
        "`eigen` (faster for some shapes and core counts: docs/design.md); ignored on GPU and TPU.")
    # Not a config-relative path: the default, like any relative value, is a cache under the working directory.
    compilation_cache_dir: str | None = Field(
        ".cache/jax", description="JAX's persistent compilation cache (a relative path is under the working "
        "directory); null: no cache.")
    sac: SacConfig | None = Field(None, description="SAC's settings (algorithm sac only); null: the defaults.")
    impala: ImpalaConfig | None = Field(None, description="IMPALA's settings (algorithm impala only); null: the "
                                        "defaults.")

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
