"""The trainer's settings: the YAML `trainer:` section (validated here, where it is consumed) and the
`TrainerSpec` a Megatron rank is built from. Importing this module imports neither Megatron nor vLLM, so
the orchestrator's schema can compose it and Ray can ship it to the ranks."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ckpt_transfer.config import StrictModel
from trainer.loss_spec import LossSpec
from trainer.lr_schedule import LRSchedule


class ParallelConfig(StrictModel):
    """The trainer ranks: dp data-parallel replicas of a tp x pp (x ep for experts) model-parallel layout.
    Megatron's groups follow from the world size: dense layers are replicated dp * ep times, experts dp times."""

    dp: int = Field(1, ge=1, description="Data-parallel replicas: each optimizer step's samples are split over "
                    "them and their gradients averaged.")
    tp: int = Field(1, ge=1, description="Tensor-parallel degree; it must divide the attention heads, key/value "
                    "heads, intermediate size and vocabulary.")
    pp: int = Field(1, ge=1, description="Pipeline-parallel stages; it must divide the number of layers.")
    ep: int = Field(1, ge=1, description="Expert-parallel degree of a mixture-of-experts model; it must divide "
                    "the number of experts.")

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.ep


class KLConfig(StrictModel):
    """The YAML `trainer.kl:` section: coef x a KL penalty in the loss, the reference being the policy RL starts
    from (after the supervised warm start), frozen; which divergence its gradient follows depends on the estimator
    (the default k3: KL(reference || policy)). coef 0: no reference model at all."""

    coef: float = Field(0.0, ge=0, description="Weight of the KL penalty against the frozen policy RL starts from "
                        "(0: no reference model is built). The divergence it optimises is the one its estimator's "
                        "gradient follows: with the default k3, KL(reference || policy) (its value estimates KL(policy "
                        "|| reference)); with k2, KL(policy || reference). Each token's term is weighed by policy / "
                        "behaviour policy (detached; the mismatch correction's part truncated as configured), so that "
                        "stale samples and later mini-batches follow that divergence too; under top_p / top_k the "
                        "tokens outside the sampled set are never seen (docs/training.md).")
    estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="Schulman's KL estimator, with r the log-ratio reference / policy per token: k2 = r^2 / "
        "2 (its gradient is that of KL(policy || reference)) or k3 = exp(r) - 1 - r (unbiased and never negative; "
        "its gradient is that of KL(reference || policy)); k1 = -r is refused: as a loss its expected gradient "
        "is 0. Both sides are the tempered softmax over the whole vocabulary, also under top_p / top_k.")

    @model_validator(mode="after")
    def _k1_does_not_regularise(self) -> "KLConfig":
        if self.coef > 0 and self.estimator == "k1":
            raise ValueError(
                "trainer.kl.estimator: k1 as a loss does not regularise (on tokens sampled from the policy its "
                "expected gradient is E[grad log pi] = 0); use k3 (unbiased; its gradient is that of "
                "KL(reference || policy)) or k2 (its gradient is that of KL(policy || reference))")
        return self


class MoEConfig(StrictModel):
    """The YAML `trainer.moe:` section (mixture-of-experts models)."""

    routing_replay: Literal["none", "rollout"] = Field(
        "none", description="`rollout`: the trainer's forward passes (loss, old-policy and reference log-probs) "
        "route every token to the experts the rollout engine routed it to (R3, Ma et al. 2025), so that the "
        "trainer's log-probs are those of the policy that sampled; `none`: the trainer's router decides. Needs a "
        "mixture-of-experts model and rollout.record_routing.")


