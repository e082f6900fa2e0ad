"""The rollout room's settings, validated where they are consumed: the vLLM engine's settings
(`EngineConfig`), the YAML `rollout:` section that extends them with what one rollout phase does
(`RolloutConfig`), and the YAML `task:` section (`TaskConfig`). Pydantic only: no vLLM import."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class EngineConfig(_Strict):
    """One vLLM engine. The run-wide settings it also needs (parameter dtype, seed, determinism) are given
    to `RolloutEngine` beside it."""

    tp: int = Field(1, ge=1)
    kv_cache_gb: float = Field(0.25, gt=0)
    max_engine_restarts: int = Field(3, ge=0)  # per generate/score call, when the engine process dies
    engine_start_timeout_s: float = Field(600, gt=0)
    max_model_len: int | None = Field(None, gt=0)  # None: the model's max_position_embeddings
    enforce_eager: bool = True  # torch.compile costs 30-150 s of start-up on CPU for ~10%
    max_num_seqs: int | None = Field(None, gt=0)
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
    sync_mode: Literal["restart", "reload"] = "reload"
    max_logprob_gap: float = Field(1e-4, gt=0)
    probe_prompts: int = Field(8, gt=0)


class TaskConfig(_Strict):
    """The YAML `task:` section: where prompts come from and how completions are scored."""

    name: Literal["addition", "reverse", "jsonl", "code"] = "addition"
    path: str | None = None  # for `jsonl`: lines of {"prompt": ..., "answer": ...}
    max_digits: int = Field(2, gt=0)  # addition operand size
    length: int = Field(3, gt=0)  # reverse: string length

    @model_validator(mode="after")
    def _jsonl_needs_path(self) -> "TaskConfig":
        if self.name == "jsonl" and not self.path:
            raise ValueError("task.path is required when task.name is 'jsonl'")
        return self
