"""The `models:` section: second models served beside the policy for a run, by name, for `rewards:` entries to
score with (`{model: <name>}`). Served by orchestrator/rewards/served.py."""
from __future__ import annotations

from typing import Literal

from pathlib import Path

from pydantic import Field, ValidationInfo, field_validator, model_validator

from ckpt_transfer.config import ConfigPath, StrictModel, missing_path

Normalize = Literal["none", "group", "batch"]


class ServedModelConfig(StrictModel):
    """One served model."""

    kind: Literal["reward_model"] = Field(
        "reward_model", description="reward_model: a sequence-classification reward model "
        "(transformers' AutoModelForSequenceClassification, one label), scoring each (prompt, completion) with its "
        "head's logit at the conversation's last token, the conversation rendered with its own chat template.")
    path: ConfigPath = Field(description="Its Hugging Face directory (relative to the config file's directory).")
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where each replica runs: cpu, or one GPU each.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights' dtype.")
    replicas: int = Field(1, ge=1, description="Processes serving it; a batch is split evenly between them.")
    num_cpus: float = Field(0.0, ge=0, description="Ray CPUs each replica reserves (0: it shares the run's cores, "
                            "as on this 2-core default).")
    threads: int | None = Field(None, ge=1, description="torch threads of each replica on CPU (null: torch's "
                                "default).")
    batch_size: int = Field(32, ge=1, description="Conversations per forward pass.")
    timeout_s: float = Field(120.0, gt=0, description="Seconds a replica may take on its part of a batch (and to "
                             "start) before the run stops, naming the model.")
    max_replacements: int = Field(3, ge=0, description="Replicas replaced when they die during the run (the part "
                                  "they held is scored again by the new one); one more death stops the run.")

    @field_validator("path")
    @classmethod
    def _a_model_directory(cls, path: str, info: ValidationInfo) -> str:
        if not (Path(path) / "config.json").is_file():
            what = (missing_path("directory", path, info) if not Path(path).exists()
                    else f"{path!r} holds no config.json")
            raise ValueError(f"{what}: a Hugging Face model directory is needed (scripts/train_reward_model.py "
                             f"writes the one configs/reward_model.yaml serves)")
        return path

    @model_validator(mode="after")
    def _cpu_dtype(self) -> "ServedModelConfig":
        if self.device == "cpu" and self.dtype == "float16":
            raise ValueError("dtype float16 on device cpu: use float32 or bfloat16")
        return self
