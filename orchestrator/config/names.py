"""Other trainers' names for tide's config keys: TRL's `GRPOConfig` fields (checked against trl 1.16.0's
trl/trainer/grpo_config.py and the transformers `TrainingArguments` it extends) and veRL's keys (checked against
verl/trainer/config/_generated_ppo_trainer.yaml and _generated_ppo_megatron_trainer.yaml, volcengine/verl at
b178a3c). docs/config.md shows them as tables; an unknown key that is one of these names is answered with the
tide key (orchestrator.config.schema). Data only: no imports from tide."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class OtherName:
    source: Literal["TRL", "veRL"]
    name: str  # TRL: a GRPOConfig field; veRL: a dotted key of its trainer config
    tide: str  # the tide key (`rewards[].weight`: a key of each `rewards:` item)
    note: str = ""  # how values translate, where they do not carry over as they are
    in_hint: bool = False  # the tide key is not the same setting: the hint for the name carries the note

    @property
    def leaf(self) -> str:
        return self.name.rpartition(".")[2]

    def hint(self) -> str:
        """The tide key as an unknown key's `did you mean` names it."""
        return f"{self.tide} ({self.source}'s {self.name}" + (f": {self.note})" if self.in_hint else ")")


def _trl(name: str, tide: str, note: str = "", in_hint: bool = False) -> OtherName:
    return OtherName("TRL", name, tide, note, in_hint)


def _verl(name: str, tide: str, note: str = "") -> OtherName:
    return OtherName("veRL", name, tide, note)


_ACTOR = "actor_rollout_ref.actor"
_ROLLOUT = "actor_rollout_ref.rollout"

