"""The trainer's settings: the YAML `trainer:` section (validated here, where it is consumed) and the
`TrainerSpec` a Megatron rank is built from. Importing this module imports neither Megatron nor vLLM, so
the orchestrator's schema can compose it and Ray can ship it to the ranks."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.losses import LossSpec
from trainer.lr_schedule import LRSchedule


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class ParallelConfig(_Strict):
    """The trainer ranks: dp data-parallel replicas of a tp x pp (x ep for experts) model-parallel layout.
    Megatron's groups follow from the world size: dense layers are replicated dp * ep times, experts dp times."""

    dp: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.ep


class KLConfig(_Strict):
    """The YAML `trainer.kl:` section: coef x KL(policy || reference) in the loss, the reference being the
    policy RL starts from (after the supervised warm start), frozen. coef 0: no reference model at all."""

    coef: float = Field(0.0, ge=0)
    estimator: Literal["k1", "k2", "k3"] = "k3"  # Schulman's estimators (trainer/losses.py)


class TrainerConfig(_Strict):
    """The YAML `trainer:` section."""

    device: Literal["cpu", "cuda"] = "cpu"
    backend: Literal["gloo", "nccl"] = "gloo"
    parallel: ParallelConfig = ParallelConfig()
    # kimi: Kimi k1.5's objective (sequence-level squared log-ratio); kimi_token: its per-token variant;
    # grpo: clipped surrogate with group-relative advantages (see trainer/losses.py for the papers)
    loss: Literal["kimi", "kimi_token", "grpo"] = "kimi"
    # grpo only: token_mean (DAPO), seq_mean_token_mean (GRPO paper), seq_mean_token_sum (Dr. GRPO)
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = "token_mean"
    adv_std_norm: bool | None = None  # divide advantages by the group's reward std; None: grpo yes, kimi no
    lr: float = Field(1e-3, gt=0)
    lr_schedule: LRSchedule = LRSchedule()
    kl: KLConfig = KLConfig()
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    kimi_tau: float = Field(0.1, ge=0)
    clip_eps: float | None = Field(None, gt=0)  # sets clip_eps_low and clip_eps_high (default 0.2 each)
    clip_eps_low: float | None = Field(None, gt=0)
    clip_eps_high: float | None = Field(None, gt=0)  # > clip_eps_low: DAPO's clip-higher
    length_penalty: float = Field(0.0, ge=0)  # weight of Kimi k1.5's length reward; 0 disables it
    micro_batch_size: int = Field(64, gt=0)
    updates_per_iteration: int = Field(1, ge=1)  # optimizer steps per iteration (mini-batches of the samples)
    shuffle_minibatches: bool = True  # seeded shuffle before cutting mini-batches (False: consecutive prompts)
    warmup_sft_steps: int = Field(0, ge=0)
    warmup_sft_batch: int = Field(64, gt=0)
    warmup_sft_lr: float = Field(3e-3, gt=0)
    # RL starts with a fresh optimizer, as it would after a separate SFT run; false carries the warm start's
    # Adam moments (fitted to another objective, at another learning rate) into RL
    warmup_sft_reset_optimizer: bool = True

    @model_validator(mode="before")
    @classmethod
    def _renamed_losses(cls, data):
        if isinstance(data, dict) and data.get("loss") == "ppo_clip":
            raise ValueError("trainer.loss 'ppo_clip' was a clipped surrogate with a group-mean baseline, not PPO "
                             "(there is no critic): use loss: grpo with adv_std_norm: false")
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "TrainerConfig":
        if self.device == "cpu" and self.backend != "gloo":
            raise ValueError("trainer.backend must be 'gloo' when trainer.device is 'cpu'")
        if self.clip_eps is not None and (self.clip_eps_low is not None or self.clip_eps_high is not None):
            raise ValueError("set trainer.clip_eps or trainer.clip_eps_low/clip_eps_high, not both")
        grpo_only = [k for k in ("clip_eps", "clip_eps_low", "clip_eps_high") if getattr(self, k) is not None]
        grpo_only += ["loss_agg"] if self.loss_agg != "token_mean" else []
        if self.loss != "grpo" and grpo_only:
            raise ValueError(f"trainer.{grpo_only[0]} applies to loss 'grpo' only (kimi averages over "
                             f"completions as the paper does, kimi_token over tokens)")
        return self

    def loss_spec(self) -> LossSpec:
        eps = 0.2 if self.clip_eps is None else self.clip_eps
        low = eps if self.clip_eps_low is None else self.clip_eps_low
        return LossSpec(kind=self.loss, kimi_tau=self.kimi_tau, clip_eps_low=low,
                        clip_eps_high=low if self.clip_eps_high is None else self.clip_eps_high,
                        agg=self.loss_agg,
                        adv_std_norm=self.loss == "grpo" if self.adv_std_norm is None else self.adv_std_norm,
                        kl_coef=self.kl.coef, kl_estimator=self.kl.estimator)


class TrainerSpec(_Strict):
    """What a trainer rank is built from: the model directory, the `trainer:` section as validated, and the
    run-wide settings it shares with the rollout (seed, determinism, parameter dtype)."""

    hf_dir: str
    trainer: TrainerConfig = TrainerConfig()
    seed: int = 0
    deterministic: bool = True
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
