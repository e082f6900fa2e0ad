"""The `models:` section: second models served beside the policy for a run, by name, for `rewards:` entries to
score with (`{model: <name>}`): reward models (sequence classification) and generative judges (a vLLM engine of
their own, a prompt template and a verdict parser: rollout/judge.py). Served by
orchestrator/workers/served_models.py."""
from __future__ import annotations

from typing import Literal

from pathlib import Path

from pydantic import Field, ValidationInfo, field_validator, model_validator

from ckpt_transfer.config import ConfigPath, StrictModel, missing_path
from rollout.judge import Verdict, check_template

Normalize = Literal["none", "group", "batch"]
JUDGE_FIELDS = ("template", "rubric", "verdict", "verdict_key", "letters", "scale", "unreadable_reward",
                "max_new_tokens", "kv_cache_gb")


class ServedModelConfig(StrictModel):
    """One served model."""

    kind: Literal["reward_model", "judge"] = Field(
        "reward_model", description="reward_model: a sequence-classification reward model "
        "(transformers' AutoModelForSequenceClassification, one label), scoring each (prompt, completion) with its "
        "head's logit at the conversation's last token, the conversation rendered with its own chat template. "
        "judge: a causal LM served by vLLM reading `template` (through its chat template) and answering with a "
        "verdict read by `verdict`.")
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
    # judges
    template: str | None = Field(None, description="judge: the prompt, with {question} (a plain prompt, or a chat "
                                 "prompt's last user message), {answer} (the completion), {reference} (the "
                                 "problem's answer) and {rubric} (the rubric's items, one '- ' line each).")
    rubric: list[str] = Field([], description="judge: the criteria {rubric} lists.")
    verdict: Verdict = Field("number", description="judge: how its reply is read: number (the last number it "
                             "writes, mapped from `scale` onto [0, 1] when given), letter (the last of `letters` "
                             "it writes as a word of its own), json (`verdict_key` of the last JSON object).")
    verdict_key: str = Field("score", description="judge, verdict json: the key holding the value.")
    letters: dict[str, float] = Field({}, description="judge, verdict letter: each letter's value, e.g. "
                                      "{A: 1.0, B: 0.0}.")
    scale: tuple[float, float] | None = Field(None, description="judge, verdict number: [lo, hi] mapped onto "
                                              "[0, 1]; a number outside it is unreadable.")
    unreadable_reward: float | None = Field(None, description="judge: the reward of a reply with no readable "
                                            "verdict (counted in served/<name>/unreadable either way); null: no "
                                            "reward, the sample left out of training as a reward function's None.")
    max_new_tokens: int = Field(16, ge=1, description="judge: most tokens of a reply (greedy).")
    kv_cache_gb: float = Field(0.25, gt=0, description="judge: its vLLM engine's KV cache, GiB.")

    @field_validator("path")
    @classmethod
    def _a_model_directory(cls, path: str, info: ValidationInfo) -> str:
        if not (Path(path) / "config.json").is_file():
            what = (missing_path("directory", path, info) if not Path(path).exists()
                    else f"{path!r} holds no config.json")
            raise ValueError(f"{what}: a Hugging Face model directory is needed (scripts/train_reward_model.py and "
                             f"scripts/train_judge.py write the ones configs/reward_model.yaml and configs/judge.yaml "
                             f"serve)")
        return path

    @model_validator(mode="after")
    def _cpu_dtype(self) -> "ServedModelConfig":
        if self.device == "cpu" and self.dtype == "float16":
            raise ValueError("dtype float16 on device cpu: use float32 or bfloat16")
        # a judge's settings given to another kind (differing from their defaults: a dumped config holds them all)
        judging = [f for f in JUDGE_FIELDS if getattr(self, f) != type(self).model_fields[f].default]
        if self.kind != "judge":
            if judging:
                raise ValueError(f"{judging[0]}: a judge's setting; this model's kind is {self.kind}")
            return self
        if self.template is None:
            raise ValueError("kind judge needs a `template`: the prompt it reads, with {answer}")
        check_template(self.template)
        if self.verdict == "letter" and not self.letters:
            raise ValueError("verdict letter needs `letters`: each letter's value, e.g. {A: 1.0, B: 0.0}")
        if self.scale is not None and not self.scale[0] < self.scale[1]:
            raise ValueError(f"scale {list(self.scale)}: lo must be below hi")
        return self