OTHER_NAMES: tuple[OtherName, ...] = (
    _trl("learning_rate", "trainer.lr", "TRL's GRPO default is 1e-6, as is tide's"),
    _trl("num_generations", "rollout.n_samples"),
    _trl("max_completion_length", "rollout.max_new_tokens"),
    _trl("num_iterations", "trainer.epochs"),
    _trl("beta", "trainer.kl.coef", "0 builds no reference model in both"),
    _trl("epsilon", "trainer.clip_eps_low", "without epsilon_high, trainer.clip_eps sets both sides"),
    _trl("epsilon_high", "trainer.clip_eps_high"),
    _trl("loss_type", "trainer.loss_agg", "with trainer.loss: grpo. dapo: token_mean; grpo: seq_mean_token_mean; "
         "dr_grpo: seq_mean_token_sum (TRL also divides by max_completion_length, a constant factor); bnpo: "
         "token_mean; cispo, sapo, luspo, vespo: no counterpart"),
    _trl("scale_rewards", "trainer.adv_std_norm", "group (or true): true; none (or false): false; batch: no "
         "counterpart"),
    _trl("temperature", "rollout.temperature"),
    _trl("top_p", "rollout.top_p"),
    _trl("top_k", "rollout.top_k", "0 keeps every token in both"),
    _trl("max_grad_norm", "trainer.grad_clip"),
    _trl("weight_decay", "trainer.weight_decay"),
    _trl("lr_scheduler_type", "trainer.lr_schedule.decay", "constant, linear or cosine; TRL's default is linear, "
         "tide's constant"),
    _trl("warmup_steps", "trainer.lr_schedule.warmup_iterations", "TRL counts optimizer steps (or a ratio "
         "of them), tide iterations"),
    _trl("per_device_train_batch_size", "trainer.micro_batch_size", "sequences per forward/backward pass on each "
         "rank; an optimizer step takes rollout.prompts_per_iteration x n_samples / trainer.updates_per_iteration "
         "samples whatever it is"),
    _trl("gradient_accumulation_steps", "trainer.updates_per_iteration", "no key of its own: an optimizer step "
         "takes rollout.prompts_per_iteration x n_samples / trainer.updates_per_iteration samples and accumulates "
         "gradients over all of them, trainer.micro_batch_size per forward/backward pass on each rank; TRL's "
         "per_device_train_batch_size x gradient_accumulation_steps x processes is that sample count",
         in_hint=True),
    _trl("steps_per_generation", "trainer.updates_per_iteration", "optimizer steps per generation batch: TRL's "
         "steps_per_generation / gradient_accumulation_steps"),
    _trl("generation_batch_size", "rollout.prompts_per_iteration", "TRL counts completions: prompts_per_iteration "
         "x n_samples"),
    _trl("entropy_coef", "trainer.entropy_coef"),
    _trl("reward_weights", "rewards[].weight"),
    _trl("vllm_gpu_memory_utilization", "rollout.gpu_memory_utilization"),
    _trl("vllm_tensor_parallel_size", "rollout.tp"),
    _trl("vllm_max_model_length", "rollout.max_model_len"),
    _trl("vllm_importance_sampling_correction", "rollout.mismatch_correction", "tis is TRL's token_truncate mode"),
    _trl("vllm_importance_sampling_clip_max", "rollout.tis_cap"),
    _trl("num_generations_eval", "eval.n_samples"),
    _trl("eval_steps", "eval.every", "TRL counts optimizer steps, tide iterations"),
    _trl("log_completions", "logging.samples", "the number of completions logged per iteration; 0: none"),
    _trl("max_steps", "iterations", "TRL counts optimizer steps, tide iterations (one generation batch each)"),
    _trl("save_steps", "save_every", "in iterations"),
    _trl("save_total_limit", "keep_checkpoints"),
    _trl("output_dir", "run_dir"),
    _trl("seed", "seed"),
    _trl("bf16", "model.dtype", "bf16: true is model.dtype: bfloat16"),
    _trl("report_to", "logging.wandb", "TensorBoard is always written; logging.wandb adds W&B"),
    _verl(f"{_ACTOR}.optim.lr", "trainer.lr"),
    _verl("data.train_batch_size", "rollout.prompts_per_iteration"),
    _verl(f"{_ROLLOUT}.n", "rollout.n_samples"),
    _verl("data.max_response_length", "rollout.max_new_tokens"),
    _verl("data.max_prompt_length", "rollout.max_prompt_tokens", "longer prompts are skipped or truncated "
          "(rollout.overlong_prompts)"),
    _verl("data.truncation", "rollout.overlong_prompts", "left: truncate (tide keeps a prompt's last tokens); "
          "error, right, middle: no counterpart"),
    _verl("data.filter_overlong_prompts", "rollout.overlong_prompts", "true: skip"),
    _verl(f"{_ACTOR}.ppo_epochs", "trainer.epochs"),
    _verl(f"{_ACTOR}.ppo_mini_batch_size", "trainer.updates_per_iteration", "data.train_batch_size / "
          "ppo_mini_batch_size (both count prompts)"),
    _verl(f"{_ACTOR}.ppo_micro_batch_size_per_gpu", "trainer.micro_batch_size"),
    _verl(f"{_ACTOR}.use_kl_loss", "trainer.kl.coef", "false is coef 0"),
    _verl(f"{_ACTOR}.kl_loss_coef", "trainer.kl.coef"),
    _verl(f"{_ACTOR}.kl_loss_type", "trainer.kl.estimator",
          "kl: k1 (refused as a loss: its expected gradient is 0); mse: k2; low_var_kl: k3"),
    _verl(f"{_ACTOR}.clip_ratio", "trainer.clip_eps"),
    _verl(f"{_ACTOR}.clip_ratio_low", "trainer.clip_eps_low"),
    _verl(f"{_ACTOR}.clip_ratio_high", "trainer.clip_eps_high"),
    _verl(f"{_ACTOR}.loss_agg_mode", "trainer.loss_agg", "token-mean: token_mean; seq-mean-token-mean: "
          "seq_mean_token_mean; seq-mean-token-sum: seq_mean_token_sum; seq-mean-token-sum-norm: seq_mean_token_sum "
          "(up to a constant factor)"),
    _verl(f"{_ACTOR}.entropy_coeff", "trainer.entropy_coef"),
    _verl(f"{_ACTOR}.grad_clip", "trainer.grad_clip"),
    _verl(f"{_ACTOR}.optim.clip_grad", "trainer.grad_clip"),
    _verl(f"{_ACTOR}.optim.weight_decay", "trainer.weight_decay"),
    _verl(f"{_ACTOR}.optim.lr_warmup_steps", "trainer.lr_schedule.warmup_iterations", "veRL's -1 defers to "
          "lr_warmup_steps_ratio (default 0.0)"),
    _verl(f"{_ACTOR}.optim.lr_decay_style", "trainer.lr_schedule.decay", "constant, linear or cosine (Megatron "
          "actor)"),
    _verl(f"{_ACTOR}.optim.lr_scheduler_type", "trainer.lr_schedule.decay", "constant or cosine (FSDP actor)"),
    _verl(f"{_ACTOR}.shuffle", "trainer.shuffle_minibatches"),
    _verl(f"{_ACTOR}.megatron.tensor_model_parallel_size", "trainer.parallel.tp"),
    _verl(f"{_ACTOR}.megatron.pipeline_model_parallel_size", "trainer.parallel.pp"),
    _verl(f"{_ACTOR}.megatron.expert_model_parallel_size", "trainer.parallel.ep"),
    _verl(f"{_ROLLOUT}.temperature", "rollout.temperature"),
    _verl(f"{_ROLLOUT}.top_p", "rollout.top_p"),
    _verl(f"{_ROLLOUT}.top_k", "rollout.top_k", "veRL's -1 (every token) is 0"),
    _verl(f"{_ROLLOUT}.gpu_memory_utilization", "rollout.gpu_memory_utilization"),
    _verl(f"{_ROLLOUT}.tensor_model_parallel_size", "rollout.tp"),
    _verl(f"{_ROLLOUT}.max_model_len", "rollout.max_model_len"),
    _verl(f"{_ROLLOUT}.max_num_seqs", "rollout.max_num_seqs"),
    _verl(f"{_ROLLOUT}.max_num_batched_tokens", "rollout.max_num_batched_tokens"),
    _verl(f"{_ROLLOUT}.enforce_eager", "rollout.enforce_eager"),
    _verl(f"{_ROLLOUT}.dtype", "model.dtype"),
    _verl(f"{_ROLLOUT}.val_kwargs.n", "eval.n_samples"),
    _verl(f"{_ROLLOUT}.val_kwargs.temperature", "eval.temperature", "tide's eval always adds greedy pass@1"),
    _verl("actor_rollout_ref.model.path", "model.path"),
    _verl("actor_rollout_ref.model.custom_chat_template", "model.chat_template", "tide takes a .jinja file"),
    _verl("algorithm.adv_estimator", "trainer.loss", "grpo: grpo; gae (with a critic): no counterpart"),
    _verl("algorithm.norm_adv_by_std_in_grpo", "trainer.adv_std_norm"),
    _verl("algorithm.rollout_correction.rollout_is", "rollout.mismatch_correction", "token: tis; sequence with "
          "rollout_rs sequence: mis"),
    _verl("algorithm.rollout_correction.rollout_is_threshold", "rollout.tis_cap", "with rollout_is token"),
    _verl("algorithm.rollout_correction.rollout_rs", "rollout.mismatch_correction", "sequence (with rollout_is "
          "sequence): mis; token, weighted by the ratio: icepop"),
    _verl("algorithm.rollout_correction.rollout_rs_threshold", "rollout.mis_threshold", "mis; icepop's upper bound "
          "is rollout.icepop_bounds[1]"),
    _verl("algorithm.rollout_correction.rollout_rs_threshold_lower", "rollout.icepop_bounds", "its lower bound"),
    _verl("data.train_files", "task.path", "with task.name: dataset"),
    _verl("data.val_files", "task.eval_path"),
    _verl("data.prompt_key", "task.prompt_field"),
    _verl("custom_reward_function.path", "rewards[].fn", "with .name: fn: \"path/to/file.py:name\"; a "
          "compute_score(data_source, solution_str, ground_truth, extra_info) is called veRL's way"),
    _verl("custom_reward_function.name", "rewards[].fn", "the part after the colon"),
    _verl("trainer.total_training_steps", "iterations"),
    _verl("trainer.save_freq", "save_every"),
    _verl("trainer.test_freq", "eval.every"),
    _verl("trainer.max_actor_ckpt_to_keep", "keep_checkpoints"),
    _verl("trainer.default_local_dir", "run_dir"),
    _verl("trainer.experiment_name", "name"),
    _verl("trainer.project_name", "logging.wandb.project"),
)