class LoRAConfig(StrictModel):
    """The YAML `trainer.lora:` section: low-rank adapters (Hu et al. 2021) trained in place of the weights,
    parameterised as PEFT's LoraConfig (one A and B per targeted projection, scaled by alpha / rank)."""

    rank: int = Field(16, ge=1, description="r: the adapters' rank (PEFT's `r`).")
    alpha: float = Field(32.0, gt=0, description="lora_alpha: each adapter's output is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="lora_dropout on each adapter's input while training "
                           "(not with trainer.parallel.tp > 1). It makes the loss's log-probs noisier than the "
                           "sampler's; RL recipes use 0.")
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], min_length=1,
        description="The Hugging Face projections given adapters, as PEFT names them (the last part of the module's "
        "name), in every decoder layer.")
    sync: Literal["adapter", "merged"] = Field(
        "adapter", description="What each weight sync publishes: `adapter`, the adapter alone (megabytes), which the "
        "engines serve on the base they loaded once through vLLM's LoRA support (rollout.sync_mode is then unused); "
        "`merged`, the base with scaling x B A added to each adapted weight, which the engines reload or restart on "
        "as without LoRA (no cost per generated token; vLLM's unmerged LoRA kernels cost some).")

    @property
    def syncs_adapter(self) -> bool:
        return self.sync == "adapter"

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class TrainerConfig(StrictModel):
    """The YAML `trainer:` section."""

    device: Literal["cpu", "cuda"] = Field("cpu", description="Where the trainer ranks run: `cpu` (backend "
                                           "gloo) or `cuda` (one GPU per rank).")
    backend: Literal["gloo", "nccl"] = Field("gloo", description="torch.distributed backend: `gloo` (required on "
                                             "cpu) or `nccl` (GPUs).")
    parallel: ParallelConfig = Field(ParallelConfig(), description="The trainer's layout: dp x tp x pp x ep ranks "
                                     "(data, tensor, pipeline and expert parallel).")
    loss: Literal["kimi", "kimi_token", "grpo"] = Field(
        "grpo", description="RL objective: `grpo` (clipped surrogate with group-relative advantages, no critic; "
        "see loss_agg, adv_std_norm, clip_eps), `kimi` (Kimi k1.5: sequence-level squared log-ratio, kimi_tau) or "
        "`kimi_token` (its per-token variant).")
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = Field(
        "token_mean", description="How grpo averages token losses: `token_mean` (DAPO: every token weighs the "
        "same), `seq_mean_token_mean` (the GRPO paper: mean over each completion's tokens, then over completions) "
        "or `seq_mean_token_sum` (Dr. GRPO: token sums averaged over completions). grpo only.")
    adv_std_norm: bool | None = Field(
        None, description="Divide advantages by the group's reward standard deviation; null: true for grpo, false "
        "for kimi. grpo with false is Dr. GRPO.")
    adv_std: Literal["population", "unbiased"] = Field(
        "population", description="The group's reward standard deviation adv_std_norm divides by: `population` "
        "(divides by n) or `unbiased` (by n - 1: TRL's and veRL's; at n_samples 8 it is sqrt(8/7) ~ 7% larger, "
        "the advantages as much smaller beside a fixed KL or entropy coefficient).")
    adv_std_eps: float = Field(1e-6, gt=0, description="Added to that standard deviation before dividing (TRL: "
                               "1e-4, veRL: 1e-6).")
    # TRL's GRPOConfig and veRL's actor default to 1e-6 for full fine-tuning of a real model
    lr: float = Field(1e-6, gt=0, description="Peak learning rate of RL (Adam); the tiny models of the example "
                      "configs use 1e-3.")
    lr_schedule: LRSchedule = Field(LRSchedule(), description="Per-iteration learning-rate warm-up and decay.")
    kl: KLConfig = Field(KLConfig(), description="KL penalty against the frozen policy RL starts from (off by "
                         "default). With the default estimator k3 it optimises KL(reference || policy): its gradient "
                         "is the forward divergence's, though its value estimates KL(policy || reference).")
    moe: MoEConfig = Field(MoEConfig(), description="Mixture-of-experts settings: routing replay.")
    lora: LoRAConfig | None = Field(None, description="Train low-rank adapters (LoRA) instead of the weights; the "
                                    "base stays frozen and is the reference policy of trainer.kl. null: full "
                                    "fine-tuning.")
    weight_decay: float = Field(0.0, ge=0, description="Weight decay of the optimizer; 0: none.")
    grad_clip: float = Field(1.0, gt=0, description="Gradients are clipped to this global L2 norm before each "
                             "optimizer step.")
    kimi_tau: float = Field(0.1, ge=0, description="tau of Kimi k1.5's loss: the weight of the squared log-ratio "
                            "to the sampling policy (kimi and kimi_token only).")
    clip_eps: float | None = Field(
        None, gt=0, description="grpo's clip range on both sides: the ratio is clipped to [1 - clip_eps, 1 + "
        "clip_eps]; null: clip_eps_low / clip_eps_high, else 0.2. Not together with those.")
    clip_eps_low: float | None = Field(None, gt=0, description="grpo: the ratio's lower clip range (ratio >= 1 - "
                                       "clip_eps_low); null: clip_eps, else 0.2.")
    clip_eps_high: float | None = Field(
        None, gt=0, description="grpo: the ratio's upper clip range (ratio <= 1 + clip_eps_high); null: the lower "
        "range. Above clip_eps_low it is DAPO's clip-higher.")
    length_penalty: float = Field(0.0, ge=0, description="Weight of Kimi k1.5's length reward added to the "
                                  "task's own reward; 0: off. With `rewards:` add {fn: length} there instead.")
    micro_batch_size: int = Field(64, gt=0, description="Sequences per forward/backward pass on each "
                                  "data-parallel rank (gradients accumulate over an optimizer step's micro-batches); "
                                  "lower it to save memory.")
    # veRL's use_dynamic_bsz with ppo_max_token_len_per_gpu; slime's max_tokens_per_gpu
    micro_batch_tokens: int | None = Field(
        None, gt=0, description="Cut each mini-batch into micro-batches of at most this many positions (rows x "
        "the longest row) instead of micro_batch_size rows: its sequences sorted by length, each micro-batch padded "
        "to its own longest only, so that a few long completions do not pad every short one to their length; a "
        "sequence longer than the budget gets a micro-batch of its own. null: micro_batch_size rows padded to the "
        "batch's longest. With a pipeline (trainer.parallel.pp > 1) the stages send each activation's shape first.")
    # veRL's use_remove_padding, slime's and NeMo-RL's sequence packing (THD)
    packing: bool = Field(
        False, description="Pack each micro-batch into one row of sequences back to back (positions restarting at "
        "each, attention confined to its own sequence), cut by trainer.micro_batch_tokens, padded only to a "
        "tensor-parallel multiple; false: rows padded to a common length. Needs trainer.micro_batch_tokens and "
        "trainer.attention sdpa.")
    # transformers' attn_implementation names
    attention: Literal["sdpa", "eager"] = Field(
        "sdpa", description="The trainer's core attention: `sdpa` (torch's scaled_dot_product_attention: flash / "
        "memory-efficient kernels, activations linear in the length) or `eager` (Megatron's local attention, "
        "which keeps [heads, L, L] scores and probabilities for the backward pass; for comparison).")
    recompute: Literal["none", "selective", "full"] = Field(
        "none", description="Megatron's activation recompute: `selective` recomputes the core attention in the "
        "backward pass, `full` each transformer layer (keeps only its input); `none` keeps every activation.")
    logprob_chunk: int | None = Field(
        4096, gt=0, description="Positions per chunk of the output layer and the log-prob and entropy computation: "
        "the model returns its final hidden states and each chunk's logits are computed, used and (in the backward "
        "pass) recomputed on their own, so that the [positions, vocabulary / tp] float32 tensors exist for one chunk "
        "at a time (values and gradients unchanged; one more output-layer matmul per chunk in the backward pass); "
        "null: the whole micro-batch's logits at once.")
    distributed_optimizer: bool | None = Field(
        None, description="Megatron's distributed optimizer: optimizer state (and the fp32 main parameters) "
        "sharded over the data-parallel ranks (gradients reduce-scattered, parameters all-gathered; works on gloo "
        "too). null: on with backend nccl, off with gloo. A checkpoint resumes with the same setting and, with it "
        "on, the same tp, pp and ep.")
    updates_per_iteration: int = Field(1, ge=1, description="Optimizer steps per pass over an iteration's "
                                       "samples: the samples are cut into this many mini-batches.")
    epochs: int = Field(1, ge=1, description="Passes over each iteration's samples: epochs x "
                        "updates_per_iteration optimizer steps, reshuffled every pass; pi_old stays the policy that "
                        "sampled them.")
    entropy_coef: float = Field(0.0, ge=0, description="Weight of an entropy bonus: the loss subtracts "
                                "entropy_coef x the mean entropy of the sampling distribution over completion "
                                "tokens; 0: the entropy is only logged.")
    shuffle_minibatches: bool = Field(True, description="Shuffle the samples (seeded) before cutting "
                                      "mini-batches; false: consecutive prompts.")
    warmup_sft_steps: int = Field(0, ge=0, description="Supervised steps on the task's reference answers before "
                                  "RL starts, so that RL starts from a policy that sometimes succeeds; 0: none.")
    warmup_sft_batch: int = Field(64, gt=0, description="Examples per supervised warm-up step.")
    warmup_sft_lr: float = Field(1e-5, gt=0, description="Learning rate of the supervised warm-up.")
    warmup_sft_stop_loss: float | None = Field(
        None, gt=0, description="End the supervised warm-up early, once the mean loss of its last "
        "WARMUP_STOP_WINDOW (10) steps is at most this; warmup_sft_steps stays the most it takes. Where a skill "
        "appears abruptly, a loss level marks how far the warm-up got better than a step count, which the initial "
        "weights move; null: always warmup_sft_steps.")
    # veRL's param/optimizer offload of its hybrid engine, slime's colocate mode (trainer/megatron/offload.py)
    offload_between_phases: bool | None = Field(
        None, description="Between each publish and the trainer's next pass (reference or old log-probs, the train "
        "step, a probe or checkpoint), its ranks hold their parameters, optimizer state and gradients in host "
        "memory (pinned on cuda), so that the engines can use the same GPUs; taken back bit for bit (the offload "
        "and onload phases in timings.jsonl). null: on exactly when placement.mode is colocated and trainer.device "
        "cuda. Needs rollout.max_staleness 0 (nothing else runs while the trainer trains).")
    # false carries Adam moments fitted to another objective, at another learning rate, into RL
    warmup_sft_reset_optimizer: bool = Field(
        True, description="Start RL with a fresh optimizer after the warm-up, as after a separate SFT run; false "
        "keeps the warm-up's optimizer state.")

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
        if self.packing and self.micro_batch_tokens is None:
            raise ValueError("trainer.packing needs trainer.micro_batch_tokens: the positions of one packed row")
        if self.packing and self.attention != "sdpa":
            raise ValueError("trainer.packing needs trainer.attention 'sdpa' (Megatron's eager attention takes no "
                             "packed sequences)")
        if self.loss != "grpo" and grpo_only:
            raise ValueError(f"trainer.{grpo_only[0]} applies to loss 'grpo' only (kimi averages over "
                             f"completions as the paper does, kimi_token over tokens)")
        return self

    @property
    def uses_distributed_optimizer(self) -> bool:
        """trainer.distributed_optimizer resolved: null means on with nccl, off with gloo."""
        return self.backend == "nccl" if self.distributed_optimizer is None else self.distributed_optimizer

    def loss_spec(self) -> LossSpec:
        eps = 0.2 if self.clip_eps is None else self.clip_eps
        low = eps if self.clip_eps_low is None else self.clip_eps_low
        return LossSpec(kind=self.loss, kimi_tau=self.kimi_tau, clip_eps_low=low,
                        clip_eps_high=low if self.clip_eps_high is None else self.clip_eps_high,
                        agg=self.loss_agg,
                        adv_std_norm=self.loss == "grpo" if self.adv_std_norm is None else self.adv_std_norm,
                        adv_std_unbiased=self.adv_std == "unbiased", adv_std_eps=self.adv_std_eps,
                        kl_coef=self.kl.coef, kl_estimator=self.kl.estimator, entropy_coef=self.entropy_coef)


class TrainerSpec(StrictModel):
    """What a trainer rank is built from: the model directory, the `trainer:` section as validated, and the
    run-wide settings it shares with the rollout (seed, determinism, parameter dtype)."""

    hf_dir: str
    trainer: TrainerConfig = TrainerConfig()
    seed: int = 0
    deterministic: bool = True
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
