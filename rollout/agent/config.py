"""The YAML `agent:` section: multi-turn rollouts, either a conversation in which the model calls tools (`tools`)
or an environment that answers each turn (`environment`). Absent: today's one prompt -> one completion."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from ckpt_transfer.config import StrictModel

from ..user_functions import resolve_in_config

ENVIRONMENTS = ("guess", "code_feedback")


class PythonToolConfig(StrictModel):
    """The built-in `python` tool: one sandbox session (a Jupyter-style interpreter) per trajectory."""

    cell_timeout_s: float = Field(10.0, gt=0, description="Seconds one call's code may run; past it the "
                                  "interpreter is restarted, the call fails as a timeout and the model reads so.")
    session_ttl_s: float = Field(300.0, gt=0, description="Seconds an idle session lives before the sandbox reaps "
                                 "it (what ends the sessions of a run that died).")
    memory_mb: int = Field(256, gt=0, description="Memory limit of each session's interpreter, in MiB.")


class AgentConfig(StrictModel):
    tools: list[str] = Field([], description="Tools the model may call: `python` (code run in a sandbox session "
                             "of the trajectory's own) and user functions, found as reward functions are: "
                             "\"path/to/file.py:function\" (relative to the config file's directory) or "
                             "\"package.module:function\" (importable from the installed packages, the config "
                             "file's directory or the working directory); typed, with a Google-style docstring: "
                             "their OpenAI schema is derived from it. A trajectory ends at the first turn without a "
                             "call; the task's scorer or `rewards:` score its last turn.")
    environment: Literal["guess", "code_feedback"] | None = Field(
        None, description="An environment answering every turn, instead of tools: `guess` (task.name guess: "
        "higher/lower feedback, reward falling with the number of guesses) or `code_feedback` (task.name code: "
        "the failing tests go back to the model; reward: the last attempt's pass fraction). It scores the "
        "trajectory itself.")
    tool_parser: Literal["hermes", "llama3_json"] = Field(
        "hermes", description="How tool calls are read from the model's text: `hermes` (<tool_call>{json}"
        "</tool_call>, Qwen's) or `llama3_json` (a JSON object per call, Llama 3.x's).")
    max_turns: int = Field(4, ge=1, description="Model turns per trajectory at most.")
    max_total_tokens: int = Field(512, gt=0, description="Tokens after the prompt per trajectory at most (the "
                                  "model's and the inserted ones): a turn never runs past it, and a reply that "
                                  "would ends the trajectory.")
    max_tokens_per_turn: int | None = Field(None, gt=0, description="Tokens one model turn may generate; null: "
                                            "rollout.max_new_tokens.")
    max_tool_response_tokens: int = Field(128, gt=0, description="What the model reads of a tool's output: its "
                                          "first this many tokens; of an environment's reply: its first line and "
                                          "its last tokens (errors, verdicts), this many in all; with a note of "
                                          "how many were cut.")
    tool_timeout_s: float = Field(30.0, gt=0, description="Seconds a tool call may take before it fails as a "
                                  "timeout (the model reads the error; counted in tools/timeouts).")
    max_parallel_calls: int = Field(4, ge=1, description="Tool calls of one trajectory running at once (the threads "
                                    "its sync tools may hold, a hung one's included): one trajectory's calls never "
                                    "hold what another's need. A stateful tool (`python`) takes a turn's calls one "
                                    "after another, in the order written.")
    overlap: bool | None = Field(None, description="Call the engines for the trajectories whose tools have "
                                 "answered while other trajectories' tools still run (tool time hides behind "
                                 "generation); false: every live trajectory advances one turn per engine call, in "
                                 "lockstep. null: overlap unless `deterministic` (which trajectories share an engine "
                                 "call then depends on tool timings).")
    python: PythonToolConfig = Field(PythonToolConfig(), description="The built-in `python` tool's sandbox "
                                     "sessions.")

    @field_validator("tools")
    @classmethod
    def _found_from_config(cls, tools: list[str], info: ValidationInfo) -> list[str]:
        """Files and modules beside the config as absolute paths in the resolved config (rollout/user_functions.py)."""
        return [spec if spec == "python" else resolve_in_config(spec, info) for spec in tools]

    @model_validator(mode="after")
    def _tools_or_environment(self) -> "AgentConfig":
        if bool(self.tools) == (self.environment is not None):
            raise ValueError("agent: give either `tools` (a conversation with tool calls) or `environment` (an "
                             "environment answering each turn), not both and not neither")
        for spec in self.tools:
            if spec != "python" and ":" not in spec:
                raise ValueError(f"agent.tools: {spec!r} is neither `python` nor \"package.module:function\" nor "
                                 f"\"path/to/file.py:function\"")
        if len(set(self.tools)) != len(self.tools):
            raise ValueError("agent.tools: a tool is listed twice")
        return self

    @property
    def uses_sandbox(self) -> bool:
        return "python" in self.tools or self.environment == "code_feedback"
